"""The store a configuration asks for."""

from __future__ import annotations

from collections.abc import Callable

from proxy.budget.store import MemoryStore, Store
from proxy.budget.store_redis import RedisStore
from proxy.config.policy import StoreConfig


def make_store(config: StoreConfig, clock: Callable[[], float]) -> Store:
    """`memory`, or Redis: a single server or a cluster (`redis+cluster://`), which
    `RedisStore` tells apart by the URL's scheme."""
    if config.url == "memory":
        return MemoryStore(clock)
    return RedisStore(config.url, config.timeout_ms)
