-- The library's second function (Redis 7+, src/store/redis/function.rs): one request
-- against one fixed window, the commonest call on a cluster, where a call may only hold
-- one hash slot's keys and so most calls carry one decision. It skips the general
-- function's parsing of groups and sections: about half the instructions of a call.
-- Only in the library (EVALSHA sends such a request to main.lua, which decides it alike).
-- KEYS: the limit's key. ARGV: now in ms, or "" to read Redis TIME; limit; window ms;
-- cost (1 to limit). Returns what main.lua returns for one request with one limit:
-- allowed, remaining, reset_after, retry_after, and the `now` it decided at.
local function decide_fixed_window(keys, args)
  local now = clock(args[1])
  local L, W = args[2] + 0, args[3] + 0
  local start = now - now % W
  local window = { start = start, tag = fw_tag(start, W), opened = false }
  local allowed, remaining, reset_after, retry_after =
    fw_count(keys[1], now, L, W, args[4] + 0, window)
  return { allowed, remaining, reset_after, retry_after, now }
end
