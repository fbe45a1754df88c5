-- KEYS: one key per limit of each request, in order.
-- ARGV[1]: now in ms, or "" to read Redis TIME (one clock for every replica). With an
--          explicit now, TTLs get 5 s of margin for the caller's clock to lag Redis's.
-- ARGV[2]: the number of limit groups G (each distinct list of limits in the call, sent
--          once); then for each group: its number of limits M, and for each limit:
--          algorithm code, limit, window ms, capacity (burst), lockout ms (0: none;
--          plus 2^50: the lockout counts the units it allows as pending until settled,
--          lockout.lua).
-- Then the number of requests N, and for each request: cost, group (1-based). A
-- negative group -g peeks: the request is decided against group g, and its answer is
-- the one it would get, but nothing is committed or saved (no block is started either).
-- A negative cost is an adjustment after a response, of -cost units, followed by one more
-- argument `at`: at >= 0 gives the units back (a refund) to the state a decision made at
-- `at` ms (its now) charged them to; at = -1 charges them late (a top-up), counted even
-- over the limit. An adjustment's limits all answer allowed, with the state after it (a
-- lockout block is neither read nor started by one). An adjustment with at <= -2 is a
-- settle: -cost units charged at -2 - at ms, followed by one more argument `kept`, the
-- units the request costs in the end: the charged units stop being pending (for the
-- limits that count them), and the difference is given back (kept < charged) or charged
-- late (kept > charged).
-- A request's keys are its limits' keys, then one block key per limit with a lockout, in
-- the order of those limits (lockout.lua), each followed by its pending key
-- (`<limit key>:pending`) when its lockout counts pending units.
-- Leases (optional, lua/lease.lua): after the requests, the number of asks A and for
-- each: request index (1-based), units wanted; then the number of returns R and for each:
-- group index, index in KEYS of its first key, units, and one window start per limit of
-- the group. Returns run before the requests. Without these sections nothing changes.
-- An ask beside a peek or an adjustment, or for a group with a lockout limit (or a
-- sliding-window log), is granted nothing.
-- Reservations (optional): after the lease sections (then present, as "0 0" when there
-- are no asks or returns), the number of reserving requests V and for each: request
-- index (1-based), max wait ms. Such a request that does not fit now but would within
-- its max wait, under limits that are all token buckets or GCRAs without lockouts, is
-- allowed *reserved*: its units are committed now as if it arrived `wait` ms later
-- (reserve() in token_bucket.lua / gcra.lua; rules in src/algorithm/mod.rs
-- check_reserving), and each of its limits answers allowed 1 with retry_after = the
-- wait (> 0; an allowed limit answers 0 otherwise). A reserving request gets no lease.
-- Without this section nothing changes.
-- Permits (optional, lua/in_flight.lua): after the reservations (then present, as "0"
-- when there are none, and the lease sections as "0 0"), the number of requests P that
-- take or give back an in-flight permit, and for each: request index (1-based), permit
-- id. Such a request's group ends with its in-flight limit (code 6): a request takes
-- the permit when all its limits allow it (or reserve it, when the cap has room: the
-- permit is then taken now, held while the request waits), an adjustment gives it back.
-- Without this section nothing changes.
--
-- Returns (empty when there are no requests), in this order:
-- 1. for each limit of each request in order: allowed (0/1), remaining (minus the time
--    left on a lockout block when one blocks it), reset_after ms, retry_after ms. A
--    request is allowed when all its limits are;
-- 2. for each ask in the order of the asks: units granted (0 when its request was
--    denied), ms until the lease ends, and each limit's window start;
-- 3. once, last: the `now` the call decided at (ms), for a later refund's `at`.
--
-- Requests are decided one after the other, exactly as N separate calls would decide
-- them. A key that several requests touch is read once and written once, at the end:
-- its state stays in `states` in between (`now` does not move within a call).
--
-- Each algorithm's load(key, now, L, W, B) returns its state as a table that also holds
-- `key` and `changed` (false; set here to the limit that saves it once it commits).
local definitions = {
  define_fixed_window, define_sliding_window, define_sliding_window_counter,
  define_token_bucket, define_gcra, define_in_flight,
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

-- Per call: from here on, once per call (a library's function body; see prelude.lua).
local now = clock(ARGV[1])
blocks = nil

local a = 3
local groups = {}
for g = 1, ARGV[2] + 0 do
  local group = {}
  local m = ARGV[a] + 0
  local extra = 0 -- block and pending keys so far: they follow the m keys
  for i = 1, m do
    local D = ARGV[a + 5] + 0
    local bk, pk = 0, nil
    local pend = D >= PENDING
    if pend then D = D - PENDING end
    if D > 0 then
      bk = m + extra
      extra = extra + 1
      if pend then
        pk = m + extra
        extra = extra + 1
      end
    end
    group[i] = {
      code = ARGV[a + 1] + 0,
      alg = algorithm(ARGV[a + 1] + 0),
      L = ARGV[a + 2] + 0,
      W = ARGV[a + 3] + 0,
      B = ARGV[a + 4] + 0,
      D = D,
      bk = bk, -- the block key's offset among the request's keys
      pk = pk, -- the pending key's (nil: no pending units)
    }
    a = a + 5
  end
  a = a + 1
  group.keys = m + extra
  local limit = group[1]
  if m == 1 and limit.code == 1 and limit.D == 0 then
    -- The commonest shape, decided by the one-limit path below: its window and tag.
    group.start = now - now % limit.W
    group.tag = fw_tag(group.start, limit.W)
  end
  groups[g] = group
end

-- The lease sections follow the requests (an adjustment has one argument more than a
-- request): looked for only when ARGV goes on past N plain requests.
local asks, reserving, reservation, permits
if #ARGV > a + 2 * ARGV[a] then
  local e = a + 1
  for _ = 1, ARGV[a] + 0 do
    if ARGV[e] + 0 < 0 then
      -- An adjustment: `at`, and `kept` after a settle's.
      if ARGV[e + 2] + 0 <= -2 then e = e + 4 else e = e + 3 end
    else
      e = e + 2
    end
  end
  asks, e = lease_sections(e, groups, now)
  local p = e -- the permits section follows the reservations
  if ARGV[e] ~= nil then
    p = e + 1 + 2 * ARGV[e]
  end
  if ARGV[e] ~= nil and ARGV[e] + 0 > 0 then
    reserving = {}
    for _ = 1, ARGV[e] + 0 do
      reserving[ARGV[e + 1] + 0] = ARGV[e + 2] + 0
      e = e + 2
    end
    -- The bucket algorithms' reservations, defined now (as adjustments are, below).
    reservations = true
    -- (The in-flight limit, code 6, defines its own at once: it keeps the permit id.)
    for code, defined in pairs(algorithms) do
      if code == 4 or code == 5 then
        local full = definitions[code]()
        defined.can_reserve, defined.reserve = full.can_reserve, full.reserve
      end
    end
    -- The wait request `cost` of `group` may reserve (see the header), 0 when it may not:
    -- `held` and `retries` are its limits' states and waits. Made only by a call with
    -- reservations (a function at the top would be made by every call).
    -- An in-flight limit (code 6) in the group is not reserved: it must have room now
    -- (a full cap reserves nothing), and a reservation takes its permit now.
    reservation = function(group, held, retries, now, cost, max)
      local w = 0
      for i = 1, #group do
        local limit = group[i]
        if limit.code == 6 then
          if retries[i] > 0 then return 0 end
        else
          if limit.code < 4 or limit.D > 0 or cost > limit.B then return 0 end
          if retries[i] > w then w = retries[i] end
        end
      end
      if w == 0 or w > max then return 0 end
      for i = 1, #group do
        local limit = group[i]
        -- At most 2^51 units ahead (MAX_RESERVED in src/algorithm/mod.rs): all stays exact.
        if limit.code ~= 6 and (w * limit.L > 2251799813685248
            or not limit.alg.can_reserve(held[i], now)) then
          return 0
        end
      end
      return w
    end
  end
  if ARGV[p] ~= nil then
    permits = {}
    for i = 1, ARGV[p] + 0 do
      permits[ARGV[p + 2 * i - 1] + 0] = ARGV[p + 2 * i]
    end
  end
end

local tail = {} -- the asks' results, after the requests'

local states = {} -- key -> state, loaded on first use (false: counted by the one-limit path)
local changed = {} -- states committed to, in order: saved at the end
local out = { 0, 0, 0, 0, 0 } -- sized for one request with one limit and `now`: no regrowth
local n = 0
local k = 1
-- Per-limit scratch space, reused by every request.
local held, fits, retries = { false }, { false }, { 0 } -- (sized for one limit)

for r = 1, ARGV[a] + 0 do
  local cost = ARGV[a + 1] + 0
  local g = ARGV[a + 2] + 0
  local peek = g < 0
  if peek then g = -g end
  local group = groups[g]
  a = a + 2
  if permits then algorithm(6).id = permits[r] end
  local m = #group
  local limit = group[1]
  local key = KEYS[k]
  if group.tag and states[key] == nil and KEYS[k + 1] ~= key and cost > 0
    and cost <= limit.L and not peek and not (asks and asks[r]) then
    -- One fixed window, counted in place (fw_count: one INCRBY that keeps the key's TTL).
    -- Not for a key that the next request has too (a coalesced hot key), nor one that an
    -- earlier request had: those take the path below, which reads the key once, counts in
    -- Lua and writes once at the end, cheaper than an INCRBY each. (`false` in `states`:
    -- counted here, to be read again by a later request.)
    states[key] = false
    out[n + 1], out[n + 2], out[n + 3], out[n + 4] =
      fw_count(key, now, limit.L, limit.W, cost, group, redis.call)
    n = n + 4
    m = 0 -- decided (k moves past the request's key below)
  end
  if cost < 0 then
    -- An adjustment of -cost units: a refund (at >= 0) or a top-up (at = -1). Written
    -- here rather than as a function, so that calls without one create no closure.
    local units, at = -cost, ARGV[a + 1] + 0
    a = a + 1
    if at <= -2 then
      -- A settle: the charged units stop being pending; the difference moves.
      local kept = ARGV[a + 1] + 0
      a = a + 1
      at = -2 - at
      for i = 1, m do
        local limit = group[i]
        if limit.pk then pending_release(KEYS[k + limit.pk], now, limit.W, units, at) end
      end
      if kept < units then
        units = units - kept
      elseif kept > units then
        units, at = kept - units, -1
      else
        units = 0
      end
    end
    for i = 1, m do
      local limit = group[i]
      local alg, L, W, B = limit.alg, limit.L, limit.W, limit.B
      if alg.refund == nil then
        -- The first adjustment of the call: the algorithm's adjustments, defined now.
        adjusting = true
        for code, defined in pairs(algorithms) do
          if defined == alg then
            local full = definitions[code]()
            alg.refund, alg.top_up = full.refund, full.top_up
          end
        end
      end
      local key = KEYS[k + i - 1]
      local s = states[key]
      if not s then
        s = alg.load(key, now, L, W, B)
        states[key] = s
      end
      if units == 0 then
        -- A settle that keeps what it charged: the state stays as it is.
      elseif at >= 0 then
        alg.refund(s, now, L, W, B, units, at)
      else
        alg.top_up(s, now, L, W, B, units)
      end
      if units > 0 and not s.changed then
        s.changed = limit
        changed[#changed + 1] = s
      end
      out[n + 1] = 1
      out[n + 2] = alg.remaining(s, now, L, W, B)
      out[n + 3] = alg.reset_after(s, now, L, W, B)
      out[n + 4] = 0
      n = n + 4
    end
    m = 0 -- nothing more to decide (k moves past the request's keys below)
  end
  local all_fit = true
  for i = 1, m do
    local limit = group[i]
    local alg, L, W, B = limit.alg, limit.L, limit.W, limit.B
    local key = KEYS[k + i - 1]
    local s = states[key]
    if not s then
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
    if limit.D > 0 then
      local left = lockout_left(KEYS[k + limit.bk], now)
      if left > 0 then
        fit, all_fit, retry = false, false, math.max(retry, left)
      end
    end
    held[i], fits[i], retries[i] = s, fit, retry
  end
  local wait = 0
  if not all_fit and reserving and reserving[r] and not peek and m > 0 then
    wait = reservation(group, held, retries, now, cost, reserving[r])
  end
  for i = 1, m do
    local limit = group[i]
    local alg, L, W, B = limit.alg, limit.L, limit.W, limit.B
    local s = held[i]
    local kept -- a peek's copy of the state, put back once answered
    if all_fit then
      if peek then
        kept = {}
        for f, v in pairs(s) do kept[f] = v end
      end
      alg.commit(s, now, L, W, B, cost)
      if not peek and not s.changed then
        s.changed = limit
        changed[#changed + 1] = s
      end
      if limit.pk and not peek then pending_add(KEYS[k + limit.pk], now, W, cost) end
    elseif wait > 0 then
      alg.reserve(s, now, L, W, B, cost, wait)
      if not s.changed then
        s.changed = limit
        changed[#changed + 1] = s
      end
    end
    out[n + 1] = (fits[i] or wait > 0) and 1 or 0
    out[n + 2] = alg.remaining(s, now, L, W, B)
    out[n + 3] = alg.reset_after(s, now, L, W, B)
    out[n + 4] = wait > 0 and wait or retries[i]
    if limit.D > 0 and not fits[i] and not (limit.pk
        and lockout_left(KEYS[k + limit.bk], now) == 0
        and kept_fit(limit, KEYS[k + limit.pk], s, now, cost)) then
      -- (Denied by requests still in flight, the limit starts no block.)
      lockout_deny(out, n, KEYS[k + limit.bk], limit.D, now, peek)
    end
    n = n + 4
    if kept then
      for f in pairs(s) do s[f] = nil end
      for f, v in pairs(kept) do s[f] = v end
    end
  end
  local asked = asks and asks[r]
  if asked then
    if peek or cost < 0 then
      lease_none(#group, tail) -- a peek or an adjustment never takes a lease
    else
      lease_grant(group, held, now, all_fit and asked or 0, tail)
    end
  end
  k = k + group.keys
end

for i = 1, #changed do
  local s = changed[i]
  local limit = s.changed
  limit.alg.save(s, now, limit.L, limit.W, limit.B)
end
if n == 0 then return {} end -- no requests: nothing of the presized table
for i = 1, #tail do
  out[n + i] = tail[i]
end
out[n + #tail + 1] = now
return out
