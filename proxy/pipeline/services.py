"""What a request runs on: the long-lived parts the server makes once per app and the pipeline
reads, and the keys under which the server hands them (and word of a request) to the pipeline.

They live here, below the server, because they are the pipeline's inputs: the server builds
and fills them (proxy/server/app.py), the pipeline only reads them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from multidict import CIMultiDictProxy

from proxy.auth import UserIndex
from proxy.budget.accounting import Budget
from proxy.cache.cache import ResponseCache
from proxy.capture.writer import CaptureWriter
from proxy.config.callers import CallerIndex
from proxy.config.load import Config
from proxy.config.policy import Price
from proxy.config.tags import TagRules
from proxy.cost import price_for
from proxy.ledger.ledger import Ledger
from proxy.pipeline.watchdog import Watchdog
from proxy.routing.attempts import LatencyTracker
from proxy.routing.upstream import Router
from proxy.telemetry.accesslog import AuthFailureLog
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.tracing import Tracing


@dataclass(frozen=True, slots=True)
class Runtime:
    """What a request reads from the current configuration. Replaced whole on reload, so a
    request sees one consistent version from start to end."""

    config: Config
    router: Router
    users: UserIndex
    price_version: str  # of this configuration's price table, recorded in each ledger row
    tags: TagRules  # the `tags:` rules, applied to each request's tags
    callers: CallerIndex  # what capture and the tags read of a caller (never-capture, tags)

    @property
    def open_mode(self) -> bool:
        return self.users.mode == "open"

    def price_for(self, model: str) -> Price | None:
        return price_for(self.config.prices, model)


class RuntimeHolder:
    __slots__ = ("current",)

    def __init__(self, runtime: Runtime) -> None:
        self.current = runtime


class Settling:
    """Settle tasks still running: referenced here so none is collected mid-way, and awaited
    at shutdown (proxy.server.app's _drain_settling)."""

    __slots__ = ("tasks",)

    def __init__(self) -> None:
        # A settle task's result is the request's record (its cost told in the answer).
        self.tasks: set[asyncio.Task[object]] = set()

    def finished(self, task: asyncio.Task[object]) -> None:
        self.tasks.discard(task)


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
class Opening:
    """What a wing's factory knows of a request as it opens: before its key or body is read."""

    request_id: str
    operation: str
    api: str  # the API shape's upstream API ("openai", "anthropic")
    path: str  # the client's path, "/v1/chat/completions"
    headers: CIMultiDictProxy[str]
    runtime: Runtime


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
    capture: CaptureWriter | None = None  # None: capture is off (capture.enabled is false)
    tracing: Tracing | None = None  # None: tracing is off (the default)
    cache: ResponseCache | None = None  # the response cache (its config decides if it is used)
    # The optional wings' factories of a request's observers (`context.ObserverFactory`; a
    # factory's answer that is not an observer is none).
    observers: tuple[Callable[[Opening], object], ...] = ()


SERVICES = web.AppKey("services", Services)

# Set by the listener (proxy.server.listener) on a request whose body did not arrive in time,
# before its handler is cancelled: the handler sees only the cancellation, as for a client that
# went away, and reads this to tell the two apart.
BODY_TIMED_OUT = web.RequestKey("tokenmeter_body_timed_out", bool)
