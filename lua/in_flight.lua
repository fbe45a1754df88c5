-- In-flight permits of an InFlightLimit (src/limit.rs), as a limit of a group beside
-- the rate limits, so that one call decides both all-or-nothing. The permits of a key
-- are a sorted set `<prefix>:{<key>}:inflight` of permit ids scored by the time (ms)
-- their TTL ends (the layout of src/store/redis/permits.rs; a permit counts while its
-- end is after now). As a limit: code 6, L = the most permits, W = the permit TTL ms,
-- B = 2^32 (a request takes one permit, whatever its cost), no lockout. The permit id
-- of the request being decided is the algorithm's `id`, set by main.lua from the
-- permits section. A commit adds the id, ending W ms from now; an adjustment (refund or
-- top-up: the request's release, beside its rate limits' adjustment) removes it. Never
-- leased; a reservation of the rate limits beside it takes the permit now. Mirrors
-- src/algorithm/in_flight.rs.
local function define_in_flight()
  local f = {}

  -- How many permits are held at `now`, read once per call and only when a request
  -- asks (a release needs no count).
  local function held(s, now)
    if s.held == nil then
      s.held = redis.call('ZCOUNT', s.key, now + 1, '+inf')
    end
    return s.held
  end

  function f.load(key, now, L, W, B)
    return { add = {}, remove = {}, key = key, changed = false }
  end

  function f.fits(s, now, L, W, B, cost)
    return held(s, now) < L
  end

  -- Every permit held ends within one TTL: an upper bound (the caller answers its own).
  function f.wait(s, now, L, W, B, cost)
    return W
  end

  -- Each id is added with its own end: the state is saved with the parameters of the
  -- limit that changed it first, which may be another group's (a release's) in a batch.
  -- A copy of the list, so that a peek's copy of the state keeps the old one.
  function f.commit(s, now, L, W, B, cost)
    local add = {}
    for i = 1, #s.add do add[i] = s.add[i] end
    add[#add + 1] = { f.id, now + W }
    s.add = add
    s.held = held(s, now) + 1
  end

  -- A release removes its id and the permits whose TTL ended (which keeps the set as
  -- small as what is in flight; the key's TTL stays that of its last end). A take adds
  -- its id and makes the key live until its last permit ends.
  function f.save(s, now, L, W, B)
    local key = s.key
    if #s.remove > 0 then
      for i = 1, #s.remove do
        redis.call('ZREM', key, s.remove[i])
      end
      redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    end
    if #s.add > 0 then
      for i = 1, #s.add do
        redis.call('ZADD', key, s.add[i][2], s.add[i][1])
      end
      local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
      expire(key, math.max(last[2] - now, 1))
    end
  end

  function f.remaining(s, now, L, W, B)
    if s.held == nil then return 0 end
    return math.max(L - s.held, 0)
  end

  function f.reset_after(s, now, L, W, B)
    return 0
  end

  -- The release: the permit goes, whatever the units.
  function f.refund(s, now, L, W, B, units, at)
    s.remove[#s.remove + 1] = f.id
    if s.held ~= nil then s.held = math.max(s.held - 1, 0) end
  end
  f.top_up = function(s, now, L, W, B, units) f.refund(s, now, L, W, B, units, 0) end

  -- Never reserved itself (main.lua's reservation() asks only that it has room); a
  -- reservation of the group's rate limits takes the permit now, as a commit.
  function f.can_reserve(s, now)
    return false
  end

  function f.reserve(s, now, L, W, B, cost, wait)
    f.commit(s, now, L, W, B, cost)
  end

  return f
end
