-- Fixed window: hash {s = window start, c = count}. Windows are aligned to multiples of
-- W since the epoch. Mirrors src/algorithm/fixed_window.rs.
-- Defined on first use, so a call pays only for the algorithms it runs.
local function define_fixed_window()
  local fixed_window = {}

  function fixed_window.load(key, now, L, W, B)
    local v = redis.call('HMGET', key, 's', 'c')
    local s = { start = tonumber(v[1]) or 0, count = tonumber(v[2]) or 0 }
    local start = now - now % W
    if s.start ~= start then
      s.start = start
      s.count = 0
    end
    return s
  end

  function fixed_window.fits(s, now, L, W, B, cost)
    return s.count + cost <= L
  end

  function fixed_window.wait(s, now, L, W, B, cost)
    return s.start + W - now
  end

  function fixed_window.commit(s, key, now, L, W, B, cost)
    s.count = s.count + cost
    redis.call('HSET', key, 's', int(s.start), 'c', int(s.count))
    expire(key, s.start + W - now)
  end

  function fixed_window.remaining(s, now, L, W, B)
    return math.max(L - s.count, 0)
  end

  function fixed_window.reset_after(s, now, L, W, B)
    if s.count == 0 then return 0 end
    return s.start + W - now
  end
  return fixed_window
end
