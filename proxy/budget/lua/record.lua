-- KEYS: samples   ARGV: output tokens, ring size, ttl_s   (the `estimate` policy's history:
-- field `n` counts the writes, fields 0..size-1 hold the last `size` lengths)
local i = redis.call('HINCRBY', KEYS[1], 'n', 1) - 1
redis.call('HSET', KEYS[1], tostring(i % tonumber(ARGV[2])), ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 0
