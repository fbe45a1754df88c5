-- Sliding window counter: hash {s = window start, c = current count, p = previous count}.
-- The estimate, scaled by W: p * (W - elapsed) + c * W, compared with L * W. Mirrors
-- src/algorithm/sliding_window_counter.rs.
-- Defined on first use, so a call pays only for the algorithms it runs.
local function define_sliding_window_counter()
  local sliding_window_counter = {}

  function sliding_window_counter.load(key, now, L, W, B)
    local v = redis.call('HMGET', key, 's', 'c', 'p')
    local s = {
      start = tonumber(v[1]) or 0,
      current = tonumber(v[2]) or 0,
      previous = tonumber(v[3]) or 0,
      key = key,
      changed = false,
      elapsed = 0,
      lag = 0,
    }
    local start = now - now % W
    -- Only a later window rolls: a clock that stepped back keeps counting into the
    -- latest window (never that earlier window's budget again), as at its start.
    if start > s.start then
      if s.start + W == start then
        s.previous = s.current
      else
        s.previous = 0
      end
      s.current = 0
      s.start = start
    end
    s.elapsed = math.max(now - s.start, 0)
    s.lag = math.max(s.start - now, 0)
    return s
  end

  local function estimate(s, now, W)
    return s.previous * (W - s.elapsed) + s.current * W
  end

  function sliding_window_counter.fits(s, now, L, W, B, cost)
    return estimate(s, now, W) + cost * W <= L * W
  end

  function sliding_window_counter.wait(s, now, L, W, B, cost)
    local left = s.lag + W - s.elapsed
    if s.previous > 0 and s.current + cost <= L then
      local room = math.floor((L - cost - s.current) * W / s.previous)
      if room >= 1 then return left - room end
    end
    if s.current == 0 then return left end
    local room = math.min(math.floor((L - cost) * W / s.current), W)
    return left + (W - room)
  end

  function sliding_window_counter.commit(s, now, L, W, B, cost)
    s.current = s.current + cost
  end

  function sliding_window_counter.save(s, now, L, W, B)
    redis.call('HSET', s.key, 's', s.start, 'c', s.current, 'p', s.previous)
    expire(s.key, s.start + 2 * W - now)
  end

  function sliding_window_counter.remaining(s, now, L, W, B)
    return math.floor(math.max(L * W - estimate(s, now, W), 0) / W)
  end

  function sliding_window_counter.reset_after(s, now, L, W, B)
    local left = s.lag + W - s.elapsed
    if s.current > 0 then return left + W end
    if s.previous > 0 then return left end
    return 0
  end

  if adjusting then -- adjustments after a response (see main.lua)
    -- Into the window the units were charged to: current, or previous once it rolled.
    function sliding_window_counter.refund(s, now, L, W, B, units, at)
      local charged = at - at % W
      if s.start == charged then
        s.current = s.current - math.min(units, s.current)
      elseif s.start == charged + W then
        s.previous = s.previous - math.min(units, s.previous)
      end
    end

    -- Over the limit too, but a window never counts more than L.
    function sliding_window_counter.top_up(s, now, L, W, B, units)
      s.current = math.max(s.current, math.min(s.current + units, L))
    end
  end
  return sliding_window_counter
end
