-- Shared by the scripts that call it (proxy.budget.store_redis concatenates it in front of
-- them, after the constants it defines from Python's: REAPED_TTL_MS, HELD_TTL_S).

-- ARGV[1] of every script that keeps time: the caller's clock in ms, or -1 for the server's.
-- A proxy passes -1: leases are then judged by one clock, Redis's, so replicas with skewed
-- clocks cannot reap each other's live reservations.
local function now_ms()
  local given = tonumber(ARGV[1])
  if given >= 0 then return given end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- proxy.budget.clamp.room_for_output: the output tokens one window has room for; nil when
-- unbounded (no limit, or output does not count in it and its base fits), -1 when not even the
-- base fits.
local function room_for_output(limit, used, base, rate)
  if limit < 0 then return nil end
  local room = limit - used - base
  if room < 0 then return -1 end
  if rate == 0 then return nil end
  -- floor division of integers held in doubles, corrected for rounding
  local fits = math.floor(room / rate)
  while fits * rate > room do fits = fits - 1 end
  while (fits + 1) * rate <= room do fits = fits + 1 end
  return fits
end

-- proxy.budget.clamp.grant: the output tokens every window has room for, up to `requested`
-- (limits -1: none), and the window (1-based, 0: none) that allowed the fewest.
local function grant(requested, limits, used, bases, rates)
  local granted, binding = requested, 0
  for i = 1, #limits do
    local fits = room_for_output(limits[i], used[i], bases[i], rates[i])
    if fits ~= nil and fits < granted then granted = fits; binding = i end
  end
  return granted, binding
end

-- A reservation also held in a key's own in-flight set names that set in `sets`.
local function unhold(sets, id)
  local names = redis.call('HGET', sets, id)
  if names then
    for name in string.gmatch(names, '%S+') do redis.call('ZREM', name, id) end
    redis.call('HDEL', sets, id)
  end
end

-- A settled reservation leaves nothing behind: its record going is what makes a second settle
-- a no-op. A reaped one leaves a tombstone, so its settle (late, or replayed from a spool after
-- a restart) still counts the usage, once, within REAPED_TTL_MS.
local function reap(inflight, reserved, sets, reaped, now)
  local expired = redis.call('ZRANGEBYSCORE', inflight, '-inf', now)
  if #expired == 0 then return end
  redis.call('ZREMRANGEBYSCORE', reaped, '-inf', now - REAPED_TTL_MS)
  for _, id in ipairs(expired) do
    redis.call('ZADD', reaped, now, id)
    local rec = redis.call('HGET', reserved, id)
    if rec then
      local r = cjson.decode(rec)
      for i = 1, #r, 2 do
        if redis.call('EXISTS', r[i]) == 1 then redis.call('DECRBY', r[i], r[i + 1]) end
      end
      redis.call('HDEL', reserved, id)
    end
    unhold(sets, id)
    redis.call('ZREM', inflight, id)
  end
  -- After the ZADDs: set before them on a key that did not exist yet, it was lost.
  redis.call('PEXPIRE', reaped, REAPED_TTL_MS)
end

-- The counters in KEYS from `first + 1` on, as numbers.
local function counters(first)
  local out = {}
  for i = first + 1, #KEYS do out[i - first] = tonumber(redis.call('GET', KEYS[i]) or '0') end
  return out
end

-- INCRBY, and the counter's TTL when it has none yet (it was just created). '%.0f': a Lua
-- number is written as an integer, never in exponent form.
local function add(key, amount, ttl_s)
  local value = redis.call('INCRBY', key, string.format('%.0f', amount))
  if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ttl_s) end
  return value
end
