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
