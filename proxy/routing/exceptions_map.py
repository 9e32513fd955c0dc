"""The one place where aiohttp's and asyncio's exceptions about an upstream become the proxy's
errors (as httpx's `map_httpcore_exceptions` does for httpcore's).

What an exception means depends on when it happens, so the caller names the phase:

| phase | TimeoutError | ConnectionTimeoutError | other ClientError |
| --- | --- | --- | --- |
| CONNECT: until the headers | FirstByteTimeout | ConnectTimeout | UpstreamUnreachable |
| TOTAL: under total_timeout_s | TotalTimeout | TotalTimeout | UpstreamUnreachable |
| IDLE: under idle_timeout_s | IdleTimeout | IdleTimeout | UpstreamUnreachable |
| STREAM: bytes were sent | IdleTimeout if `silent()`, else UpstreamReset | same | same |

TOTAL is a JSON answer (or the wait for it) under its total cap; IDLE an error body of a
stream request, which has no total cap.

In STREAM the watchdog closes a silent upstream, so the exception alone cannot tell silence
from a reset: `silent` says whether the watchdog fired. Also in STREAM, ConnectionResetError
and BrokenPipeError (aiohttp's ClientConnectionResetError among them) are the client's: writes
to a client that left raise them, so they pass through for the relay to count as
`client_disconnect`. ProxyErrors raised inside (e.g. by `call_upstream`) and anything else
(CancelledError, bugs) pass through untouched too.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from types import TracebackType

import aiohttp

from proxy.errors import (
    ConnectTimeout,
    FirstByteTimeout,
    IdleTimeout,
    ProxyError,
    TotalTimeout,
    UpstreamReset,
    UpstreamUnreachable,
)
from proxy.routing.upstream import Upstream


class Phase(enum.Enum):
    CONNECT = "connect"
    TOTAL = "total"
    IDLE = "idle"
    STREAM = "stream"


def _never() -> bool:
    return False


def upstream_failure(
    exc: BaseException, upstream: Upstream, phase: Phase, *, silent: Callable[[], bool] = _never
) -> ProxyError | None:
    """The proxy's error for `exc` raised while talking to `upstream` in `phase`, or None when
    it is not an upstream failure (it then propagates as it is). Messages name the setting that
    ran out; they carry no request or response text."""
    name = upstream.name
    if phase is Phase.STREAM:
        if isinstance(exc, ConnectionResetError | BrokenPipeError) or not isinstance(
            exc, TimeoutError | aiohttp.ClientError
        ):
            return None
        if silent():
            return IdleTimeout(
                f"The upstream sent nothing for {upstream.idle_timeout_s:g} s (idle_timeout_s); "
                "this response is incomplete."
            )
        return UpstreamReset(
            "The upstream connection broke mid-stream; this response is incomplete."
        )
    if isinstance(exc, aiohttp.ConnectionTimeoutError) and phase is Phase.CONNECT:
        # A TimeoutError too, so it is matched first. The request was never sent.
        return ConnectTimeout(
            f"Connecting to upstream `{name}` timed out "
            f"({upstream.connect_timeout_s:g} s, connect_timeout_s)."
        )
    if isinstance(exc, TimeoutError):
        if phase is Phase.CONNECT:
            return FirstByteTimeout(
                f"Upstream `{name}` sent no response within "
                f"{upstream.first_byte_timeout_s:g} s (first_byte_timeout_s)."
            )
        if phase is Phase.TOTAL:
            return TotalTimeout(
                f"Upstream `{name}` did not complete the response within "
                f"{upstream.total_timeout_s:g} s (total_timeout_s)."
            )
        return IdleTimeout(f"Upstream `{name}` stopped sending its response.")
    if isinstance(exc, aiohttp.ClientError):
        if phase is Phase.CONNECT:
            return UpstreamUnreachable(
                f"Upstream `{name}` is unreachable ({type(exc).__name__})."
            )
        # Broke while its answer was being read: an unreachable upstream's code, kept for wire
        # compatibility (see errors.py).
        return UpstreamUnreachable(f"The upstream response broke ({type(exc).__name__}).")
    return None


def map_upstream_exceptions(
    upstream: Upstream, phase: Phase, *, silent: Callable[[], bool] = _never
) -> UpstreamErrors:
    """Raise the proxy's error for an aiohttp/asyncio exception about `upstream` (see the
    module's table). Wrap it around the `asyncio.timeout` whose expiry it should name."""
    return UpstreamErrors(upstream, phase, silent)


class UpstreamErrors:
    """`map_upstream_exceptions`' context manager. A class, not a generator under
    `contextlib.contextmanager`: a request enters three, and a generator's costs a few
    microseconds each."""

    __slots__ = ("_phase", "_silent", "_upstream")

    def __init__(self, upstream: Upstream, phase: Phase, silent: Callable[[], bool]) -> None:
        self._upstream = upstream
        self._phase = phase
        self._silent = silent

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, (TimeoutError, aiohttp.ClientError)):
            failure = upstream_failure(exc, self._upstream, self._phase, silent=self._silent)
            if failure is not None:
                raise failure from None
