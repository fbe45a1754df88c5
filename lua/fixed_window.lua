-- Fixed window: one integer per key, count * 2^20 + tag, where the tag names the window,
-- (start / W) mod (2^20 - 1) + 1, so that one INCRBY counts a request in place and keeps
-- the key's TTL (main.lua's one-limit path) and a value is never 0 (an INCRBY on a key that
-- does not exist returns a tag of 0: no window). Windows are aligned to multiples of W
-- since the epoch; a tag is read relative to the current window, as one at most 2^19
-- windows before or after it (a key lives W plus the clock margin, so only a clock stepped
-- back that far is misread). The key expires when its window ends: the write that opens a
-- window sets that TTL (SET PX), later writes in the window keep it (INCRBY). A request
-- from before the stored window (a clock that stepped back) counts into the stored window.
-- Counts stay below 2^33 (limits are u32 and a count never exceeds twice one), so a value
-- stays below 2^53: exact in Lua's doubles. Key tag "fw2" (src/limit.rs): the earlier
-- "<start>:<count>" strings lived under "fw". Mirrors src/algorithm/fixed_window.rs.

-- The tag of the window that starts at `start` (a multiple of W). (Every exact quotient
-- here is made whole where Lua has integers: see `floats` in prelude.lua.)
local function fw_tag(start, W)
  local n = start / W
  if floats then n = math.floor(n) end
  return n % 1048575 + 1
end

-- The window `now` falls in, of W ms, as fw_count takes it: its start and tag, and no
-- strings of an opening printed yet.
local function fw_window(now, W)
  local start = now - now % W
  return { start = start, tag = fw_tag(start, W), opened = false }
end

-- `n` units as an INCRBY argument, n * 2^20, as a decimal string. Redis before 7.2 prints
-- every number a script passes to a command with "%.17g", some 2 000 instructions each,
-- while a string goes as it is: so the strings of small counts are kept (in a library,
-- across calls), and a request of cost 1 costs no printing at all.
local fw_units_text = {}
local function fw_units(n)
  local text = fw_units_text[n]
  if text == nil then
    text = string.format('%d', n * 1048576)
    if n >= -64 and n <= 64 then fw_units_text[n] = text end
  end
  return text
end

-- How many windows the window tagged `tag` (not 0) starts after the one tagged `current`:
-- negative for an earlier one, within +-2^19.
local function fw_ahead(tag, current)
  local ahead = (tag - current) % 1048575
  if ahead >= 524288 then return ahead - 1048575 end
  return ahead
end

-- The window start and count a stored value `v` (a number) holds, read at `now`.
local function fw_decode(v, now, W)
  local tag = v % 1048576
  local current = now - now % W
  local count = (v - tag) / 1048576
  if floats then count = math.floor(count) end
  return current + fw_ahead(tag, fw_tag(current, W)) * W, count
end

-- The one-limit path (main.lua, and the library's function for one request, lua/one.lua):
-- counts `cost` (1 to L) units into `key`'s fixed window at `now` in place, deciding
-- exactly as load/fits/commit/save below would, and returns the limit's result: allowed
-- (0/1), remaining, reset_after, retry_after. One INCRBY when the key holds the window; a
-- key with no state gets its tag and TTL (INCRBY, PEXPIRE), a denial its units back.
-- `window` holds the current window's `start` and `tag`, and keeps the strings of a
-- window that opens (`opened`: printed once for all keys of a group in a call).
-- `first`: how the first command is called, redis.call, or redis.pcall where the key may
-- not be this node's (lua/one.lua's decide_fixed_windows): a command that fails has
-- written nothing, and the request's result is then -1, 0, 0, 0 (not decided).
local function fw_count(key, now, L, W, cost, window, first)
  local start = window.start
  local v = first('INCRBY', key, fw_units(cost))
  if type(v) ~= 'number' then return -1, 0, 0, 0 end
  local tag = v % 1048576
  local count = (v - tag) / 1048576
  if floats then count = math.floor(count) end
  if tag == 0 then
    -- No key: the INCRBY made it, without a tag or a TTL.
    local opened = window.opened
    if not opened then
      opened = { int(window.tag), int(start + W - now + ttl_margin) }
      window.opened = opened
    end
    redis.call('INCRBY', key, opened[1])
    redis.call('PEXPIRE', key, opened[2])
    count = cost
  elseif tag ~= window.tag then
    local ahead = fw_ahead(tag, window.tag)
    if ahead < 0 then
      -- An earlier window (its key outlives it by the clock margin): this one opens.
      set_expiring(key, cost * 1048576 + window.tag, start + W - now)
      count = cost
    else
      start = start + ahead * W -- a later window: a clock that stepped back
    end
  end
  local ends = start + W - now -- > 0; a count here is never 0
  if count <= L then return 1, L - count, ends, 0 end
  redis.call('INCRBY', key, fw_units(-cost)) -- denied: counted for nothing
  return 0, L - count + cost, ends, ends
end

-- Defined on first use, so a call pays only for the algorithms it runs.
local function define_fixed_window()
  local fixed_window = {}

  function fixed_window.load(key, now, L, W, B)
    -- ttl_set: the key holds this window already, so it has this window's TTL; `stored`
    -- is the count it holds, so that save adds only the difference.
    local s = {
      start = now - now % W, count = 0, key = key, changed = false, ttl_set = false,
      stored = 0,
    }
    local v = redis.call('GET', key)
    if v then
      local start, count = fw_decode(v + 0, now, W)
      -- An earlier window is over; a later one is the latest this key has seen, where a
      -- clock that stepped back keeps counting (never that window's budget again).
      if start >= s.start then
        s.start = start
        s.count = count
        s.stored = count
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
    if s.ttl_set then
      if s.count ~= s.stored then
        redis.call('INCRBY', s.key, fw_units(s.count - s.stored))
      end
    else
      set_expiring(s.key, s.count * 1048576 + fw_tag(s.start, W), s.start + W - now)
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
