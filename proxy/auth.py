"""Who is making a request."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from proxy.state import Runtime

DEFAULT_USER = "default"


@dataclass(frozen=True, slots=True)
class Principal:
    user: str


def authenticate(request: web.Request, runtime: Runtime) -> Principal:
    # No users configured: the proxy is open and meters everything as one user (it says so
    # loudly at start and in the tokenmeter_open_mode gauge).
    return Principal(DEFAULT_USER)
