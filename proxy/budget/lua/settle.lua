-- KEYS: inflight, reserved, reaped, sets, then the counters
-- ARGV: now (see now_ms), id, then per counter: amount, ttl_s
-- Returns the counters.
local id = ARGV[2]
local reserved = {}
local rec = redis.call('HGET', KEYS[2], id)
if rec then
  local r = cjson.decode(rec)
  for i = 1, #r, 2 do reserved[r[i]] = r[i + 1] end
else
  -- Not held: reaped (a tombstone younger than REAPED_TTL_MS), or settled already (a retry
  -- whose first reply was lost), which changes nothing.
  local at = redis.call('ZSCORE', KEYS[3], id)
  if at then redis.call('ZREM', KEYS[3], id) end
  if (not at) or tonumber(at) <= now_ms() - REAPED_TTL_MS then return counters(4) end
end
local out = {}
for i = 1, #KEYS - 4 do
  local key = KEYS[i + 4]
  out[i] = add(key, tonumber(ARGV[i * 2 + 1]) - (reserved[key] or 0), ARGV[i * 2 + 2])
end
if rec then
  redis.call('HDEL', KEYS[2], id)
  unhold(KEYS[4], id)
  redis.call('ZREM', KEYS[1], id)
end
return out
