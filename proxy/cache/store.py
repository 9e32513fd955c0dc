"""Where entries live: Redis when the budget store is Redis (replicas share hits; each entry a
string under `<prefix>:cache:<key>`, SET with EX = its TTL), else an in-process LRU bounded in
bytes. Both only get and put bytes; the cache bounds each call's time and treats a failure as
a miss (`proxy.cache.cache`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from proxy.storage.urls import cluster_url

_MAX_CONNECTIONS = 32


class CacheStore(Protocol):
    # True: calls never wait on I/O (no timeout needed around them).
    in_process: bool

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes, ttl_s: float) -> None: ...

    async def close(self) -> None: ...


class MemoryCacheStore:
    """An LRU of entries, at most `max_bytes` of them (keys and values), each dropped at its
    TTL too. Reads and writes are dict operations on the loop: no await, no lock needed."""

    in_process = True

    def __init__(self, max_bytes: Callable[[], int], clock: Callable[[], float]) -> None:
        self._max_bytes = max_bytes  # read at each put: a reload may change it
        self._clock = clock
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self.size = 0

    async def get(self, key: str) -> bytes | None:
        found = self._entries.get(key)
        if found is None:
            return None
        value, expires = found
        if self._clock() >= expires:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return value

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        bound = self._max_bytes()
        cost = len(key) + len(value)
        if cost > bound:
            return
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (value, self._clock() + ttl_s)
        self.size += cost
        while self.size > bound:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        value, _ = self._entries.pop(key)
        self.size -= len(key) + len(value)

    def __len__(self) -> int:
        return len(self._entries)

    async def close(self) -> None:
        self._entries.clear()
        self.size = 0


class RedisCacheStore:
    """The budget store's Redis (its URL; a cluster too), on a pool of the cache's own whose
    socket timeout is the lookup bound, so a paused server costs a request that much."""

    in_process = False

    def __init__(self, url: str, prefix: str, timeout_s: float) -> None:
        self._prefix = f"{prefix}:cache:"
        cluster = cluster_url(url)
        self._redis: aioredis.Redis | RedisCluster
        if cluster is None:
            pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=_MAX_CONNECTIONS, timeout=timeout_s,
                socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
            self._redis = aioredis.Redis(connection_pool=pool)
        else:
            self._redis = RedisCluster.from_url(
                cluster, max_connections=_MAX_CONNECTIONS, socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
            )

    async def get(self, key: str) -> bytes | None:
        value = await self._redis.get(self._prefix + key)
        return value if isinstance(value, bytes) else None

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        await self._redis.set(self._prefix + key, value, px=max(1, int(ttl_s * 1000)))

    async def close(self) -> None:
        await self._redis.aclose()


def make_cache_store(url: str, prefix: str, lookup_timeout_s: float,
                     memory_bytes: Callable[[], int], clock: Callable[[], float]) -> CacheStore:
    """Redis when the budget store (`store.url`) is Redis, so replicas share entries; the
    in-process LRU otherwise. Chosen at start, like the budget store."""
    if url == "memory":
        return MemoryCacheStore(memory_bytes, clock)
    return RedisCacheStore(url, prefix, lookup_timeout_s)
