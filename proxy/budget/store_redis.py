"""The Redis store: each operation is one Lua script call (proxy/budget/lua), atomic across all
replicas. `MemoryStore` keeps the same structures under the same names, with the same TTLs.

Layout per slot (all keys share its hash tag, so Redis Cluster keeps them in one hash slot; the
slot is the user's, `{alice}`, or for a team's users the team's, `{t:platform}`):
  prefix:{alice}:inflight        ZSET  reservation id -> lease deadline (ms)
  prefix:{alice}:reserved        HASH  reservation id -> JSON [key, amount, key, amount, ...]
  prefix:{alice}:inflight:k.<key>  ZSET  the same, for a key with its own concurrency limit
  prefix:{alice}:sets            HASH  reservation id -> the other in-flight sets holding it
  prefix:{alice}:reaped          ZSET  reservation id -> when it was reaped (ms): a tombstone, so
                                 its late settle adds its usage outright, once, if it is
                                 younger than `REAPED_TTL_S` (9 days; the ZSET goes that long
                                 after its last reap)
  prefix:{alice}:done:<id>       STRING marker of an addition without a reservation (a batch
                                 owed while the store was down), so it is applied once
  prefix:{alice}:<scope>:<window>:<stamp>   counters, each with its own TTL
In a team's slot the first set holds the whole team's reservations, the users' own sets are
`inflight:<user>:u` and `inflight:<user>:k.<key>`, and the counters are
`prefix:{t:platform}:<user>:<scope>:<window>:<stamp>` and `prefix:{t:platform}:t.platform:...`
(see proxy.budget.limits). The in-flight sets and records expire `HELD_TTL_S` after the slot's
last reserve. Leases and tombstones are judged by Redis's clock (`TIME`), one for every replica,
unless the store is given a clock of its own. The reap step touches counters named in
reservation records rather than in KEYS; they carry the same hash tag, so they are in the slot
the script runs on.

A single server: every script call (the reserve and the settle of each request among them) goes
over one pipelined connection per store (`proxy.budget.resp`: written together per turn of the
event loop, parsed by hiredis, one timer for the oldest reply); the few plain commands (the
`usage` report's MGET, `leases`, the estimate's samples) through redis-py's pool.

Redis Cluster: `redis+cluster://host:port` (or `rediss+cluster://`) makes the client a
`RedisCluster`, which sends each script call to the node of its keys' slot (and loads scripts
on every primary). Only `read` (the `usage` report's multi-user MGET) spans slots: it is split
per slot there.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from types import MappingProxyType
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from proxy.budget import resp
from proxy.budget.store import (
    DONE_TTL_S,
    HELD_TTL_S,
    REAPED_TTL_S,
    Hold,
    ReserveRequest,
    ReserveResult,
    Snapshot,
    StoreError,
    TopUpResult,
    WindowAmount,
)
from proxy.storage.urls import cluster_url


def _script(name: str) -> str:
    return (resources.files("proxy.budget") / "lua" / f"{name}.lua").read_text("utf-8")


# The constants the scripts share with this package, defined from the Python ones, then the
# functions they share; concatenated in front of the scripts that keep time or reservations.
_PRELUDE = (f"local REAPED_TTL_MS = {REAPED_TTL_S * 1000}\nlocal HELD_TTL_S = {HELD_TTL_S}\n"
            + _script("prelude"))
# Read once, when the module is imported; `RedisStore` registers them with its client, which
# loads each (SCRIPT LOAD) on a node the first time it runs there.
RESERVE, SETTLE, ADD_ONCE, TOPUP, RENEW, SNAPSHOT = (
    resp.Script(_PRELUDE + _script(name))
    for name in ("reserve", "settle", "add_once", "top_up", "renew", "snapshot"))
RECORD = resp.Script(_script("record"))
# A script, not PING: what requests need is scripts that write, and a store that is paused or
# stalled for writes still answers PING.
PROBE = resp.Script("return 1")
_SCRIPTS = (RESERVE, SETTLE, ADD_ONCE, TOPUP, RENEW, SNAPSHOT, RECORD, PROBE)


_MAX_CONNECTIONS = 64


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _n(value: int | None) -> bytes:
    """A number argument; -1 for none (the scripts' convention)."""
    return b"-1" if value is None else b"%d" % value


@functools.lru_cache(maxsize=4096)
def _slot_keys(slot: str) -> tuple[bytes, bytes, bytes, bytes]:
    """A slot's inflight, reserved, sets and reaped keys, encoded once per slot."""
    return (f"{slot}:inflight".encode(), f"{slot}:reserved".encode(),
            f"{slot}:sets".encode(), f"{slot}:reaped".encode())


class RedisStore:
    in_process = False

    def __init__(self, url: str, timeout_ms: float,
                 clock: Callable[[], float] | None = None) -> None:
        """`clock`: the time leases and tombstones are judged by; None (a proxy's choice) for
        Redis's own, which every replica shares (`MemoryStore` takes one the same way)."""
        self._clock = clock
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
        # Single server: the scripts go over one pipelined connection of our own (see
        # proxy.budget.resp), the rare plain commands through redis-py's pool. Cluster: all
        # through redis-py's cluster client, which routes each call to its slot's node.
        self._conn = resp.Connection(url, timeout) if cluster is None else None
        self._scripts: dict[resp.Script, AsyncScript] = {} if cluster is None else {
            s: self._redis.register_script(s.body) for s in _SCRIPTS}

    def _now(self) -> bytes:
        """The scripts' ARGV[1]: the clock in ms, or -1 for Redis's (see `now_ms` there)."""
        return b"-1" if self._clock is None else b"%d" % int(self._clock() * 1000)

    async def _eval(self, script: resp.Script, keys: list[bytes], args: list[bytes]) -> Any:
        if self._conn is None:
            return await self._call(self._scripts[script](keys=keys, args=args))
        try:
            return await self._conn.evalsha(script, keys, args)
        except resp.RespError as exc:
            raise StoreError(f"{type(exc).__name__}: {exc}") from exc

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

    async def reserve(self, slot: str, res_id: str, request: ReserveRequest,
                      lease_s: float) -> ReserveResult:
        entries, clamp = request.entries, request.clamp
        user, keys_sets = request.in_flight[0], request.in_flight[1:]
        args = [self._now(), b"%d" % len(keys_sets), b"%d" % int(lease_s * 1000),
                res_id.encode(), _n(user.limit)]
        args += [_n(f.limit) for f in keys_sets]
        for e in entries:
            args += [_n(e.limit), b"%d" % e.amount, b"%d" % e.ttl_s]
        if clamp is not None:
            args += [b"%d" % clamp.requested, b"%d" % clamp.minimum]
            for b, r in zip(clamp.bases, clamp.rates, strict=True):
                args += [b"%d" % b, b"%d" % r]
        inflight, reserved, sets, reaped = _slot_keys(slot)
        keys = [inflight, reserved, sets, reaped,
                *(f"{slot}:inflight:{f.part}".encode() for f in keys_sets),
                *(e.key.encode() for e in entries)]
        ok, entry, held, used, granted, binding = await self._eval(RESERVE, keys, args)
        return ReserveResult(
            ok=bool(ok), used=tuple(int(u) for u in used),
            refused_entry=int(entry) - 1 if int(entry) else None,
            refused_in_flight=int(held) - 1 if int(held) else None,
            granted=int(granted) if clamp is not None and bool(ok) else None,
            binding=int(binding) - 1 if int(binding) else None,
        )

    async def settle(self, slot: str, res_id: str,
                     entries: Sequence[WindowAmount]) -> tuple[int, ...]:
        inflight, reserved, sets, reaped = _slot_keys(slot)
        keys = [inflight, reserved, reaped, sets, *(e.key.encode() for e in entries)]
        args = [self._now(), res_id.encode()]
        for e in entries:
            args += [b"%d" % e.amount, b"%d" % e.ttl_s]
        out = await self._eval(SETTLE, keys, args)
        return tuple(int(v) for v in out)

    async def add_once(self, slot: str, batch_id: str, entries: Sequence[WindowAmount],
                       done_ttl_s: int = DONE_TTL_S) -> tuple[int, ...]:
        inflight, reserved, sets, _ = _slot_keys(slot)
        keys = [inflight, reserved, f"{slot}:done:{batch_id}".encode(), sets,
                *(e.key.encode() for e in entries)]
        args = [batch_id.encode(), b"%d" % done_ttl_s]
        for e in entries:
            args += [b"%d" % e.amount, b"%d" % e.ttl_s]
        out = await self._eval(ADD_ONCE, keys, args)
        return tuple(int(v) for v in out)

    async def top_up(self, slot: str, res_id: str, entries: Sequence[WindowAmount], step: int,
                     minimum: int) -> TopUpResult:
        inflight, reserved, _, _ = _slot_keys(slot)
        keys = [inflight, reserved, *(e.key.encode() for e in entries)]
        args = [self._now(), res_id.encode(), b"%d" % step, b"%d" % minimum]
        for e in entries:
            args += [_n(e.limit), b"%d" % e.amount, b"%d" % e.ttl_s]
        ok, value = await self._eval(TOPUP, keys, args)
        if int(ok) == 1:
            return TopUpResult(int(value))
        if int(ok) == 0:
            return TopUpResult(0, refused_entry=int(value) - 1)
        return TopUpResult(0, gone=True)

    async def output_samples(self, key: str) -> tuple[int, ...]:
        held = await self._call(self._redis.hgetall(key))
        return tuple(int(v) for k, v in held.items() if k not in (b"n", "n"))

    async def record_output(self, key: str, tokens: int, keep: int, ttl_s: int) -> None:
        await self._eval(RECORD, [key.encode()], [b"%d" % tokens, b"%d" % keep, b"%d" % ttl_s])

    async def renew(self, slot: str, res_ids: Sequence[str], lease_s: float) -> None:
        if res_ids:
            args = [self._now(), b"%d" % int(lease_s * 1000), *(r.encode() for r in res_ids)]
            await self._eval(RENEW, [_slot_keys(slot)[0]], args)

    async def leases(self, slot: str) -> dict[str, float]:
        held = await self._call(self._redis.zrange(f"{slot}:inflight", 0, -1, withscores=True))
        return {_text(r): float(ms) / 1000 for r, ms in held}

    async def read(self, keys: Sequence[str]) -> tuple[int, ...]:
        if not keys:
            return ()
        if self._cluster is not None:
            # Keys of several users are in several slots: one MGET per slot.
            values = await self._call(self._cluster.mget_nonatomic(list(keys)))
        else:
            values = await self._call(self._redis.mget(list(keys)))
        return tuple(int(v) if v is not None else 0 for v in values)

    async def snapshot(self, slot: str, keys: Sequence[str]) -> Snapshot:
        inflight, reserved_key, _, reaped_key = _slot_keys(slot)
        now_ms, values, leases, records, reaped, size = await self._eval(
            SNAPSHOT, [inflight, reserved_key, reaped_key, *(k.encode() for k in keys)],
            [self._now()])
        reserved = {_text(records[i]): json.loads(_text(records[i + 1]))
                    for i in range(0, len(records), 2)}
        holds = []
        for i in range(0, len(leases), 2):
            res_id = _text(leases[i])
            record = reserved.get(res_id, [])
            amounts = tuple((str(record[j]), int(record[j + 1]))
                            for j in range(0, len(record), 2))
            holds.append(Hold(res_id, float(_text(leases[i + 1])) / 1000, amounts))
        counters = {k: int(_text(v)) for k, v in zip(keys, values, strict=True)}
        return Snapshot(int(now_ms) / 1000, MappingProxyType(counters), tuple(holds),
                        tuple(_text(r) for r in reaped), int(size))

    async def mark_once(self, key: str, ttl_s: int) -> bool:
        return bool(await self._call(self._redis.set(key, "1", nx=True, ex=ttl_s)))

    async def flag(self, key: str, ttl_s: int) -> None:
        await self._call(self._redis.set(key, "1", ex=ttl_s))

    async def flagged(self, key: str) -> bool:
        return bool(await self._call(self._redis.exists(key)))

    async def ping(self) -> None:
        await self._eval(PROBE, [], [])

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        await self._redis.aclose()
