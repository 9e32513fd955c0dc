"""The Redis store: each operation is one Lua script call, atomic across all replicas.

Layout per slot (all keys share its hash tag, so Redis Cluster keeps them in one hash slot; the
slot is the user's, `{alice}`, or for a team's users the team's, `{t:platform}`):
  prefix:{alice}:inflight        ZSET  reservation id -> lease deadline (ms)
  prefix:{alice}:reserved        HASH  reservation id -> JSON [key, amount, key, amount, ...]
  prefix:{alice}:inflight:k.<key>  ZSET  the same, for a key with its own concurrency limit
  prefix:{alice}:sets            HASH  reservation id -> the other in-flight sets holding it
  prefix:{alice}:reaped          ZSET  reservation id -> when it was reaped (ms): a tombstone, so
                                 its late settle adds its usage outright, once (kept 9 days)
  prefix:{alice}:done:<id>       STRING marker of an addition without a reservation (a batch
                                 owed while the store was down), so it is applied once
  prefix:{alice}:<scope>:<window>:<stamp>   counters, each with its own TTL
In a team's slot the first set holds the whole team's reservations, the users' own sets are
`inflight:<user>:u` and `inflight:<user>:k.<key>`, and the counters are
`prefix:{t:platform}:<user>:<scope>:<window>:<stamp>` and `prefix:{t:platform}:t.platform:...`
(see proxy.budget.limits). The reap step touches counters named in reservation records rather
than in KEYS; they carry the same hash tag, so they are in the slot the script runs on.

Redis Cluster: `redis+cluster://host:port` (or `rediss+cluster://`) makes the client a
`RedisCluster`, which sends each script call to the node of its keys' slot (and loads scripts
on every primary). Only `read` (the `usage` report's multi-user MGET) spans slots: it is split
per slot there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from proxy.budget.clamp import Clamp
from proxy.budget.store import (
    DONE_TTL_S,
    REAPED_TTL_S,
    Entry,
    InFlightLimit,
    ReserveResult,
    StoreError,
    TopUpResult,
)

_REAP = f"""
local REAPED_TTL_MS = {REAPED_TTL_S * 1000}
-- Leases are compared against Redis's clock, not each replica's, so replicas with skewed clocks
-- cannot reap each other's live reservations.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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
-- a restart) still counts the usage, once.
local function reap(inflight, reserved, sets, reaped, now)
  local expired = redis.call('ZRANGEBYSCORE', inflight, '-inf', now)
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', reaped, '-inf', now - REAPED_TTL_MS)
    redis.call('PEXPIRE', reaped, REAPED_TTL_MS)
  end
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
end
"""

# KEYS: inflight, reserved, sets, reaped, then m other in-flight sets (the user's own in a
# team's slot, a key's), then the counters
# ARGV: m, lease_ms, id, the user's max in flight (-1: none), m limits of the keys' sets,
# then per counter: limit (-1: none), amount, ttl_s
# then, to clamp (see proxy.budget.clamp, whose `grant` this mirrors): the output asked for, the
# minimum, and per counter: base, rate
# Returns {ok, refused counter (1-based, 0: none), refused in-flight set (1-based), used,
# output tokens granted (-1: no clamp asked)}.
RESERVE = _REAP + """
local now = now_ms()
reap(KEYS[1], KEYS[2], KEYS[3], KEYS[4], now)
local m = tonumber(ARGV[1])
local id = ARGV[3]
local first = 4 + m
local n = #KEYS - first
local used = {}
for i = 1, n do used[i] = tonumber(redis.call('GET', KEYS[first + i]) or '0') end
local maxc = tonumber(ARGV[4])
if maxc >= 0 and redis.call('ZCARD', KEYS[1]) >= maxc then return {0, 0, 1, used, -1} end
for j = 1, m do
  if redis.call('ZCARD', KEYS[4 + j]) >= tonumber(ARGV[4 + j]) then
    return {0, 0, j + 1, used, -1}
  end
end
local base = 4 + m
local amounts = {}
for i = 1, n do amounts[i] = tonumber(ARGV[base + i * 3 - 1]) end
local granted = -1
local c = base + n * 3
if #ARGV > c then
  -- Clamp: the least room for output tokens over the windows, then reserve that many.
  local requested = tonumber(ARGV[c + 1])
  local binding = 0
  granted = requested
  for i = 1, n do
    local limit = tonumber(ARGV[base + i * 3 - 2])
    if limit >= 0 then
      local b = tonumber(ARGV[c + i * 2 + 1])
      local rate = tonumber(ARGV[c + i * 2 + 2])
      local room = limit - used[i] - b
      local fits = nil
      if room < 0 then
        fits = -1
      elseif rate > 0 then
        -- floor division of integers held in doubles, corrected for rounding
        fits = math.floor(room / rate)
        while fits * rate > room do fits = fits - 1 end
        while (fits + 1) * rate <= room do fits = fits + 1 end
      end
      if fits ~= nil and fits < granted then granted = fits; binding = i end
    end
  end
  if granted < tonumber(ARGV[c + 2]) then
    if binding == 0 then binding = 1 end
    return {0, binding, 0, used, granted}
  end
  if granted < requested then
    for i = 1, n do
      amounts[i] = tonumber(ARGV[c + i * 2 + 1]) + tonumber(ARGV[c + i * 2 + 2]) * granted
    end
  end
end
for i = 1, n do
  local limit = tonumber(ARGV[base + i * 3 - 2])
  if limit >= 0 and used[i] + amounts[i] > limit then return {0, i, 0, used, granted} end
end
local rec = {}
for i = 1, n do
  local key = KEYS[first + i]
  -- '%.0f': a Lua number is written as an integer, never in exponent form
  local amount = string.format('%.0f', amounts[i])
  used[i] = redis.call('INCRBY', key, amount)
  if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ARGV[base + i * 3]) end
  rec[#rec + 1] = key
  rec[#rec + 1] = amounts[i]
end
local deadline = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], deadline, id)
redis.call('HSET', KEYS[2], id, cjson.encode(rec))
if m > 0 then
  local names = {}
  for j = 1, m do
    redis.call('ZADD', KEYS[4 + j], deadline, id)
    redis.call('EXPIRE', KEYS[4 + j], 172800)
    names[j] = KEYS[4 + j]
  end
  redis.call('HSET', KEYS[3], id, table.concat(names, ' '))
  redis.call('EXPIRE', KEYS[3], 172800)
end
redis.call('EXPIRE', KEYS[1], 172800)
redis.call('EXPIRE', KEYS[2], 172800)
return {1, 0, 0, used, granted}
"""

# KEYS: inflight, reserved, reaped, sets, counters...
# ARGV: id, then per counter: amount, ttl_s
SETTLE = _REAP + """
local out = {}
local n = #KEYS - 4
local reserved = {}
local rec = redis.call('HGET', KEYS[2], ARGV[1])
if rec then
  local r = cjson.decode(rec)
  for i = 1, #r, 2 do reserved[r[i]] = r[i + 1] end
elseif redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then
  -- Neither held nor reaped: settled already (a retry whose first reply was lost).
  for i = 1, n do out[i] = tonumber(redis.call('GET', KEYS[i + 4]) or '0') end
  return out
end
for i = 1, n do
  local key = KEYS[i + 4]
  local delta = tonumber(ARGV[i * 2]) - (reserved[key] or 0)
  out[i] = redis.call('INCRBY', key, delta)
  if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ARGV[i * 2 + 1]) end
end
if rec then
  redis.call('HDEL', KEYS[2], ARGV[1])
  unhold(KEYS[4], ARGV[1])
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return out
"""

# KEYS: inflight, reserved, done marker, sets, counters...
# ARGV: id, done marker ttl_s, then per counter: amount, ttl_s
ADD_ONCE = _REAP + """
local out = {}
local n = #KEYS - 4
if redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[2]) == false then
  for i = 1, n do out[i] = tonumber(redis.call('GET', KEYS[i + 4]) or '0') end
  return out
end
local reserved = {}
local rec = redis.call('HGET', KEYS[2], ARGV[1])
if rec then
  local r = cjson.decode(rec)
  for i = 1, #r, 2 do reserved[r[i]] = r[i + 1] end
end
for i = 1, n do
  local key = KEYS[i + 4]
  local delta = tonumber(ARGV[i * 2 + 1]) - (reserved[key] or 0)
  out[i] = redis.call('INCRBY', key, delta)
  if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ARGV[i * 2 + 2]) end
end
redis.call('HDEL', KEYS[2], ARGV[1])
unhold(KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
return out
"""

# KEYS: inflight, reserved, counters...
# ARGV: id, step, minimum, then per counter: limit (-1: none), amount per output token, ttl_s
# Returns {1, granted} | {0, refused counter (1-based)} | {-1, 0}: no live reservation.
TOPUP = _REAP + """
local now = now_ms()
local deadline = redis.call('ZSCORE', KEYS[1], ARGV[1])
local rec = redis.call('HGET', KEYS[2], ARGV[1])
if (not deadline) or tonumber(deadline) <= now or (not rec) then return {-1, 0} end
local n = #KEYS - 2
local granted = tonumber(ARGV[2])
local binding = 0
for i = 1, n do
  local limit = tonumber(ARGV[i * 3 + 1])
  local rate = tonumber(ARGV[i * 3 + 2])
  if limit >= 0 and rate > 0 then
    local room = limit - tonumber(redis.call('GET', KEYS[2 + i]) or '0')
    local fits = -1
    if room >= 0 then
      fits = math.floor(room / rate)
      while fits * rate > room do fits = fits - 1 end
      while (fits + 1) * rate <= room do fits = fits + 1 end
    end
    if fits < granted then granted = fits; binding = i end
  end
end
if granted < tonumber(ARGV[3]) then
  if binding == 0 then binding = 1 end
  return {0, binding}
end
local r = cjson.decode(rec)
for i = 1, n do
  local rate = tonumber(ARGV[i * 3 + 2])
  if rate > 0 then
    local key = KEYS[2 + i]
    local add = rate * granted
    redis.call('INCRBY', key, string.format('%.0f', add))
    if redis.call('TTL', key) < 0 then redis.call('EXPIRE', key, ARGV[i * 3 + 3]) end
    for j = 1, #r, 2 do
      if r[j] == key then r[j + 1] = r[j + 1] + add end
    end
  end
end
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(r))
return {1, granted}
"""

# KEYS: samples   ARGV: output tokens, ring size, ttl_s   (the `estimate` policy's history:
# field `n` counts the writes, fields 0..size-1 hold the last `size` lengths)
RECORD = """
local i = redis.call('HINCRBY', KEYS[1], 'n', 1) - 1
redis.call('HSET', KEYS[1], tostring(i % tonumber(ARGV[2])), ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 0
"""

# KEYS: inflight   ARGV: lease_ms, ids...   (a key's in-flight set follows the user's: reaping
# and settling go by the user's set, so only its deadlines matter)
RENEW = """
local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', deadline, ARGV[i]) end
return 0
"""


_MAX_CONNECTIONS = 64
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def cluster_url(url: str) -> str | None:
    """The plain URL redis-py's cluster client takes, if `url` names a Redis Cluster."""
    scheme, sep, rest = url.partition("://")
    plain = _CLUSTER_SCHEMES.get(scheme)
    return f"{plain}{sep}{rest}" if plain is not None and sep else None


class RedisStore:
    in_process = False

    def __init__(self, url: str, timeout_ms: float) -> None:
        timeout = timeout_ms / 1000
        self._timeout = timeout
        # No retries inside redis-py: a budget check that is slow is worse than one that fails
        # fast into the configured policy; reconnection happens on the next call by itself.
        cluster = cluster_url(url)
        self._cluster: RedisCluster | None = None
        self._single: aioredis.Redis | None = None
        self._gate: asyncio.Semaphore | None = None
        self._redis: aioredis.Redis | RedisCluster
        if cluster is None:
            # A bounded pool that makes callers wait for a connection (up to the timeout)
            # instead of failing when a burst of requests outnumbers it.
            pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=_MAX_CONNECTIONS, timeout=timeout, socket_timeout=timeout,
                socket_connect_timeout=timeout, health_check_interval=10,
                retry=Retry(NoBackoff(), 0),
            )
            self._single = aioredis.Redis(connection_pool=pool)
            self._redis = self._single
        else:
            # The cluster client's per-node pools fail at once when full rather than wait:
            # the gate makes callers wait (up to the timeout) as the blocking pool does, and
            # bounds the connections to any one node by the same number. After a connection
            # error the client itself drops the node's connections and re-reads the slots.
            self._cluster = RedisCluster.from_url(
                cluster, max_connections=_MAX_CONNECTIONS, socket_timeout=timeout,
                socket_connect_timeout=timeout, health_check_interval=10,
                retry=Retry(NoBackoff(), 0),
            )
            self._redis = self._cluster
            self._gate = asyncio.Semaphore(_MAX_CONNECTIONS)
        self._reserve = self._redis.register_script(RESERVE)
        self._settle = self._redis.register_script(SETTLE)
        self._add_once = self._redis.register_script(ADD_ONCE)
        self._renew = self._redis.register_script(RENEW)
        self._top_up = self._redis.register_script(TOPUP)
        self._record = self._redis.register_script(RECORD)
        self._probe = self._redis.register_script("return 1")

    async def _call(self, coro: Awaitable[Any]) -> Any:
        try:
            if self._gate is None:
                return await coro
            try:
                async with asyncio.timeout(self._timeout):
                    await self._gate.acquire()
            except TimeoutError:
                if asyncio.iscoroutine(coro):
                    coro.close()  # never awaited: say so to no one
                raise
            try:
                return await coro
            finally:
                self._gate.release()
        except (RedisError, RedisClusterException, OSError, TimeoutError) as exc:
            if self._single is not None and isinstance(exc, RedisConnectionError | OSError):
                # The server went away: every pooled connection is stale, not just this one.
                # Drop them all now, or each would fail once more after the server is back.
                with contextlib.suppress(RedisError, OSError):
                    await self._single.connection_pool.disconnect()
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

    async def reserve(
        self, slot: str, res_id: str, entries: Sequence[Entry],
        in_flight: Sequence[InFlightLimit], lease_s: float, clamp: Clamp | None = None,
    ) -> ReserveResult:
        user, keys_sets = in_flight[0], in_flight[1:]
        args: list[int | str] = [len(keys_sets), int(lease_s * 1000), res_id,
                                 -1 if user.limit is None else user.limit]
        args += [-1 if f.limit is None else f.limit for f in keys_sets]
        for e in entries:
            args += [-1 if e.limit is None else e.limit, e.amount, e.ttl_s]
        if clamp is not None:
            args += [clamp.requested, clamp.minimum]
            for b, r in zip(clamp.bases, clamp.rates, strict=True):
                args += [b, r]
        keys = [f"{slot}:inflight", f"{slot}:reserved", f"{slot}:sets", f"{slot}:reaped",
                *(f"{slot}:inflight:{f.part}" for f in keys_sets), *(e.key for e in entries)]
        ok, entry, held, used, granted = await self._call(self._reserve(keys=keys, args=args))
        return ReserveResult(
            ok=bool(ok), used=tuple(int(u) for u in used),
            refused_entry=int(entry) - 1 if int(entry) else None,
            refused_in_flight=int(held) - 1 if int(held) else None,
            granted=int(granted) if clamp is not None and bool(ok) else None,
        )

    async def settle(self, slot: str, res_id: str, entries: Sequence[Entry]) -> tuple[int, ...]:
        keys = [f"{slot}:inflight", f"{slot}:reserved", f"{slot}:reaped", f"{slot}:sets",
                *(e.key for e in entries)]
        args: list[int | str] = [res_id]
        for e in entries:
            args += [e.amount, e.ttl_s]
        out = await self._call(self._settle(keys=keys, args=args))
        return tuple(int(v) for v in out)

    async def add_once(self, slot: str, batch_id: str, entries: Sequence[Entry],
                       done_ttl_s: int = DONE_TTL_S) -> tuple[int, ...]:
        keys = [f"{slot}:inflight", f"{slot}:reserved", f"{slot}:done:{batch_id}",
                f"{slot}:sets", *(e.key for e in entries)]
        args: list[int | str] = [batch_id, done_ttl_s]
        for e in entries:
            args += [e.amount, e.ttl_s]
        out = await self._call(self._add_once(keys=keys, args=args))
        return tuple(int(v) for v in out)

    async def top_up(self, slot: str, res_id: str, entries: Sequence[Entry], step: int,
                     minimum: int) -> TopUpResult:
        keys = [f"{slot}:inflight", f"{slot}:reserved", *(e.key for e in entries)]
        args: list[int | str] = [res_id, step, minimum]
        for e in entries:
            args += [-1 if e.limit is None else e.limit, e.amount, e.ttl_s]
        ok, value = await self._call(self._top_up(keys=keys, args=args))
        if int(ok) == 1:
            return TopUpResult(int(value))
        if int(ok) == 0:
            return TopUpResult(0, refused_entry=int(value) - 1)
        return TopUpResult(0, gone=True)

    async def output_samples(self, key: str) -> tuple[int, ...]:
        held = await self._call(self._redis.hgetall(key))
        return tuple(int(v) for k, v in held.items() if k not in (b"n", "n"))

    async def record_output(self, key: str, tokens: int, keep: int, ttl_s: int) -> None:
        await self._call(self._record(keys=[key], args=[tokens, keep, ttl_s]))

    async def renew(self, slot: str, res_ids: Sequence[str], lease_s: float) -> None:
        if res_ids:
            args: list[int | str] = [int(lease_s * 1000), *res_ids]
            await self._call(self._renew(keys=[f"{slot}:inflight"], args=args))

    async def leases(self, slot: str) -> dict[str, float]:
        held = await self._call(self._redis.zrange(f"{slot}:inflight", 0, -1, withscores=True))
        return {(r.decode() if isinstance(r, bytes) else str(r)): float(ms) / 1000
                for r, ms in held}

    async def read(self, keys: Sequence[str]) -> tuple[int, ...]:
        if not keys:
            return ()
        if self._cluster is not None:
            # Keys of several users are in several slots: one MGET per slot.
            values = await self._call(self._cluster.mget_nonatomic(list(keys)))
        else:
            values = await self._call(self._redis.mget(list(keys)))
        return tuple(int(v) if v is not None else 0 for v in values)

    async def mark_once(self, key: str, ttl_s: int) -> bool:
        return bool(await self._call(self._redis.set(key, "1", nx=True, ex=ttl_s)))

    async def ping(self) -> None:
        # A script, not PING: what requests need is scripts that write, and a store that is
        # paused or stalled for writes still answers PING.
        await self._call(self._probe(keys=[], args=[]))

    async def close(self) -> None:
        await self._redis.aclose()
