-- Sliding window log: a sorted set of weighted entries, one per millisecond that had
-- requests, scored by that time. The units of the log are numbered in the order they
-- were written, and member "<from>:<to>" holds units from .. to - 1: the units in the
-- window are to(newest) - from(oldest in the window), read with two O(log n) lookups,
-- and a request of any cost writes one member. Members are unique (their ranges never
-- overlap) and in score order: a clock that stepped back logs its units at the newest
-- entry's time, and a second call in the same millisecond replaces that entry with a
-- wider one. The log changes only when a request is allowed: entries that have left the
-- window are dropped by the next write (a denied request from a clock ahead must not drop
-- what a clock a little behind still counts). Mirrors src/algorithm/sliding_window.rs.
-- (Earlier builds kept one member "<time>:<n>" per unit under limit id "sw"; the id is
-- now "sw2", so the two formats never meet in one key: old keys expire within a window.)
-- Defined on first use, so a call pays only for the algorithms it runs.
local function define_sliding_window()
  local sliding_window = {}

  -- The entry at `index` (0 = oldest, -1 = newest): from, to, time; nil when empty.
  local function entry(key, index)
    local e = redis.call('ZRANGE', key, index, index, 'WITHSCORES')
    if e[1] == nil then return nil end
    local from, to = string.match(e[1], '^(%d+):(%d+)$')
    return from + 0, to + 0, e[2] + 0
  end

  function sliding_window.load(key, now, L, W, B)
    -- base: the number of the oldest unit in the window (an entry at t counts while
    -- now - t < W); top: one past the newest unit's, this call's included. newest_*: the
    -- stored newest entry (newest_at = false: none), in the window or not. at: the time
    -- this call's units are logged at; pending: how many this call has committed.
    -- oldest: the member of the oldest entry in the window (false: none).
    local s = {
      key = key, changed = false, count = 0, base = 0, top = 0, oldest = false,
      newest_from = 0, newest_to = 0, newest_at = false, at = now, pending = 0,
    }
    local newest_from, newest_to, newest_at = entry(key, -1)
    if newest_from then
      s.newest_from, s.newest_to, s.newest_at = newest_from, newest_to, newest_at
      s.base, s.top = newest_to, newest_to
      s.at = math.max(now, newest_at)
      if newest_at + W > now then
        local e = redis.call('ZRANGEBYSCORE', key, '(' .. int(now - W), '+inf', 'LIMIT', 0, 1)
        s.oldest = e[1]
        s.base = string.match(e[1], '^(%d+):') + 0
        s.count = newest_to - s.base
      end
    end
    return s
  end

  function sliding_window.fits(s, now, L, W, B, cost)
    return s.count + cost <= L
  end

  function sliding_window.wait(s, now, L, W, B, cost)
    -- The oldest (count + cost - L) units must leave the window first: the entry holding
    -- unit number `last` leaves last of them. Found by bisection on the numbering, which
    -- grows with the entries' order: O(log^2 n) in Redis, whatever the costs.
    local last = s.base + s.count + cost - L - 1
    if last >= s.newest_to then return s.at + W - now end -- in this call's entry
    local lo, hi = redis.call('ZRANK', s.key, s.oldest), redis.call('ZCARD', s.key) - 1
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      local _, to = entry(s.key, mid)
      if to > last then hi = mid else lo = mid + 1 end
    end
    local _, _, at = entry(s.key, lo)
    return at + W - now
  end

  -- Counted here; one member is written by save, whatever the cost.
  function sliding_window.commit(s, now, L, W, B, cost)
    s.count = s.count + cost
    s.top = s.top + cost
    s.pending = s.pending + cost
  end

  -- Writes first, removes after: the key never becomes empty (deleted) within the
  -- script. In a Redis Cluster slot being migrated, a write to a key the script had just
  -- deleted is refused (ASK) half-way through the script, losing the log.
  function sliding_window.save(s, now, L, W, B)
    if s.pending == 0 then return end
    if s.newest_at == s.at then
      -- The newest entry is at this millisecond: it grows (members stay one per time).
      redis.call('ZADD', s.key, s.at, int(s.newest_from) .. ':' .. int(s.top))
      redis.call('ZREM', s.key, int(s.newest_from) .. ':' .. int(s.newest_to))
    else
      redis.call('ZADD', s.key, s.at, int(s.newest_to) .. ':' .. int(s.top))
    end
    redis.call('ZREMRANGEBYSCORE', s.key, '-inf', now - W)
    expire(s.key, s.at + W - now)
  end

  function sliding_window.remaining(s, now, L, W, B)
    return math.max(L - s.count, 0)
  end

  function sliding_window.reset_after(s, now, L, W, B)
    if s.pending > 0 then return s.at + W - now end
    if s.newest_at then return math.max(s.newest_at + W - now, 0) end
    return 0
  end

  if adjusting then -- adjustments after a response (see main.lua)
    -- Out of the entry logged at `at`, while it is in the window. The units of every newer
    -- entry are numbered `taken` lower (ZADD the new member, then ZREM the old, oldest
    -- first, so no two members ever collide and the key never empties): as many writes as
    -- entries since `at`, at most L. An entry left with no units goes, unless it is the
    -- only one. This call's commits are written first; the state is read again after.
    function sliding_window.refund(s, now, L, W, B, units, at)
      if at + W <= now then return end
      if s.pending > 0 then sliding_window.save(s, now, L, W, B) end
      local e = redis.call('ZRANGEBYSCORE', s.key, at, at)
      if e[1] ~= nil then
        local from, to = string.match(e[1], '^(%d+):(%d+)$')
        from, to = from + 0, to + 0
        local taken = math.min(units, to - from)
        if taken > 0 then
          local newer = redis.call('ZRANGEBYSCORE', s.key, '(' .. int(at), '+inf', 'WITHSCORES')
          if to - taken == from and redis.call('ZCARD', s.key) > 1 then
            redis.call('ZREM', s.key, e[1])
          else
            redis.call('ZADD', s.key, at, int(from) .. ':' .. int(to - taken))
            redis.call('ZREM', s.key, e[1])
          end
          for i = 1, #newer, 2 do
            local f, t = string.match(newer[i], '^(%d+):(%d+)$')
            redis.call('ZADD', s.key, newer[i + 1], int(f - taken) .. ':' .. int(t - taken))
            redis.call('ZREM', s.key, newer[i])
          end
        end
      end
      local fresh = sliding_window.load(s.key, now, L, W, B)
      for field, value in pairs(fresh) do
        if field ~= 'changed' then s[field] = value end
      end
    end

    -- Logged now as a request would be, but the window never holds more than L.
    function sliding_window.top_up(s, now, L, W, B, units)
      local room = math.max(L - s.count, 0)
      if math.min(units, room) > 0 then
        sliding_window.commit(s, now, L, W, B, math.min(units, room))
      end
    end
  end
  return sliding_window
end
