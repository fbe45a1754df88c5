-- wrk script for the `zipf` scenario of bench/load.sh: every request names one of
-- 10 000 clients in the x-client header, client k with probability proportional to
-- 1 / k^1.1 (a Zipf law: client 1 sends about 15% of the requests, the first 10 about
-- 41%, the first 100 about 65%, the first 1000 about 84%, and the last 5000 about 4%
-- between them). The cumulative shares are computed once, each client's request is
-- formatted once (on first use, after wrk set the Host header), and a fixed seed makes
-- every run send the same sequence.
local clients, s = 10000, 1.1

local cumulative, total = {}, 0
for k = 1, clients do
  total = total + 1 / k ^ s
  cumulative[k] = total
end
for k = 1, clients do
  cumulative[k] = cumulative[k] / total
end
cumulative[clients] = 1

math.randomseed(20261130)
local requests = {}

request = function()
  local u = math.random()
  -- The first k whose cumulative share is at least u.
  local lo, hi = 1, clients
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if cumulative[mid] < u then
      lo = mid + 1
    else
      hi = mid
    end
  end
  local r = requests[lo]
  if r == nil then
    r = wrk.format(nil, nil, { ["x-client"] = tostring(lo) })
    requests[lo] = r
  end
  return r
end
