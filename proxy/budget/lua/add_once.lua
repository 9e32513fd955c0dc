-- KEYS: inflight, reserved, done marker, sets, then the counters
-- ARGV: id, the done marker's ttl_s, then per counter: amount, ttl_s
-- Returns the counters.
if redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[2]) == false then return counters(4) end
local reserved = {}
local rec = redis.call('HGET', KEYS[2], ARGV[1])
if rec then
  local r = cjson.decode(rec)
  for i = 1, #r, 2 do reserved[r[i]] = r[i + 1] end
end
local out = {}
for i = 1, #KEYS - 4 do
  local key = KEYS[i + 4]
  out[i] = add(key, tonumber(ARGV[i * 2 + 1]) - (reserved[key] or 0), ARGV[i * 2 + 2])
end
redis.call('HDEL', KEYS[2], ARGV[1])
unhold(KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
return out
