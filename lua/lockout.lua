-- Lockouts: after a limit with a lockout D (ms, the 5th field of a limit; 0 = none)
-- denies a key, the key is blocked for D. The block is one key beside the limit's, with
-- the same hash tag, holding the time the block ends, and it expires then (SET PX).
-- Requests during a block do not extend it. Mirrors src/algorithm/lockout.rs.

-- block key -> the time its block ends (0: none), read once per call: main.lua empties
-- it (nil) at the start of each call, the first read makes it.
local blocks

-- Milliseconds left on the block in `key` at `now`. A block keeps the end it was given
-- when the lockout changes (a limit whose lockout was removed does not read it).
local function lockout_left(key, now)
  if blocks == nil then blocks = {} end
  local ends = blocks[key]
  if ends == nil then
    ends = redis.call('GET', key)
    ends = ends and ends + 0 or 0
    blocks[key] = ends
  end
  return math.max(ends - now, 0)
end

-- A limit with a lockout that denied a request (out[n + 1..4] its result): starts a block
-- unless one runs, and reports it: retry_after and reset_after at least the time left,
-- and remaining as minus the time left (the caller reads remaining 0, and the time the
-- block lasts, which its cache of denials needs). A peek reports the block it would
-- start and starts none.
local function lockout_deny(out, n, key, D, now, peek)
  local left = lockout_left(key, now)
  if left == 0 then
    left = D
    if not peek then
      blocks[key] = now + D
      set_expiring(key, now + D, D)
    end
  end
  out[n + 2] = -left
  out[n + 3] = math.max(out[n + 3], left)
  out[n + 4] = math.max(out[n + 4], left)
end

-- Pending units (a limit whose lockout field carries PENDING, 2^50, added to D: a layer
-- that counts after the response; mirrors Pending in src/algorithm/lockout.rs). The units
-- of the requests such a limit allowed stay pending until their response settles them
-- (an adjustment with `kept`, in main.lua), and a request it denies starts a block only
-- when the units kept breach it: requests in flight never start one. The pending units
-- live in a hash beside the block key, `<limit key>:pending` {s: the window start of the
-- newest charge (aligned, now - now % W), c: units pending from that window, p: from the
-- window before}, expiring when it stops mattering (at s + 2W).
local PENDING = 1125899906842624

local function pending_read(pk)
  local v = redis.call('HMGET', pk, 's', 'c', 'p')
  return (tonumber(v[1]) or 0), (tonumber(v[2]) or 0), (tonumber(v[3]) or 0)
end

local function pending_write(pk, now, W, s, c, p)
  redis.call('HSET', pk, 's', s, 'c', c, 'p', p)
  expire(pk, math.max(s + 2 * W - now, 1))
end

-- The pending units that still count at `now`: the current window's, and but for the
-- fixed window (code 1, whose previous window is over) the previous window's too.
local function pending_live(pk, now, W, fixed)
  local s, c, p = pending_read(pk)
  local at = now - now % W
  if at <= s then
    if fixed then return c end
    return c + p
  elseif at == s + W and not fixed then
    return c
  end
  return 0
end

-- Counts `units` charged at `now` as pending.
local function pending_add(pk, now, W, units)
  local s, c, p = pending_read(pk)
  local at = now - now % W
  if at > s then
    if at == s + W then p = c else p = 0 end
    c, s = 0, at
  end
  pending_write(pk, now, W, s, c + units, p)
end

-- Ends `units` charged at `at` being pending: nothing once their window is not held.
local function pending_release(pk, now, W, units, at)
  local s, c, p = pending_read(pk)
  local charged = at - at % W
  if charged == s then
    c = c - math.min(units, c)
  elseif charged + W == s then
    p = p - math.min(units, p)
  else
    return
  end
  pending_write(pk, now, W, s, c, p)
end

-- Whether a request of `cost` that limit (state `s`) denied, finding no block, would fit
-- with its pending units given back: then requests in flight denied it, and it starts no
-- block.
local function kept_fit(limit, pk, s, now, cost)
  local u = pending_live(pk, now, limit.W, limit.code == 1)
  if cost <= u then return true end
  return cost <= limit.B and limit.alg.fits(s, now, limit.L, limit.W, limit.B, cost - u)
end
