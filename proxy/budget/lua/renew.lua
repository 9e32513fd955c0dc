-- KEYS: inflight   ARGV: now (see now_ms), lease_ms, ids...   (a key's in-flight set follows
-- the user's: reaping and settling go by the user's set, so only its deadlines matter)
local deadline = now_ms() + tonumber(ARGV[2])
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], 'XX', deadline, ARGV[i]) end
return 0
