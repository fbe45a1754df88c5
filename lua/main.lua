-- KEYS: one key per limit of each request, in order.
-- ARGV[1]: now in ms, or "" to read Redis TIME (one clock for every replica). With an
--          explicit now, TTLs get 5 s of margin for the caller's clock to lag Redis's.
-- ARGV[2]: the number of limit groups G (each distinct list of limits in the call, sent
--          once); then for each group: its number of limits M, and for each limit:
--          algorithm code, limit, window ms, capacity (burst).
-- Then the number of requests N, and for each request: cost, group (1-based).
-- Returns, for each limit of each request in order: allowed (0/1), remaining,
-- reset_after ms, retry_after ms. A request is allowed when all its limits are.
--
-- Leases (optional, lua/lease.lua): after the requests, the number of asks A and for
-- each: request index (1-based), units wanted; then the number of returns R and for each:
-- group index, index in KEYS of its first key, units, and one window start per limit of
-- the group. Returns run before the requests. After the requests' results come, for each
-- ask in order: units granted (0 when its request was denied), ms until the lease ends,
-- and each limit's window start. Without these sections nothing changes.
--
-- Requests are decided one after the other, exactly as N separate calls would decide
-- them. A key that several requests touch is read once and written once, at the end:
-- its state stays in `states` in between (`now` does not move within a call).
--
-- Each algorithm's load(key, now, L, W, B) returns its state as a table that also holds
-- `key` and `changed` (false; set here to the limit that saves it once it commits).
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
  now = ARGV[1] + 0
  ttl_margin = 5000
else
  local time = redis.call('TIME')
  now = time[1] * 1000 + math.floor(time[2] / 1000)
end

local a = 3
local groups = {}
for g = 1, ARGV[2] + 0 do
  local group = {}
  for i = 1, ARGV[a] + 0 do
    group[i] = {
      code = ARGV[a + 1] + 0,
      alg = algorithm(ARGV[a + 1] + 0),
      L = ARGV[a + 2] + 0,
      W = ARGV[a + 3] + 0,
      B = ARGV[a + 4] + 0,
    }
    a = a + 4
  end
  a = a + 1
  groups[g] = group
end

local asks = lease_sections(a + 1 + 2 * (ARGV[a] + 0), groups, now)
local tail = {} -- the asks' results, after the requests'

local states = {} -- key -> state, loaded on first use
local changed = {} -- states committed to, in order: saved at the end
local out = { 0, 0, 0, 0 } -- sized for one request with one limit: no regrowth
local n = 0
local k = 1
-- Per-limit scratch space, reused by every request.
local held, fits, retries = { false }, { false }, { 0 } -- (sized for one limit)
for r = 1, ARGV[a] + 0 do
  local cost = ARGV[a + 1] + 0
  local group = groups[ARGV[a + 2] + 0]
  a = a + 2
  local m = #group
  local all_fit = true
  for i = 1, m do
    local limit = group[i]
    local alg, L, W, B = limit.alg, limit.L, limit.W, limit.B
    local key = KEYS[k + i - 1]
    local s = states[key]
    if s == nil then
      s = alg.load(key, now, L, W, B)
      states[key] = s
    end
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
    held[i], fits[i], retries[i] = s, fit, retry
  end
  for i = 1, m do
    local limit = group[i]
    local alg, L, W, B = limit.alg, limit.L, limit.W, limit.B
    local s = held[i]
    if all_fit then
      alg.commit(s, now, L, W, B, cost)
      if not s.changed then
        s.changed = limit
        changed[#changed + 1] = s
      end
    end
    out[n + 1] = fits[i] and 1 or 0
    out[n + 2] = alg.remaining(s, now, L, W, B)
    out[n + 3] = alg.reset_after(s, now, L, W, B)
    out[n + 4] = retries[i]
    n = n + 4
  end
  local asked = asks[r]
  if asked then
    lease_grant(group, held, now, all_fit and asked or 0, tail)
  end
  k = k + m
end

for i = 1, #changed do
  local s = changed[i]
  local limit = s.changed
  limit.alg.save(s, now, limit.L, limit.W, limit.B)
end
for i = 1, #tail do
  out[n + i] = tail[i]
end
if n + #tail == 0 then return {} end -- no requests: nothing of the presized table
return out
