"""The client-facing listener, hardened against clients that hold connections open.

aiohttp has no deadline on reading a request: a client that sends its header block one byte at
a time (slowloris) or stops halfway through its body keeps a socket, and with enough of them
the process runs out of file descriptors and cannot open upstream sockets any more. Here:

- the header block of each request must arrive whole within `header_timeout_s`: counted from
  the connection's start for its first request, and from the first byte of the next one on a
  kept-alive connection (the idle wait before that byte is aiohttp's `keepalive_timeout`);
- the body must arrive whole within `body_timeout_s` of the headers being parsed;
- at most `max_connections` client connections are open at once; one more is answered at once
  with a 503 in OpenAI's error shape and closed;
- at most `max_connections_per_source` of them come from one client address (one source cannot
  take every slot); one more from that address is answered at once with a 429 and closed;
- request bodies are never inflated by aiohttp (`auto_decompress` off): a compressed body is
  refused by the handler (415) before it is read, so a gzip bomb costs its compressed bytes;
- a body the handler answered without reading (a 401 from the headers alone, a 413, a 415) is
  never drained: aiohttp would read and discard it for up to 10 s (its lingering close), which
  costs the loop CPU for every byte a client without a key sends. The answer goes out with
  `Connection: close`, then the end of the proxy's side (FIN), reading stops at once (what the
  client still sends waits in the kernel, unread), and the connection is closed after
  `REFUSAL_LINGER_S`, so the client can read the answer before the close resets it.

A late request is answered 408 (when nothing of a response was sent yet) and the connection is
closed. Each deadline is one timer per request head, armed and checked outside the per-chunk
path: the only per-read cost is two attribute checks in `data_received`.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import resource
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse
from aiohttp.web_server import Server

from proxy.config.load import ServerConfig
from proxy.errors import ProxyError, ServiceUnavailable
from proxy.pipeline.services import BODY_TIMED_OUT

log = logging.getLogger("tokenmeter.listener")

# File descriptors kept out of the connection budget: the listeners, Redis, log files, DNS,
# the upstreams' idle pooled sockets beyond one per request.
FD_RESERVE = 128
# A refused connection is kept this long at most while its request is read and dropped, so the
# 503 is not lost to a TCP reset from closing with unread bytes.
REFUSAL_LINGER_S = 1.0
# Refusals and timeouts are logged at most once per this many seconds per kind, with a count:
# a flood must not become a log flood.
LOG_EVERY_S = 10.0
# The listen backlog of the sockets a site binds itself, as aiohttp's own sites.
BACKLOG = 128


class RequestTimeout(ProxyError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class SourceLimited(ProxyError):
    status = 429
    type = "rate_limit_error"
    code = "too_many_connections"


class ListenerEvent(enum.Enum):
    REFUSED = "refused"  # max_connections reached: 503 and closed
    SOURCE_LIMIT = "source_limit"  # max_connections_per_source reached: 429 and closed
    HEADER_TIMEOUT = "header_timeout"  # headers not whole in header_timeout_s: 408 and closed
    BODY_TIMEOUT = "body_timeout"  # body not whole in body_timeout_s: 408 and closed


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    max_connections: int = 4096
    max_connections_per_source: int | None = None  # None: no limit per source

    @classmethod
    def from_config(cls, server: ServerConfig, fd_limit: int | None = None) -> ListenerLimits:
        """The configured limits, `max_connections` lowered to what `fd_limit` allows."""
        max_connections = server.max_connections
        if fd_limit is not None:
            budget = connection_budget(fd_limit)
            if budget < max_connections:
                log.warning(
                    "server.max_connections lowered from %d to %d: the open-file limit is %d "
                    "and each client connection can need an upstream socket too",
                    max_connections, budget, fd_limit,
                )
                max_connections = budget
        return cls(server.header_timeout_s, server.body_timeout_s, server.keepalive_timeout_s,
                   max_connections, server.max_connections_per_source)


def connection_budget(fd_limit: int) -> int:
    """Client connections an open-file limit can carry: each may hold an upstream socket too."""
    return max(1, (fd_limit - FD_RESERVE) // 2)


def raise_fd_limit() -> int | None:
    """Raise the soft open-file limit to the hard one; return the soft limit in force after.

    Never fails: where the limit cannot be read or raised, the process runs with what it has."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    # macOS reports an unlimited hard limit but refuses more than kern.maxfilesperproc.
    targets = [hard] if hard != resource.RLIM_INFINITY else [1 << 20, 65536, 10240]
    for target in targets:
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            continue
        log.info("raised the open-file limit from %d to %d", soft, target)
        return target
    if targets[0] > soft:
        log.warning("could not raise the open-file limit above %d", soft)
    return soft


def _raw_response(status: int, reason: str, error: ProxyError) -> bytes:
    body = json.dumps(error.to_body()).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGuard:
    """Limits and counts shared by the sites of one process (one file-descriptor budget).

    `on_event` is called once per refusal or timeout, e.g. to count them in a metric."""

    def __init__(
        self,
        limits: ListenerLimits | None = None,
        on_event: Callable[[ListenerEvent], None] | None = None,
    ) -> None:
        self.limits = limits or ListenerLimits()
        self.open = 0
        # Open connections per client address; an address leaves the map with its last one.
        self.by_source: dict[str, int] = {}
        self.events = dict.fromkeys(ListenerEvent, 0)
        self._on_event = on_event
        self._unlogged = dict.fromkeys(ListenerEvent, 0)
        self._logged_at = dict.fromkeys(ListenerEvent, float("-inf"))
        self.refusal = _raw_response(503, "Service Unavailable", ServiceUnavailable(
            "The proxy has too many open connections (server.max_connections); retry shortly.",
            code="too_many_connections",
        ))
        self.source_refusal = _raw_response(429, "Too Many Requests", SourceLimited(
            "Too many connections are open from your address "
            "(server.max_connections_per_source); close some, or retry shortly."
        ))
        self.header_late = _raw_response(408, "Request Timeout", RequestTimeout(
            f"The request headers did not arrive within {self.limits.header_timeout_s:g} s "
            "(server.header_timeout_s)."
        ))
        self.body_late = _raw_response(408, "Request Timeout", RequestTimeout(
            f"The request body did not arrive within {self.limits.body_timeout_s:g} s "
            "(server.body_timeout_s)."
        ))

    def admit(self, source: str | None) -> ListenerEvent | None:
        """Count a new connection in, or say why it is refused."""
        if self.open >= self.limits.max_connections:
            return ListenerEvent.REFUSED
        per_source = self.limits.max_connections_per_source
        if source is not None:
            held = self.by_source.get(source, 0)
            if per_source is not None and held >= per_source:
                return ListenerEvent.SOURCE_LIMIT
            self.by_source[source] = held + 1
        self.open += 1
        return None

    def release(self, source: str | None) -> None:
        self.open -= 1
        if source is not None:
            held = self.by_source.pop(source) - 1
            if held:
                self.by_source[source] = held

    def note(self, event: ListenerEvent, now: float) -> None:
        self.events[event] += 1
        self._unlogged[event] += 1
        if now - self._logged_at[event] >= LOG_EVERY_S:
            count, self._unlogged[event], self._logged_at[event] = self._unlogged[event], 0, now
            log.warning("client connections closed early (%s): %d since the last report; %d open, "
                        "server.max_connections %d", event.value, count, self.open,
                        self.limits.max_connections)
        if self._on_event is not None:
            self._on_event(event)


class _Refusal(asyncio.Protocol):
    """A connection over the limit: the 503 at once, then whatever the client sends is dropped
    until it closes (or the linger ends): closing with unread bytes would reset the connection
    and could destroy the 503 before the client reads it."""

    def __init__(self, transport: asyncio.Transport, response: bytes) -> None:
        transport.write(response)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: BaseException | None) -> None:
        self._timer.cancel()


class _GuardedHandler(RequestHandler):
    __slots__ = ("_body_timer", "_counted", "_guard", "_head_timer", "_make_request", "_source")

    def __init__(self, manager: Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._counted = False
        self._source: str | None = None
        # start() calls the request factory once per request head it takes off the queue: the
        # hook for "the head is whole", outside the per-chunk path.
        factory = self._request_factory
        assert factory is not None
        self._make_request = factory
        self._request_factory = self._head_parsed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        source = _peer_address(transport)
        refused = guard.admit(source)
        if refused is not None:
            # (uvloop's transports are not asyncio.Transport subclasses, hence no isinstance)
            tcp = cast(asyncio.Transport, transport)
            tcp.set_protocol(_Refusal(tcp, guard.refusal if refused is ListenerEvent.REFUSED
                                      else guard.source_refusal))
            guard.note(refused, self._loop.time())
            return
        self._source = source
        self._counted = True
        super().connection_made(transport)
        self._arm_head()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._release()
        self._disarm()
        super().connection_lost(exc)

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self._guard.release(self._source)

    def data_received(self, data: bytes) -> None:
        # `_waiter` is set only while start() waits for the next request head: the first byte
        # of a kept-alive connection's next request starts that request's header deadline.
        if self._head_timer is None and self._waiter is not None and data:
            self._arm_head()
        super().data_received(data)

    def _arm_head(self) -> None:
        self._head_timer = self._loop.call_later(
            self._guard.limits.header_timeout_s, self._head_deadline
        )

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _head_parsed(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> BaseRequest:
        self._disarm()
        request = self._make_request(message, payload, protocol, writer, task)
        if not payload.is_eof():
            self._body_timer = self._loop.call_later(
                self._guard.limits.body_timeout_s, self._body_deadline, request, payload, writer
            )
        return request

    async def finish_response(
        self, request: BaseRequest, resp: StreamResponse, start_time: float | None
    ) -> tuple[StreamResponse, bool]:
        unread = not request.content.is_eof()
        if unread and not resp.prepared:
            resp.force_close()  # `Connection: close`: nothing more is read on this connection
        done = await super().finish_response(request, resp, start_time)
        if unread and not request.content.is_eof() and not done[1]:
            self._close_unread()
        return done

    def _close_unread(self) -> None:
        """The answer is written and the rest of the body is not wanted: end the proxy's side,
        stop reading, and close after the linger. The transport is taken from aiohttp (its
        `start` then neither drains the body nor closes the connection at once, which would
        reset it under an answer the client may not have read yet)."""
        transport = self.transport
        if transport is None:
            return
        self._force_close = True
        self.transport = None
        self._disarm()  # the body's deadline: the body is not awaited any more
        transport.pause_reading()
        if transport.can_write_eof():
            transport.write_eof()
        # connection_lost (which releases the slot) comes when the linger closes it.
        self._loop.call_later(REFUSAL_LINGER_S, transport.close)

    def _head_deadline(self) -> None:
        self._head_timer = None
        waiter = self._waiter
        # Waiting and nothing parsed: the head is still incomplete. Otherwise a head arrived
        # (queued behind a running request, or about to be taken) and its body timer takes over.
        if waiter is not None and not waiter.done():
            self._cut(ListenerEvent.HEADER_TIMEOUT, self._guard.header_late)

    def _body_deadline(
        self, request: BaseRequest, payload: StreamReader, writer: AbstractStreamWriter
    ) -> None:
        self._body_timer = None
        if payload.is_eof():
            return
        request[BODY_TIMED_OUT] = True
        # A response already started (the handler answered without reading the body) cannot be
        # followed by a 408: the connection is only cut.
        self._cut(ListenerEvent.BODY_TIMEOUT, self._guard.body_late if writer.output_size == 0
                  else b"")

    def _cut(self, event: ListenerEvent, response: bytes) -> None:
        transport = self.transport
        if transport is None:
            return
        self._guard.note(event, self._loop.time())
        if response:
            transport.write(response)
        # Counted free now, not at connection_lost: some loops (uvloop) close the socket a loop
        # turn before calling it, and the client may already be connecting again.
        self._release()
        # As aiohttp's own keep-alive timeout does: the handler, if any, is cancelled (the
        # relay settles it as a client disconnect) and the transport closes after the write.
        self.force_close()


def _peer_address(transport: asyncio.BaseTransport) -> str | None:
    """The client's address (IPv4 or IPv6, without the port); None for a Unix socket."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return None


class GuardedSite(web.BaseSite):
    """`web.TCPSite` whose connections are `_GuardedHandler`s sharing one `ConnectionGuard`.

    With `sock`, it serves a socket bound (and listening) elsewhere, e.g. one a supervisor
    process bound once and handed to each of its workers (proxy/server/workers.py); `host` and
    `port` then only name it."""

    __slots__ = ("_guard", "_host", "_port", "_sock")

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard,
        sock: socket.socket | None = None,
    ) -> None:
        super().__init__(runner, backlog=BACKLOG)
        self._host, self._port, self._guard, self._sock = host, port, guard, sock

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        # The keyword arguments aiohttp's Server gives each RequestHandler it makes (access log,
        # keepalive_timeout, debug...), so ours are configured exactly as the stock ones.
        # auto_decompress off: aiohttp would inflate a compressed body as it arrives, without
        # a cap on the inflated size and before any handler could refuse it.
        kwargs: dict[str, Any] = {**server._kwargs, "auto_decompress": False}
        guard = self._guard

        def factory() -> _GuardedHandler:
            return _GuardedHandler(server, guard, loop=loop, **kwargs)

        if self._sock is not None:
            self._server = await loop.create_server(factory, sock=self._sock,
                                                    backlog=self._backlog)
        else:
            self._server = await loop.create_server(factory, self._host, self._port,
                                                    backlog=self._backlog)

    @property
    def port(self) -> int:
        sockets = getattr(self._server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else self._port
