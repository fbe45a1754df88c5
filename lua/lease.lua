-- Leased quota (RedisStore::with_leases): units granted to a node beside a request it
-- sends, spent by the node later without asking, and given back when it no longer needs
-- them. Only fixed window (code 1) and sliding-window counter (code 3) are leased; a
-- lease belongs to the window it was granted in. Mirrors src/algorithm/lease.rs.

-- After request `held`'s limits (`group`) allowed it at `now`: grants up to `asked`
-- units, at most half of what each limit has left, the same from each, or none. Appends
-- to `tail`: units granted, ms until the earliest window end, each limit's window start.
local function lease_grant(group, held, now, asked, tail)
  local units, ms_left = asked, nil
  local m = #group
  for i = 1, m do
    local limit = group[i]
    local s = held[i]
    if limit.code ~= 1 and limit.code ~= 3 then
      units = 0
    end
    local start = s.start or 0
    local left = math.floor(limit.alg.remaining(s, now, limit.L, limit.W, limit.B) / 2)
    if left < units then units = left end
    local ends = math.max(start + limit.W - now, 0)
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

-- Gives `units` back to the limits of `group` whose keys start at KEYS[k], each only
-- into the window that starts at starts[i] where that window still counts.
local function lease_return(group, k, units, starts)
  for i = 1, #group do
    local limit = group[i]
    local key, start = KEYS[k + i - 1], starts[i]
    if limit.code == 1 then
      local v = redis.call('GET', key)
      if v then
        local s, count = string.match(v, '^(%d+):(%d+)$')
        if s and s + 0 == start then
          count = math.max(count - units, 0)
          redis.call('SET', key, string.format('%d:%d', start, count), 'KEEPTTL')
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
    end
  end
end

-- Reads the lease sections at ARGV[a] (after the requests; absent: no leases) and runs
-- the returns at once. Returns the asks: request index -> units wanted.
local function lease_sections(a, groups)
  local asks = {}
  if ARGV[a] == nil then return asks end
  for _ = 1, ARGV[a] + 0 do
    asks[ARGV[a + 1] + 0] = ARGV[a + 2] + 0
    a = a + 2
  end
  a = a + 1
  if ARGV[a] == nil then return asks end
  for _ = 1, ARGV[a] + 0 do
    local group = groups[ARGV[a + 1] + 0]
    local k, units = ARGV[a + 2] + 0, ARGV[a + 3] + 0
    local starts = {}
    for i = 1, #group do
      starts[i] = ARGV[a + 3 + i] + 0
    end
    lease_return(group, k, units, starts)
    a = a + 3 + #group
  end
  return asks
end
