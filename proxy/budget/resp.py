"""One pipelined connection to a single Redis server, for the budget scripts on every request.

Why not redis-py's client for these: per call it checks a connection out of its pool and back,
packs every argument through its encoder, arms a timeout on the write and another on the read,
and writes each command in a syscall of its own; for a reserve and a settle per request that
was most of the budget's CPU in the serving process (benchmarks/README.md, "Budget store CPU").
Here the caller packs a script call once (`pack`), every command written in one turn of the
event loop goes out in one write, the replies are parsed by hiredis in C and handed to their
callers in order (Redis answers a connection's commands in the order it read them), and one
timer watches the oldest unanswered command instead of one per call.

The rules are still the Lua scripts, run atomically by Redis (EVALSHA; the script's body when
the server does not hold it yet). A command whose reply is later than the timeout drops the
connection, as redis-py drops its connection then: every command still waiting fails
(`RespError`) and the next call opens a new connection.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ssl
from typing import Any, cast

import hiredis
from redis.asyncio.connection import parse_url


class RespError(Exception):
    """The server could not be reached, went away, was too slow, or answered with an error."""


def pack(*args: bytes) -> bytes:
    """A command in RESP, from arguments already bytes."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def arg(value: int | str | bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    return str(value).encode()


class Script:
    """A Lua script as this connection calls it: by its SHA1, by its body on NOSCRIPT."""

    def __init__(self, body: str) -> None:
        self.body = body.encode()
        self.sha = hashlib.sha1(self.body, usedforsecurity=False).hexdigest().encode()


_READY = pack(b"EVAL", b"return 1", b"0")


def _loading(reply: object) -> bool:
    return isinstance(reply, hiredis.ReplyError) and str(reply).startswith("LOADING")


class _Pipe(asyncio.Protocol):
    """The protocol of one connection: a queue of callers waiting for their replies."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.loop = loop
        self.timeout = timeout
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reader = hiredis.Reader()
        self._waiting: collections.deque[tuple[float, asyncio.Future[Any]]] = collections.deque()
        self._out: list[bytes] = []
        self._watch: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio's: take it as the one asked for.
        self.transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        waiting = self._waiting
        while (reply := self._reader.gets()) is not False:
            if not waiting:  # nothing asked for it: the stream cannot be trusted
                self.abort(RespError("a reply no command was waiting for"))
                return
            future = waiting.popleft()[1]
            if not future.done():  # a caller that gave up leaves its reply to drop
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RespError(f"the connection was lost: {exc or 'closed by the server'}"))

    def send(self, command: bytes) -> asyncio.Future[Any]:
        future = self.loop.create_future()
        if self.closed:
            future.set_exception(RespError("the connection is closed"))
            return future
        self._waiting.append((self.loop.time() + self.timeout, future))
        if not self._out:
            self.loop.call_soon(self._flush)
        self._out.append(command)
        if self._watch is None:
            self._watch = self.loop.call_later(self.timeout, self._check)
        return future

    def _flush(self) -> None:
        if self.transport is not None and not self.closed and self._out:
            self.transport.write(b"".join(self._out))
        self._out.clear()

    def _check(self) -> None:
        """The oldest unanswered command is past its deadline: drop the connection."""
        self._watch = None
        if not self._waiting or self.closed:
            return
        deadline = self._waiting[0][0]
        if self.loop.time() >= deadline:
            self.abort(RespError(f"no reply within {self.timeout * 1000:.0f} ms"))
            return
        self._watch = self.loop.call_at(deadline, self._check)

    def abort(self, exc: RespError) -> None:
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: RespError) -> None:
        self.closed = True
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._out.clear()
        while self._waiting:
            future = self._waiting.popleft()[1]
            if not future.done():
                future.set_exception(exc)


class Connection:
    """A pipelined connection to the server `url` names (redis://, rediss://, unix://), opened
    on first use in the running event loop and again after it is lost."""

    def __init__(self, url: str, timeout: float) -> None:
        self._params: dict[str, Any] = dict(parse_url(url))
        self._timeout = timeout
        self._pipe: _Pipe | None = None
        self._opening: asyncio.Future[_Pipe] | None = None

    async def call(self, command: bytes) -> Any:
        pipe = self._pipe
        if pipe is None or pipe.closed or pipe.loop is not asyncio.get_running_loop():
            pipe = await self._open()
        reply = await pipe.send(command)
        if isinstance(reply, hiredis.ReplyError):
            raise RespError(str(reply))
        return reply

    async def evalsha(self, script: Script, keys: list[bytes], args: list[bytes]) -> Any:
        tail = [b"%d" % len(keys), *keys, *args]
        try:
            return await self.call(pack(b"EVALSHA", script.sha, *tail))
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.call(pack(b"EVAL", script.body, *tail))

    async def _open(self) -> _Pipe:
        # Callers that find no connection share the one being opened.
        opening = self._opening
        if (opening is None or opening.done()
                or opening.get_loop() is not asyncio.get_running_loop()):
            opening = asyncio.ensure_future(self._connect())
            # Read, so that an opening every caller gave up on is not reported as unread.
            opening.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._opening = opening
        try:
            return await asyncio.shield(opening)
        finally:
            if opening.done() and self._opening is opening:
                self._opening = None

    async def _connect(self) -> _Pipe:
        loop = asyncio.get_running_loop()
        p = self._params
        try:
            async with asyncio.timeout(self._timeout):
                if "path" in p:
                    _, pipe = await loop.create_unix_connection(
                        lambda: _Pipe(loop, self._timeout), p["path"])
                else:
                    _, pipe = await loop.create_connection(
                        lambda: _Pipe(loop, self._timeout), p.get("host", "localhost"),
                        p.get("port", 6379), ssl=_tls(p))
                setup = []
                if p.get("password") is not None:
                    user = p.get("username")
                    setup.append(pack(b"AUTH", *([arg(user)] if user else []),
                                      arg(p["password"])))
                if p.get("db"):
                    setup.append(pack(b"SELECT", arg(p["db"])))
                setup.append(_READY)
                replies = await asyncio.gather(*(pipe.send(c) for c in setup))
                # A server that has just started answers LOADING until its data is in memory
                # (an AOF or RDB file): the connection is ready when a script runs, within
                # the timeout.
                while _loading(replies[-1]):
                    await asyncio.sleep(0.01)
                    replies[-1] = await pipe.send(_READY)
                for reply in replies:
                    if isinstance(reply, hiredis.ReplyError):
                        pipe.abort(RespError(str(reply)))
                        raise RespError(str(reply))
        except (OSError, TimeoutError) as exc:
            raise RespError(f"cannot connect: {type(exc).__name__}: {exc}") from exc
        old, self._pipe = self._pipe, pipe
        if old is not None and not old.closed and not old.loop.is_closed():
            old.abort(RespError("replaced by a connection in another event loop"))
        return pipe

    def close(self) -> None:
        pipe, self._pipe = self._pipe, None
        if pipe is not None and not pipe.closed and not pipe.loop.is_closed():
            pipe.abort(RespError("closed"))


def _tls(params: dict[str, Any]) -> ssl.SSLContext | None:
    """rediss://: the system's trust, or the URL's `ssl_ca_certs`; `ssl_cert_reqs=none`
    turns verification off (as redis-py takes them)."""
    if "connection_class" not in params or "path" in params:
        return None
    context = ssl.create_default_context(cafile=params.get("ssl_ca_certs"))
    if str(params.get("ssl_cert_reqs", "required")).lower() in ("none", "cert_none"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
