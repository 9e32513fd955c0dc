-- KEYS: inflight, reserved, then the counters
-- ARGV: now (see now_ms), id, step, minimum, then per counter: limit (-1: none), amount per
-- output token, ttl_s
-- Returns {1, granted} | {0, refused counter (1-based)} | {-1, 0}: no live reservation.
local id = ARGV[2]
local deadline = redis.call('ZSCORE', KEYS[1], id)
local rec = redis.call('HGET', KEYS[2], id)
if (not deadline) or tonumber(deadline) <= now_ms() or (not rec) then return {-1, 0} end
local used = counters(2)
local limits, bases, rates = {}, {}, {}
for i = 1, #used do
  rates[i] = tonumber(ARGV[i * 3 + 3])
  bases[i] = 0
  -- A window that output does not count in has no say in a top-up.
  limits[i] = -1
  if rates[i] > 0 then limits[i] = tonumber(ARGV[i * 3 + 2]) end
end
local granted, binding = grant(tonumber(ARGV[3]), limits, used, bases, rates)
if granted < tonumber(ARGV[4]) then return {0, math.max(binding, 1)} end
local r = cjson.decode(rec)
for i = 1, #used do
  if rates[i] > 0 then
    local key = KEYS[2 + i]
    local more = rates[i] * granted
    add(key, more, ARGV[i * 3 + 4])
    for j = 1, #r, 2 do
      if r[j] == key then r[j + 1] = r[j + 1] + more end
    end
  end
end
redis.call('HSET', KEYS[2], id, cjson.encode(r))
return {1, granted}
