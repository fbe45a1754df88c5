-- GCRA: hash {t = TAT ms, f = fraction of a ms in units of 1/L}. Distances are scaled by
-- L, so the tolerance of B emission intervals (W / L ms each) is B * W units. Mirrors
-- src/algorithm/gcra.rs.
-- Defined on first use, so a call pays only for the algorithms it runs.
local function define_gcra()
  local gcra = {}

  local function ahead(s, now, L, W, B)
    if s.tat < now then return 0 end
    local tolerance = B * W
    local ahead_ms = s.tat - now
    if ahead_ms > ceil_div(tolerance, L) then return tolerance end
    return math.min(ahead_ms * L + s.frac, tolerance)
  end

  function gcra.load(key, now, L, W, B)
    local v = redis.call('HMGET', key, 't', 'f')
    return { tat = tonumber(v[1]) or 0, frac = tonumber(v[2]) or 0, key = key, changed = false }
  end

  function gcra.fits(s, now, L, W, B, cost)
    return ahead(s, now, L, W, B) + cost * W <= B * W
  end

  -- ceil(((tat - now) * L + frac - room) / L), split so that it stays exact beyond the
  -- tolerance (after a step back). The request does not fit: the TAT is ahead of now.
  function gcra.wait(s, now, L, W, B, cost)
    local room = B * W - cost * W
    if s.frac > room then return s.tat - now + 1 end
    return s.tat - now - math.floor((room - s.frac) / L)
  end

  function gcra.commit(s, now, L, W, B, cost)
    -- Nothing to add, and now + ahead would move the TAT back after a step back.
    if cost == 0 then return end
    local a = ahead(s, now, L, W, B) + cost * W
    s.tat = now + math.floor(a / L)
    s.frac = a % L
  end

  function gcra.save(s, now, L, W, B)
    redis.call('HSET', s.key, 't', s.tat, 'f', s.frac)
    local expires = s.tat
    if s.frac > 0 then expires = expires + 1 end
    expire(s.key, expires - now)
  end

  function gcra.remaining(s, now, L, W, B)
    return math.floor((B * W - ahead(s, now, L, W, B)) / W)
  end

  function gcra.reset_after(s, now, L, W, B)
    if s.tat < now then return 0 end
    if s.frac > 0 then return s.tat - now + 1 end
    return s.tat - now
  end

  if reservations then -- reservations for max_wait (see main.lua)
    function gcra.can_reserve(s, now)
      return true
    end

    -- From the TAT, or from now + wait when it lies before that: the request arriving then.
    function gcra.reserve(s, now, L, W, B, cost, wait)
      local a = 0
      if s.tat >= now then a = (s.tat - now) * L + s.frac end
      a = math.max(a, wait * L) + cost * W
      s.tat = now + math.floor(a / L)
      s.frac = a % L
    end
  end

  if adjusting then -- adjustments after a response (see main.lua)
    -- The TAT moves back by `units` intervals, never before now.
    function gcra.refund(s, now, L, W, B, units, at)
      if s.tat < now then return end
      local a = math.max((s.tat - now) * L + s.frac - math.min(units, 2 * B) * W, 0)
      s.tat = now + math.floor(a / L)
      s.frac = a % L
    end

    -- The TAT moves on even beyond the tolerance, up to twice it ahead of now; never back.
    function gcra.top_up(s, now, L, W, B, units)
      local tolerance = B * W
      local a = 0
      if s.tat >= now then a = (s.tat - now) * L + s.frac end
      local spent = math.min(units, 2 * B) * W
      if a >= 2 * tolerance or spent == 0 then return end
      a = math.min(a + spent, 2 * tolerance)
      s.tat = now + math.floor(a / L)
      s.frac = a % L
    end
  end
  return gcra
end
