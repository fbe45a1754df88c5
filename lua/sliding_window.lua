-- Sliding window log: a sorted set with one member per cost unit, scored by its time in
-- ms. Members are "<time>:<n>", n = 1.. within one millisecond: all members of one time
-- leave together, so ZCOUNT of that time gives the next free n. Mirrors
-- src/algorithm/sliding_window.rs.
-- Defined on first use, so a call pays only for the algorithms it runs.
local function define_sliding_window()
  local sliding_window = {}

  function sliding_window.load(key, now, L, W, B)
    -- An entry at t counts while now - t < W.
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - W)
    return { count = redis.call('ZCARD', key), key = key, changed = false }
  end

  function sliding_window.fits(s, now, L, W, B, cost)
    return s.count + cost <= L
  end

  function sliding_window.wait(s, now, L, W, B, cost)
    -- The oldest (count + cost - L) units must leave the window first.
    local i = s.count + cost - L - 1
    local entry = redis.call('ZRANGE', s.key, i, i, 'WITHSCORES')
    if entry[2] == nil then return W end
    return tonumber(entry[2]) + W - now
  end

  local function newest(key)
    local entry = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    return tonumber(entry[2])
  end

  -- The members go in at once (the set is the state); the TTL waits for save.
  function sliding_window.commit(s, now, L, W, B, cost)
    if cost == 0 then return end
    local at = int(now)
    -- Members already at this ms: counted once per call (now does not move in a call).
    if s.at == nil then s.at = redis.call('ZCOUNT', s.key, at, at) end
    local args = {}
    for i = 1, cost do
      args[#args + 1] = at
      args[#args + 1] = at .. ':' .. int(s.at + i)
      if #args >= 2000 or i == cost then
        redis.call('ZADD', s.key, unpack(args))
        args = {}
      end
    end
    s.at = s.at + cost
    s.count = s.count + cost
  end

  function sliding_window.save(s, now, L, W, B)
    local last = newest(s.key)
    if last then
      expire(s.key, last + W - now)
    end
  end

  function sliding_window.remaining(s, now, L, W, B)
    return math.max(L - s.count, 0)
  end

  function sliding_window.reset_after(s, now, L, W, B)
    local last = newest(s.key)
    if not last then return 0 end
    return last + W - now
  end
  return sliding_window
end
