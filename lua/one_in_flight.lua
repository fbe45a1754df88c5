-- The library's fourth function (Redis 7+, src/store/redis/wire/function.rs): a coalesced
-- batch of the in-flight stage's commonest calls, decided as main.lua decides them but
-- without its groups, sections and general loop. Each entry is one of:
--   a decision: one fixed window (no lockout) and an in-flight permit, cost 1 to the
--     limit; ARGV: cost, limit L, window ms W, most permits M, permit TTL ms T, permit
--     id; KEYS: the window's key, the permits' key;
--   a release with an adjustment: the permit goes back, and -cost units of the window are
--     refunded (`at` >= 0: the `now` they were charged at) or charged late (`at` = -1);
--     ARGV: -units (units >= 1), at, L, W, M, permit id; KEYS: as a decision's;
--   a bare release: the permit goes back; ARGV: 0, M, permit id; KEYS: the permits' key.
-- ARGV[1]: now in ms, or "" to read Redis TIME. Only in the library: EVALSHA sends such a
-- call to main.lua in its own form (groups [1 L W L 0 6 M T 2^32 0], a release's with
-- T = 1, a bare release's [6 M 1 2^32 0] as a refund of 1 unit at 0, then the permits
-- section), which decides it alike.
-- The state is main.lua's, through the same algorithms (fixed_window.lua, in_flight.lua):
-- each key loaded once per call, committed in Lua, saved at the end; a window no other
-- entry of the call touches is counted in place instead (fw_count: one INCRBY), as
-- main.lua's one-limit path does. The permits' commit and save are in_flight.lua's
-- (without the commit's copy of the list, kept there for a peek), the save with variadic
-- commands (one ZREM, one ZADD per key and call) and without the ZRANGE when the key held
-- no live permit before the call (its last end is then the call's own).
-- Returns what main.lua returns for these requests: per entry four values per limit
-- (allowed, remaining, reset_after, retry_after; the window's first), then `now`.
local function decide_in_flight(keys, args)
  local now = clock(args[1])
  -- (Read per call: a library's load sees no `unpack`; Lua 5.4 has table.unpack only.)
  local unpack = unpack or table.unpack
  local fw, perm = algorithm(1), algorithm(6)
  local CAP = 4294967296 -- an in-flight limit's capacity (src/store/redis/encode.rs)
  local states, changed, windows = {}, {}, {}
  -- What a batch repeats, done once per call: an argument's number (each `+ 0` is a
  -- strtod), and an integer's text for a command (a Lua number is printed by Redis with
  -- "%.17g" before 7.2: see prelude.lua).
  local nums, texts = {}, {}
  local function num(arg)
    local v = nums[arg]
    if v == nil then
      v = arg + 0
      nums[arg] = v
    end
    return v
  end
  local function text(x)
    local t = texts[x]
    if t == nil then
      t = int(x)
      texts[x] = t
    end
    return t
  end
  local out, n, k, a = {}, 0, 1, 2
  -- The permits' state of `key`, with `base`: the live permits Redis held before the call.
  local function permits(key)
    local p = states[key]
    if not p then
      p = perm.load(key, now, 0, 0, CAP)
      states[key] = p
    end
    return p
  end
  local function live(p)
    if p.held == nil then
      p.held = redis.call('ZCOUNT', p.key, text(now + 1), '+inf')
      if p.base == nil then p.base = p.held end
    end
  end
  local function window(key, L, W)
    local s = states[key]
    if not s then
      s = fw.load(key, now, L, W, L)
      states[key] = s
    end
    return s
  end
  local function change(s, W)
    if not s.changed then
      s.changed = W
      changed[#changed + 1] = s
    end
  end
  -- in_flight.lua's commit without its copy of the list (kept there for a peek, which
  -- never comes here): a batch of one hot key adds in linear time.
  local function take(p, T)
    local add = p.add
    add[#add + 1] = { perm.id, now + T }
    p.held = p.held + 1
    change(p, T)
  end
  local count = #args
  while a <= count do
    local cost = num(args[a])
    if cost > 0 then
      local L, W, M, T = num(args[a + 1]), num(args[a + 2]), num(args[a + 3]), num(args[a + 4])
      perm.id = args[a + 5]
      a = a + 6
      local key = keys[k]
      local p = permits(keys[k + 1])
      live(p)
      local room = perm.fits(p, now, M, T, CAP, cost)
      if room and states[key] == nil and keys[k + 2] ~= key then
        -- A window no earlier entry touched and the next does not: counted in place.
        local w = windows[W]
        if w == nil then
          w = fw_window(now, W)
          windows[W] = w
        end
        states[key] = false
        local allowed
        allowed, out[n + 2], out[n + 3], out[n + 4] =
          fw_count(key, now, L, W, cost, w, redis.call)
        out[n + 1] = allowed
        if allowed == 1 then take(p, T) end
      else
        local s = window(key, L, W)
        local fit = fw.fits(s, now, L, W, L, cost)
        if fit and room then
          fw.commit(s, now, L, W, L, cost)
          change(s, W)
          take(p, T)
        end
        out[n + 1] = fit and 1 or 0
        out[n + 2] = fw.remaining(s, now, L, W, L)
        out[n + 3] = fw.reset_after(s, now, L, W, L)
        out[n + 4] = fit and 0 or fw.wait(s, now, L, W, L, cost)
      end
      out[n + 5] = room and 1 or 0
      out[n + 6] = perm.remaining(p, now, M, T, CAP)
      out[n + 7] = 0
      out[n + 8] = room and 0 or T
      n = n + 8
      k = k + 2
    else
      if fw.refund == nil then
        -- The first adjustment the library has seen: the window's, defined now.
        adjusting = true
        local full = define_fixed_window()
        fw.refund, fw.top_up = full.refund, full.top_up
      end
      local pkey, M = keys[k], nil
      if cost < 0 then
        local at, L, W = args[a + 1] + 0, num(args[a + 2]), num(args[a + 3])
        M = num(args[a + 4])
        perm.id = args[a + 5]
        a = a + 6
        local s = window(keys[k], L, W)
        if at >= 0 then
          fw.refund(s, now, L, W, L, -cost, at)
        else
          fw.top_up(s, now, L, W, L, -cost)
        end
        change(s, W)
        out[n + 1], out[n + 2], out[n + 3], out[n + 4] =
          1, fw.remaining(s, now, L, W, L), fw.reset_after(s, now, L, W, L), 0
        n = n + 4
        pkey = keys[k + 1]
        k = k + 2
      else
        M = num(args[a + 1])
        perm.id = args[a + 2]
        a = a + 3
        k = k + 1
      end
      local p = permits(pkey)
      perm.refund(p, now, M, 1, CAP, 1, 0)
      change(p, 1)
      out[n + 1], out[n + 2], out[n + 3], out[n + 4] =
        1, perm.remaining(p, now, M, 1, CAP), 0, 0
      n = n + 4
    end
  end
  for i = 1, #changed do
    local s = changed[i]
    if s.add == nil then
      fw.save(s, now, 0, s.changed, 0)
    else
      local key = s.key
      if #s.remove > 0 then
        redis.call('ZREM', key, unpack(s.remove))
        redis.call('ZREMRANGEBYSCORE', key, '-inf', text(now))
      end
      if #s.add > 0 then
        local adds, last = {}, 0
        for j = 1, #s.add do
          local end_at = s.add[j][2]
          adds[2 * j - 1], adds[2 * j] = text(end_at), s.add[j][1]
          if end_at > last then last = end_at end
        end
        redis.call('ZADD', key, unpack(adds))
        if s.base ~= 0 then
          last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2] + 0
        end
        redis.call('PEXPIRE', key, text(math.max(last - now, 1) + ttl_margin)) -- expire()
      end
    end
  end
  if n == 0 then return {} end
  out[n + 1] = now
  return out
end
