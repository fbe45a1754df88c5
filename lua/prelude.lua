-- tollgate: every rate-limit algorithm in one script, so that a single EVALSHA decides
-- a batch of requests, each against several limits, all-or-nothing.
--
-- All numbers are integers below 2^53 (Limit's validation keeps them there), so Lua's
-- doubles compute them exactly and the results equal the Rust reference model's.
--
-- Speed: every call runs this whole file, and on a small VM a Lua C call costs about
-- 0.1 us, a redis.call 0.3-1 us. So numbers go to redis.call as Lua numbers (Redis prints
-- them itself, exactly below 2^53: "%.17g", or an integer printer since 7.2), never
-- through string.format, unless the string can be kept and reused (that print costs
-- about 2 000 instructions before 7.2: fixed_window.lua's fw_units); ARGV strings become
-- numbers by arithmetic (`s + 0`, done in the VM, about twice as fast as tonumber); and a
-- state table is built with all its fields.
--
-- The same text is also a Redis Functions library (Redis 7+, src/store/redis/function.rs
-- builds it): everything before main.lua's "Per call" line then runs once, when the
-- library loads, and the rest is the function's body, run per call. So what belongs to
-- one call (the keys, the arguments, ttl_margin, the lockout blocks read) is set there,
-- in every call, and nothing here holds a call's state across calls.

-- The call's keys and arguments: EVAL's globals; a library's function sets them per call.
local KEYS, ARGV = KEYS, ARGV

-- An integer as a decimal string, for values built in Lua (tostring would switch to
-- exponent notation).
local function int(x)
  return string.format('%d', x)
end

-- ceil(a / b) for integers, b > 0.
local function ceil_div(a, b)
  return math.ceil(a / b)
end

-- Milliseconds added to every TTL. 0 when the script reads Redis TIME: then expiry and
-- decisions share one clock. When the caller sends its own clock, that clock may lag
-- Redis's, and a key must never vanish before the caller's time says its state is
-- worthless: `clock` sets a margin (in every call: one library serves both kinds).
local ttl_margin = 0

-- Whether `/` yields a float even for an exact quotient (Lua 5.3 and later: Dragonfly's
-- 5.4; Redis and Valkey run 5.1, whose numbers are all doubles). Then an exact quotient
-- goes through math.floor before it reaches a command (INCRBY takes no "3.0") or the
-- reply. Set by `clock`, which every call runs first, in a library's first call only
-- (it loads without the math library; the lookup costs some 700 instructions, math.floor
-- on every request about 600 each).
local floats

-- A call's `now` in ms from its first argument: the caller's clock, or "" to read Redis
-- TIME (one clock for every replica). Sets the call's ttl_margin: 5 s with the caller's
-- clock, for it to lag Redis's.
local function clock(arg)
  if floats == nil then floats = math.type ~= nil end
  if arg ~= '' then
    ttl_margin = 5000
    return arg + 0
  end
  ttl_margin = 0
  local time = redis.call('TIME')
  return time[1] * 1000 + math.floor(time[2] / 1000)
end

-- Sets the TTL of a key the script just wrote: every written key gets one.
local function expire(key, ttl)
  redis.call('PEXPIRE', key, ttl + ttl_margin)
end

-- Whether the algorithms define their adjustments (refund, top_up): only once a call
-- has one (main.lua sets it), so that a call of plain requests creates no closures for them.
-- (In a library it stays set once a call had one: the definitions are kept, refunds too.)
local adjusting = false

-- Whether the bucket algorithms define their reservations (can_reserve, reserve): only
-- once a call has a reservation (main.lua sets it), for the same reason.
local reservations = false

-- Writes a string key and its TTL in one command (`ttl` is at least 1 ms).
local function set_expiring(key, value, ttl)
  redis.call('SET', key, value, 'PX', math.max(ttl, 1) + ttl_margin)
end
