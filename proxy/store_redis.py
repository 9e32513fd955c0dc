"""The Redis store: each operation is one Lua script call, atomic across all replicas.

Layout per user (all keys share the `{user}` hash tag, so Redis Cluster keeps them in one slot):
  prefix:{alice}:inflight        ZSET  reservation id -> lease deadline (ms)
  prefix:{alice}:reserved        HASH  reservation id -> JSON [key, amount, key, amount, ...]
  prefix:{alice}:done:<id>       STRING settle marker, so a retried settle is applied once
  prefix:{alice}:<scope>:<window>:<stamp>   counters, each with its own TTL
The reap step touches counters named in reservation records rather than in KEYS; they carry the
same hash tag, so they are in the slot the script runs on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from proxy.store import Entry, ReserveResult, StoreError

_REAP = """
-- Leases are compared against Redis's clock, not each replica's, so replicas with skewed clocks
-- cannot reap each other's live reservations.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function reap(inflight, reserved, now)
  local expired = redis.call('ZRANGEBYSCORE', inflight, '-inf', now)
  for _, id in ipairs(expired) do
    local rec = redis.call('HGET', reserved, id)
    if rec then
      local r = cjson.decode(rec)
      for i = 1, #r, 2 do
        if redis.call('EXISTS', r[i]) == 1 then redis.call('DECRBY', r[i], r[i + 1]) end
      end
      redis.call('HDEL', reserved, id)
    end
    redis.call('ZREM', inflight, id)
  end
end
"""

# KEYS: inflight, reserved, counters...   ARGV: (unused), lease_ms, id, max_concurrent (-1: none),
# then per counter: limit (-1: none), amount, ttl_s
RESERVE = _REAP + """
local now = now_ms()
reap(KEYS[1], KEYS[2], now)
local n = #KEYS - 2
local used = {}
for i = 1, n do used[i] = tonumber(redis.call('GET', KEYS[i + 2]) or '0') end
local inflight = redis.call('ZCARD', KEYS[1])
local maxc = tonumber(ARGV[4])
if maxc >= 0 and inflight >= maxc then return {0, -1, inflight, used} end
for i = 1, n do
  local limit = tonumber(ARGV[3 + i * 3 - 1])
  local amount = tonumber(ARGV[3 + i * 3])
  if limit >= 0 and used[i] + amount > limit then return {0, i - 1, inflight, used} end
end
local rec = {}
for i = 1, n do
  local key = KEYS[i + 2]
  local amount = tonumber(ARGV[3 + i * 3])
  used[i] = redis.call('INCRBY', key, amount)
  if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ARGV[3 + i * 3 + 1]) end
  rec[#rec + 1] = key
  rec[#rec + 1] = amount
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], cjson.encode(rec))
redis.call('EXPIRE', KEYS[1], 172800)
redis.call('EXPIRE', KEYS[2], 172800)
return {1, 0, inflight + 1, used}
"""

# KEYS: inflight, reserved, done marker, counters...   ARGV: id, then per counter: amount, ttl_s
SETTLE = """
local out = {}
local n = #KEYS - 3
if redis.call('SET', KEYS[3], '1', 'NX', 'EX', 600) == false then
  for i = 1, n do out[i] = tonumber(redis.call('GET', KEYS[i + 3]) or '0') end
  return out
end
local reserved = {}
local rec = redis.call('HGET', KEYS[2], ARGV[1])
if rec then
  local r = cjson.decode(rec)
  for i = 1, #r, 2 do reserved[r[i]] = r[i + 1] end
end
for i = 1, n do
  local key = KEYS[i + 3]
  local delta = tonumber(ARGV[i * 2]) - (reserved[key] or 0)
  out[i] = redis.call('INCRBY', key, delta)
  if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ARGV[i * 2 + 1]) end
end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
return out
"""

# KEYS: inflight   ARGV: lease_ms, ids...
RENEW = _REAP + """
local deadline = now_ms() + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', deadline, ARGV[i]) end
return 0
"""


class RedisStore:
    def __init__(self, url: str, timeout_ms: float) -> None:
        timeout = timeout_ms / 1000
        # No retries inside redis-py: a budget check that is slow is worse than one that fails
        # fast into the configured policy; reconnection happens on the next call by itself.
        # A bounded pool that makes callers wait for a connection (up to the timeout) instead
        # of failing when a burst of requests outnumbers it.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=64, timeout=timeout, socket_timeout=timeout,
            socket_connect_timeout=timeout, health_check_interval=10,
            retry=Retry(NoBackoff(), 0),
        )
        self._redis: aioredis.Redis = aioredis.Redis(connection_pool=pool)
        self._reserve = self._redis.register_script(RESERVE)
        self._settle = self._redis.register_script(SETTLE)
        self._renew = self._redis.register_script(RENEW)

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    async def reserve(
        self, slot: str, res_id: str, entries: Sequence[Entry], max_concurrent: int | None,
        lease_s: float,
    ) -> ReserveResult:
        args: list[int | str] = [0, int(lease_s * 1000), res_id,
                                 -1 if max_concurrent is None else max_concurrent]
        for e in entries:
            args += [-1 if e.limit is None else e.limit, e.amount, e.ttl_s]
        keys = [f"{slot}:inflight", f"{slot}:reserved", *(e.key for e in entries)]
        ok, refused, in_flight, used = await self._call(self._reserve(keys=keys, args=args))
        return ReserveResult(
            ok=bool(ok), refused=None if ok else int(refused),
            used=tuple(int(u) for u in used), in_flight=int(in_flight),
        )

    async def settle(self, slot: str, res_id: str, entries: Sequence[Entry]) -> tuple[int, ...]:
        keys = [f"{slot}:inflight", f"{slot}:reserved", f"{slot}:done:{res_id}",
                *(e.key for e in entries)]
        args: list[int | str] = [res_id]
        for e in entries:
            args += [e.amount, e.ttl_s]
        out = await self._call(self._settle(keys=keys, args=args))
        return tuple(int(v) for v in out)

    async def renew(self, slot: str, res_ids: Sequence[str], lease_s: float) -> None:
        if res_ids:
            args: list[int | str] = [int(lease_s * 1000), *res_ids]
            await self._call(self._renew(keys=[f"{slot}:inflight"], args=args))

    async def read(self, keys: Sequence[str]) -> tuple[int, ...]:
        if not keys:
            return ()
        values = await self._call(self._redis.mget(list(keys)))
        return tuple(int(v) if v is not None else 0 for v in values)

    async def mark_once(self, key: str, ttl_s: int) -> bool:
        return bool(await self._call(self._redis.set(key, "1", nx=True, ex=ttl_s)))

    async def ping(self) -> None:
        await self._call(self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()
