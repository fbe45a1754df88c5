-- Token bucket: hash {t = tokens, l = last refill ms}. Tokens are counted in units of
-- 1/W token: the bucket holds B * W units and refills L units per ms, exactly. A missing
-- key is a full bucket; a top-up may leave it negative (a debt of at most B * W units).
-- Mirrors src/algorithm/token_bucket.rs.
-- Defined on first use, so a call pays only for the algorithms it runs.
local function define_token_bucket()
  local token_bucket = {}

  function token_bucket.load(key, now, L, W, B)
    local v = redis.call('HMGET', key, 't', 'l')
    local capacity = B * W
    local s = { tokens = tonumber(v[1]), last = tonumber(v[2]) or now, key = key, changed = false }
    if s.tokens == nil then
      s.tokens = capacity
      s.last = now
      return s
    end
    -- More than the bucket holds: its burst shrank while the state carried over.
    if s.tokens > capacity then s.tokens = capacity end
    if now > s.last then
      local elapsed = now - s.last
      if elapsed >= ceil_div(capacity - s.tokens, L) then
        s.tokens = capacity
      else
        s.tokens = s.tokens + elapsed * L
      end
      s.last = now
    end
    return s
  end

  local function paused(s, now)
    return math.max(s.last - now, 0)
  end

  function token_bucket.fits(s, now, L, W, B, cost)
    return cost * W <= s.tokens
  end

  function token_bucket.wait(s, now, L, W, B, cost)
    return paused(s, now) + ceil_div(cost * W - s.tokens, L)
  end

  function token_bucket.commit(s, now, L, W, B, cost)
    s.tokens = s.tokens - cost * W
  end

  function token_bucket.save(s, now, L, W, B)
    redis.call('HSET', s.key, 't', s.tokens, 'l', s.last)
    expire(s.key, s.last + ceil_div(B * W - s.tokens, L) - now)
  end

  function token_bucket.remaining(s, now, L, W, B)
    return math.floor(math.max(s.tokens, 0) / W)
  end

  function token_bucket.reset_after(s, now, L, W, B)
    local missing = B * W - s.tokens
    if missing == 0 then return 0 end
    return paused(s, now) + ceil_div(missing, L)
  end

  if reservations then -- reservations for max_wait (see main.lua)
    function token_bucket.can_reserve(s, now)
      return s.last <= now
    end

    -- Into debt: the bucket `wait` ms from now (at most full), less cost and that refill.
    function token_bucket.reserve(s, now, L, W, B, cost, wait)
      s.tokens = math.min(s.tokens + wait * L, B * W) - cost * W - wait * L
    end
  end

  if adjusting then -- adjustments after a response (see main.lua)
    -- Back into the bucket, at most its capacity (a debt and a full bucket are two
    -- capacities apart: no refund gives back more).
    function token_bucket.refund(s, now, L, W, B, units, at)
      s.tokens = math.min(s.tokens + math.min(units, 2 * B) * W, B * W)
    end

    -- Out of the bucket even below zero (a debt), down to minus its capacity.
    function token_bucket.top_up(s, now, L, W, B, units)
      s.tokens = math.min(math.max(s.tokens - math.min(units, 2 * B) * W, -B * W), s.tokens)
    end
  end
  return token_bucket
end
