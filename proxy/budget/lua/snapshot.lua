-- KEYS: inflight, reserved, reaped, then the counters   ARGV: now (see now_ms)   Read-only.
-- Returns {now, counters, the in-flight set WITHSCORES, the reservation records (HGETALL), the
-- tombstones younger than REAPED_TTL_MS, the keys the node holds (DBSIZE)}.
local now = now_ms()
local values = {}
for i = 4, #KEYS do values[i - 3] = redis.call('GET', KEYS[i]) or '0' end
return {now, values, redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'),
        redis.call('HGETALL', KEYS[2]),
        redis.call('ZRANGEBYSCORE', KEYS[3], string.format('(%.0f', now - REAPED_TTL_MS), '+inf'),
        redis.call('DBSIZE')}
