-- KEYS: one key per limit of each request, in order.
-- ARGV[1]: now in ms, or "" to read Redis TIME (one clock for every replica).
-- ARGV[2]: the number of requests N; then for each request: cost, number of limits M,
--          and for each limit: algorithm code, limit, window ms, capacity (burst).
-- Returns, for each limit of each request in order: allowed (0/1), remaining,
-- reset_after ms, retry_after ms. A request is allowed when all its limits are.
local algorithms = {
  fixed_window, sliding_window, sliding_window_counter, token_bucket, gcra,
}

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

local out = {}
local a = 3
local k = 1
for _ = 1, tonumber(ARGV[2]) do
  local cost = tonumber(ARGV[a])
  local m = tonumber(ARGV[a + 1])
  a = a + 2
  local checks = {}
  local all_fit = true
  for i = 1, m do
    local c = {
      algorithm = algorithms[tonumber(ARGV[a])],
      L = tonumber(ARGV[a + 1]),
      W = tonumber(ARGV[a + 2]),
      B = tonumber(ARGV[a + 3]),
      key = KEYS[k],
    }
    a = a + 4
    k = k + 1
    c.state = c.algorithm.load(c.key, now, c.L, c.W, c.B)
    c.state.key = c.key
    c.fits = cost <= c.B and c.algorithm.fits(c.state, now, c.L, c.W, c.B, cost)
    c.retry = 0
    if not c.fits then
      all_fit = false
      if cost > c.B then
        c.retry = c.W
      else
        c.retry = c.algorithm.wait(c.state, now, c.L, c.W, c.B, cost)
      end
    end
    checks[i] = c
  end
  for i = 1, m do
    local c = checks[i]
    if all_fit then
      c.algorithm.commit(c.state, c.key, now, c.L, c.W, c.B, cost)
    end
    out[#out + 1] = c.fits and 1 or 0
    out[#out + 1] = c.algorithm.remaining(c.state, now, c.L, c.W, c.B)
    out[#out + 1] = c.algorithm.reset_after(c.state, now, c.L, c.W, c.B)
    out[#out + 1] = c.retry
  end
end
return out
