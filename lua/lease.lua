-- Leased quota (RedisStore::with_leases): units granted to a node beside a request it
-- sends, spent by the node later without asking, and given back when it no longer needs
-- them. Every algorithm but the sliding-window log (code 2) is leased, and no limit with a
-- lockout (a lease could not see a block start); a window's lease
-- belongs to the window it was granted in, a bucket's lasts one window. Mirrors
-- src/algorithm/lease.rs.

-- After request `held`'s limits (`group`) allowed it at `now`: grants up to `asked`
-- units, at most half of what each limit has left, the same from each, or none. Appends
-- to `tail`: units granted, ms until the earliest window end (a bucket: one window), each
-- limit's window start (a bucket: 0).
local function lease_grant(group, held, now, asked, tail)
  local units, ms_left = asked, nil
  local m = #group
  for i = 1, m do
    local limit = group[i]
    local s = held[i]
    if limit.code == 2 or limit.D > 0 then
      units = 0 -- the log, and a limit with a lockout, are never leased
    end
    local start = s.start or 0
    local left = math.floor(limit.alg.remaining(s, now, limit.L, limit.W, limit.B) / 2)
    if left < units then units = left end
    local ends = math.max(start + limit.W - now, 0)
    if limit.code >= 4 then ends = limit.W end
    if ms_left == nil or ends < ms_left then ms_left = ends end
  end
  if units > 0 then
    for i = 1, m do
      local limit = group[i]
      limit.alg.commit(held[i], now, limit.L, limit.W, limit.B, units)
    end
  end
  local n = #tail
  tail[n + 1] = units
  tail[n + 2] = ms_left or 0
  for i = 1, m do
    tail[n + 2 + i] = held[i].start or 0
  end
end

-- The result of an ask that cannot take a lease (a peek's, an adjustment's), for a
-- group of `m` limits: nothing granted.
local function lease_none(m, tail)
  local n = #tail
  for i = 1, m + 2 do
    tail[n + i] = 0
  end
end

-- Gives `units` back at `now` to the limits of `group` whose keys start at KEYS[k]: a
-- window only into the window that starts at starts[i] where that window still counts, a
-- bucket as tokens (never beyond it), resp. by moving its TAT back (never before now).
local function lease_return(group, k, units, starts, now)
  for i = 1, #group do
    local limit = group[i]
    local key, start = KEYS[k + i - 1], starts[i]
    if limit.code == 1 then
      local v = redis.call('GET', key)
      if v then
        local s, count = fw_decode(v + 0, now, limit.W)
        if s == start and count > 0 then
          redis.call('INCRBY', key, fw_units(-math.min(units, count)))
        end
      end
    elseif limit.code == 3 then
      local v = redis.call('HMGET', key, 's', 'c', 'p')
      local s = tonumber(v[1])
      if s == start then
        redis.call('HSET', key, 'c', math.max((tonumber(v[2]) or 0) - units, 0))
      elseif s == start + limit.W then
        redis.call('HSET', key, 'p', math.max((tonumber(v[3]) or 0) - units, 0))
      end
    elseif limit.code == 4 then
      local L, W, B = limit.L, limit.W, limit.B
      if redis.call('HMGET', key, 't')[1] then
        local s = limit.alg.load(key, now, L, W, B)
        s.tokens = math.min(s.tokens + units * W, B * W)
        limit.alg.save(s, now, L, W, B)
      end
    elseif limit.code == 5 then
      local L, W, B = limit.L, limit.W, limit.B
      local v = redis.call('HMGET', key, 't', 'f')
      local tat, frac = tonumber(v[1]), tonumber(v[2]) or 0
      -- Not after the clock stepped back (the TAT beyond the tolerance), as in the model.
      if tat and tat >= now and tat - now <= ceil_div(B * W, L) then
        local ahead = math.max(math.min((tat - now) * L + frac, B * W) - units * W, 0)
        local s = { tat = now + math.floor(ahead / L), frac = ahead % L, key = key }
        limit.alg.save(s, now, L, W, B)
      end
    end
  end
end

-- Reads the lease sections at ARGV[a] (after the requests; absent: no leases) and runs
-- the returns at once. Returns the asks (request index -> units wanted) and the index in
-- ARGV after the sections (where the reservations follow, see main.lua).
local function lease_sections(a, groups, now)
  local asks = {}
  if ARGV[a] == nil then return asks, a end
  for _ = 1, ARGV[a] + 0 do
    asks[ARGV[a + 1] + 0] = ARGV[a + 2] + 0
    a = a + 2
  end
  a = a + 1
  if ARGV[a] == nil then return asks, a end
  for _ = 1, ARGV[a] + 0 do
    local group = groups[ARGV[a + 1] + 0]
    local k, units = ARGV[a + 2] + 0, ARGV[a + 3] + 0
    local starts = {}
    for i = 1, #group do
      starts[i] = ARGV[a + 3 + i] + 0
    end
    lease_return(group, k, units, starts, now)
    a = a + 3 + #group
  end
  return asks, a + 1
end
