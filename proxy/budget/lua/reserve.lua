-- KEYS: inflight, reserved, sets, reaped, then m other in-flight sets (the user's own in a
-- team's slot, a key's), then the counters
-- ARGV: now (see now_ms), m, lease_ms, id, the first set's limit (-1: none), the m other sets'
-- limits (-1: none), then per counter: limit (-1: none), amount, ttl_s; then, to clamp (see
-- proxy.budget.clamp): the output asked for, the minimum, and per counter: base, rate
-- Returns {ok, refused counter (1-based, 0: none), refused in-flight set (1-based), used,
-- output tokens granted (-1: no clamp asked), the counter that left the least room when fewer
-- were granted than asked (1-based, 0: none)}.
local now = now_ms()
reap(KEYS[1], KEYS[2], KEYS[3], KEYS[4], now)
local m = tonumber(ARGV[2])
local id = ARGV[4]
local first = 4 + m  -- the KEYS before the counters
local a = 5 + m  -- the ARGV before the counters' triples
local used = counters(first)
local n = #used
for j = 0, m do
  local limit = tonumber(ARGV[5 + j])
  local set = KEYS[1]
  if j > 0 then set = KEYS[4 + j] end
  if limit >= 0 and redis.call('ZCARD', set) >= limit then return {0, 0, j + 1, used, -1, 0} end
end
local limits, amounts = {}, {}
for i = 1, n do
  limits[i] = tonumber(ARGV[a + i * 3 - 2])
  amounts[i] = tonumber(ARGV[a + i * 3 - 1])
end
local granted, binding = -1, 0
local c = a + n * 3
if #ARGV > c then
  -- Clamp: the least room for output tokens over the windows, then reserve that many.
  local requested = tonumber(ARGV[c + 1])
  local bases, rates = {}, {}
  for i = 1, n do
    bases[i] = tonumber(ARGV[c + i * 2 + 1])
    rates[i] = tonumber(ARGV[c + i * 2 + 2])
  end
  granted, binding = grant(requested, limits, used, bases, rates)
  if granted < tonumber(ARGV[c + 2]) then return {0, math.max(binding, 1), 0, used, granted, 0} end
  if granted < requested then
    for i = 1, n do amounts[i] = bases[i] + rates[i] * granted end
  end
end
for i = 1, n do
  if limits[i] >= 0 and used[i] + amounts[i] > limits[i] then
    return {0, i, 0, used, granted, 0}
  end
end
local rec = {}
for i = 1, n do
  local key = KEYS[first + i]
  used[i] = add(key, amounts[i], ARGV[a + i * 3])
  rec[#rec + 1] = key
  rec[#rec + 1] = amounts[i]
end
local deadline = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], deadline, id)
redis.call('HSET', KEYS[2], id, cjson.encode(rec))
if m > 0 then
  local names = {}
  for j = 1, m do
    redis.call('ZADD', KEYS[4 + j], deadline, id)
    redis.call('EXPIRE', KEYS[4 + j], HELD_TTL_S)
    names[j] = KEYS[4 + j]
  end
  redis.call('HSET', KEYS[3], id, table.concat(names, ' '))
  redis.call('EXPIRE', KEYS[3], HELD_TTL_S)
end
redis.call('EXPIRE', KEYS[1], HELD_TTL_S)
redis.call('EXPIRE', KEYS[2], HELD_TTL_S)
return {1, 0, 0, used, granted, binding}
