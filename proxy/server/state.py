"""Typed keys for what the app holds: one place to see the process's long-lived state."""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from proxy.auth import UserIndex
from proxy.budget.accounting import Budget
from proxy.budget.cost import price_for
from proxy.config.load import Config
from proxy.config.policy import Price
from proxy.ledger.ledger import Ledger
from proxy.pipeline.watchdog import Watchdog
from proxy.routing.attempts import LatencyTracker
from proxy.routing.upstream import Router
from proxy.server.reload import ConfigWatcher
from proxy.telemetry.accesslog import AuthFailureLog
from proxy.telemetry.metrics import Metrics


@dataclass(frozen=True, slots=True)
class Runtime:
    """What a request reads from the current configuration. Replaced whole on reload, so a
    request sees one consistent version from start to end."""

    config: Config
    router: Router
    users: UserIndex
    price_version: str  # of this configuration's price table, recorded in each ledger row

    @property
    def open_mode(self) -> bool:
        return self.users.mode == "open"

    def price_for(self, model: str) -> Price | None:
        return price_for(self.config.prices, model)


def release_runtime(runtime: Runtime) -> None:
    """Free a replaced version nothing else holds one entry at a time (in a worker thread):
    its key index and users, 30,000 and 10,000 entries, would otherwise be freed in one
    cascade that holds the GIL for hundreds of milliseconds. A part that a request still holds
    on its own (it kept `runtime.config`, say) is left whole, to be freed when it lets go."""
    # References to each part: the runtime's field and the argument of getrefcount.
    if sys.getrefcount(runtime.users) <= 2:
        runtime.users.release()
    if sys.getrefcount(runtime.config) <= 2 and sys.getrefcount(runtime.config.users) <= 2:
        # The model is frozen, its dict is not; no one can see this version any more.
        users = runtime.config.users
        while users:
            users.popitem()


class RuntimeHolder:
    __slots__ = ("current",)

    def __init__(self, runtime: Runtime) -> None:
        self.current = runtime


class Settling:
    """Settle tasks still running: kept referenced, and awaited at shutdown."""

    __slots__ = ("_changed", "completed", "tasks")

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.completed = 0
        self._changed: asyncio.Event | None = None

    def finished(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self.completed += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_for(self, count: int) -> None:
        """Until `count` requests have settled since start (tests and shutdown use this)."""
        while self.completed < count:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()


WATCHER = web.AppKey("watcher", ConfigWatcher[Runtime])


class HttpClient:
    """The process's one pooled aiohttp session, opened when the app starts."""

    __slots__ = ("_session",)

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the HTTP client is used before the app started")
        return self._session

    def started(self, session: aiohttp.ClientSession | None) -> None:
        self._session = session

    @property
    def running(self) -> bool:
        return self._session is not None


@dataclass(frozen=True, slots=True)
class Services:
    """The long-lived parts a request uses, made once per app and passed explicitly."""

    runtime: RuntimeHolder
    metrics: Metrics
    budget: Budget
    http: HttpClient
    latency: LatencyTracker
    rng: random.Random  # retry jitter; tests may seed it
    settling: Settling
    watchdog: Watchdog
    ledger: Ledger | None  # None: ledger.enabled is false
    auth_failures: AuthFailureLog = field(default_factory=AuthFailureLog)


SERVICES = web.AppKey("services", Services)
