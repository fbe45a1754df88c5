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
  local allowed, remaining, reset_after, retry_after =
    fw_count(keys[1], now, L, W, args[4] + 0, fw_window(now, W), redis.call)
  return { allowed, remaining, reset_after, retry_after, now }
end

-- The library's third function (registered with the flag allow-cross-slot-keys): many
-- such requests in one call, of any hash slots, keys in ARGV. Sent where a call of one
-- slot's keys would not do: a batch of distinct cold keys on one Redis (it skips the
-- general function's groups), or on a cluster those of a batch whose slots live on the
-- master called (src/store/redis/nodes.rs; a call may declare one slot's keys only, so
-- none is declared). Redis checks every key a command of the script touches: a key of
-- a slot this node does not serve (moved, or migrating and the key already gone, or the
-- cluster is down) fails its command, which then writes nothing. On a cluster
-- (`elsewhere` "1") each request's first command is a pcall, and such a request answers
-- -1, 0, 0, 0: not decided, to be sent again on its own slot's path, which follows the
-- redirection. A key that passed its first command stays on this node for the rest of
-- the call (a script is atomic), so every request counts once, here or there. On one
-- Redis ("0") an error stops the call, as in the general function.
-- ARGV: now in ms, or "" to read Redis TIME; `elsewhere`; then per request its key,
-- limit, window ms and cost (1 to limit). Returns four values per request, as
-- decide_fixed_window, then the `now` it decided at.
local function decide_fixed_windows(keys, args)
  local now = clock(args[1])
  local first = redis.call
  if args[2] == '1' then first = redis.pcall end
  local reply, windows, n = {}, {}, 0
  for i = 3, #args - 3, 4 do
    local L, W = args[i + 1] + 0, args[i + 2] + 0
    local window = windows[W]
    if window == nil then
      window = fw_window(now, W)
      windows[W] = window
    end
    reply[n + 1], reply[n + 2], reply[n + 3], reply[n + 4] =
      fw_count(args[i], now, L, W, args[i + 3] + 0, window, first)
    n = n + 4
  end
  reply[n + 1] = now
  return reply
end
