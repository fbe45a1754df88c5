-- tollgate: every rate-limit algorithm in one script, so that a single EVALSHA decides
-- a batch of requests, each against several limits, all-or-nothing.
--
-- All numbers are integers below 2^53 (Limit's validation keeps them there), so Lua's
-- doubles compute them exactly and the results equal the Rust reference model's.

-- An integer as a decimal string (tostring would switch to exponent notation).
local function int(x)
  return string.format('%d', x)
end

-- ceil(a / b) for integers, b > 0.
local function ceil_div(a, b)
  return math.ceil(a / b)
end
