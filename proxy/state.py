"""Typed keys for what the app holds: one place to see the process's long-lived state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from proxy.config import Config
from proxy.metrics import Metrics
from proxy.upstream import Router


@dataclass(frozen=True, slots=True)
class Runtime:
    """What a request reads from the current configuration. Replaced whole on reload, so a
    request sees one consistent version from start to end."""

    config: Config
    router: Router
    open_mode: bool


class RuntimeHolder:
    __slots__ = ("current",)

    def __init__(self, runtime: Runtime) -> None:
        self.current = runtime


RUNTIME_HOLDER = web.AppKey("runtime_holder", RuntimeHolder)
METRICS = web.AppKey("metrics", Metrics)
SESSION = web.AppKey("session", aiohttp.ClientSession)


class Settling:
    """Settle tasks still running: kept referenced, and awaited at shutdown."""

    __slots__ = ("tasks",)

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()


SETTLING = web.AppKey("settling", Settling)
