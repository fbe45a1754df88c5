-- Fixed window: a string "<window start>:<count>", read with one GET and written with
-- one SET (a hash would take HMGET, HSET and PEXPIRE). Windows are aligned to multiples
-- of W since the epoch. The key expires when its window ends: the write that opens a
-- window sets that TTL (SET PX), later writes in the window keep it (SET KEEPTTL, about
-- half the cost inside Redis). A request from before the stored window (a clock that
-- stepped back) counts into the stored window. Mirrors src/algorithm/fixed_window.rs.
-- Defined on first use, so a call pays only for the algorithms it runs.
local function define_fixed_window()
  local fixed_window = {}

  function fixed_window.load(key, now, L, W, B)
    -- ttl_set: the key holds this window already, so it has this window's TTL.
    local s = { start = now - now % W, count = 0, key = key, changed = false, ttl_set = false }
    local v = redis.call('GET', key)
    if v then
      local start, count = string.match(v, '^(%d+):(%d+)$')
      start = start + 0
      -- An earlier window is over; a later one is the latest this key has seen, where a
      -- clock that stepped back keeps counting (never that window's budget again).
      if start >= s.start then
        s.start = start
        s.count = count + 0
        s.ttl_set = true
      end
    end
    return s
  end

  function fixed_window.fits(s, now, L, W, B, cost)
    return s.count + cost <= L
  end

  function fixed_window.wait(s, now, L, W, B, cost)
    return s.start + W - now
  end

  function fixed_window.commit(s, now, L, W, B, cost)
    s.count = s.count + cost
  end

  function fixed_window.save(s, now, L, W, B)
    local value = string.format('%d:%d', s.start, s.count)
    if s.ttl_set then
      redis.call('SET', s.key, value, 'KEEPTTL')
    else
      set_expiring(s.key, value, s.start + W - now)
    end
  end

  function fixed_window.remaining(s, now, L, W, B)
    return math.max(L - s.count, 0)
  end

  function fixed_window.reset_after(s, now, L, W, B)
    if s.count == 0 then return 0 end
    return s.start + W - now
  end

  if adjusting then -- adjustments after a response (see main.lua)
    -- Only into the window the units were charged to (at: that decision's now).
    function fixed_window.refund(s, now, L, W, B, units, at)
      if s.start == at - at % W then s.count = s.count - math.min(units, s.count) end
    end

    -- Over the limit too, but a window never counts more than L: the debt ends with it.
    function fixed_window.top_up(s, now, L, W, B, units)
      s.count = math.max(s.count, math.min(s.count + units, L))
    end
  end
  return fixed_window
end
