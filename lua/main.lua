-- KEYS: one key per limit of each request, in order.
-- ARGV[1]: now in ms, or "" to read Redis TIME (one clock for every replica). With an
--          explicit now, TTLs get 5 s of margin for the caller's clock to lag Redis's.
-- ARGV[2]: the number of requests N; then for each request: cost, number of limits M,
--          and for each limit: algorithm code, limit, window ms, capacity (burst).
-- Returns, for each limit of each request in order: allowed (0/1), remaining,
-- reset_after ms, retry_after ms. A request is allowed when all its limits are.
local definitions = {
  define_fixed_window, define_sliding_window, define_sliding_window_counter,
  define_token_bucket, define_gcra,
}
local algorithms = {}
local function algorithm(code)
  local a = algorithms[code]
  if a == nil then
    a = definitions[code]()
    algorithms[code] = a
  end
  return a
end

local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
  ttl_margin = 5000
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

local out = {}
local n = 0
local a = 3
local k = 1
-- Per-limit scratch space, reused by every request of the batch.
local algos, Ls, Ws, Bs, keys, states, fits, retries = {}, {}, {}, {}, {}, {}, {}, {}
for _ = 1, tonumber(ARGV[2]) do
  local cost = tonumber(ARGV[a])
  local m = tonumber(ARGV[a + 1])
  a = a + 2
  local all_fit = true
  for i = 1, m do
    local alg = algorithm(tonumber(ARGV[a]))
    local L, W, B = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
    local key = KEYS[k]
    a = a + 4
    k = k + 1
    local s = alg.load(key, now, L, W, B)
    s.key = key
    local fit = cost <= B and alg.fits(s, now, L, W, B, cost)
    local retry = 0
    if not fit then
      all_fit = false
      if cost > B then
        retry = W
      else
        retry = alg.wait(s, now, L, W, B, cost)
      end
    end
    algos[i], Ls[i], Ws[i], Bs[i], keys[i], states[i], fits[i], retries[i] =
      alg, L, W, B, key, s, fit, retry
  end
  for i = 1, m do
    local alg, s, L, W, B = algos[i], states[i], Ls[i], Ws[i], Bs[i]
    if all_fit then
      alg.commit(s, keys[i], now, L, W, B, cost)
    end
    out[n + 1] = fits[i] and 1 or 0
    out[n + 2] = alg.remaining(s, now, L, W, B)
    out[n + 3] = alg.reset_after(s, now, L, W, B)
    out[n + 4] = retries[i]
    n = n + 4
  end
end
return out
