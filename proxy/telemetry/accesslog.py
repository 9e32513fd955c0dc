"""One structured JSON line per request: a projection of its `RequestRecord`, as its ledger
row is. Never prompt text, never keys.

Requests refused for a missing or unknown key are the exception: anyone can send them, as fast
as they like, so they get no line each (a wrong-key flood wrote 23 MB of log in 15 s). The
first is logged at once, then at most one line per AUTH_LOG_EVERY_S, each saying how many
failed since the line before (`AuthFailureLog`); tokenmeter_auth_failures_total counts each.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TextIO

from proxy.record import RequestRecord

ACCESS_LOGGER = "tokenmeter.access"
access_log = logging.getLogger(ACCESS_LOGGER)

AUTH_LOG_EVERY_S = 10.0


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def log_request(rec: RequestRecord) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    if _direct is not None and _direct.raw:  # `serve`: straight to its handler, no LogRecord
        _direct.line(request_line(rec))
        return
    # The record made here, not by `info`: its caller's frame and file are never read
    # (logging's findCaller walks the stack for every line; the line names its request).
    access_log.handle(access_log.makeRecord(
        ACCESS_LOGGER, logging.INFO, __file__, 0, request_line(rec), (), None))


_str = json.encoder.encode_basestring_ascii  # C: quoted and escaped, as json.dumps writes


def _s(value: str | None) -> str:
    return "null" if value is None else _str(value)


def _n(value: float | None) -> str:
    return "null" if value is None else repr(value)


def request_line(rec: RequestRecord) -> str:
    """The request's fields as one JSON object, written out field by field, the same bytes as
    `json.dumps(fields, separators=(",", ":"))` (tests/telemetry/test_accesslog.py holds the
    two alike): a line per request is on every request's path, and the dict and the generic
    encoder cost four times as much."""
    u, f = rec.usage, rec.figures
    tps = f.output_tokens_per_second
    return (
        f'{{"event":"request","request_id":{_str(rec.request_id)},'
        f'"operation":{_str(rec.operation)},"user":{_str(rec.user)},"key":{_s(rec.key)},'
        f'"model":{_str(rec.model[:200])},'
        f'"fallback_from":{_s(None if rec.fallback_from is None else rec.fallback_from[:200])},'
        f'"response_model":'
        f'{_s(None if rec.response_model is None else rec.response_model[:200])},'
        f'"attempts":{rec.attempts},"upstream":{_str(rec.upstream_label)},"status":{rec.status},'
        f'"error_class":{_str(rec.error_class)},"stream":{"true" if rec.stream else "false"},'
        f'"cache":{_str(rec.cache)},"cache_reason":{_s(rec.cache_reason)},'
        f'"input_tokens":{u.input_tokens},"output_tokens":{u.output_tokens},'
        f'"cached_input_tokens":{u.cached_input_tokens},'
        f'"reasoning_tokens":{u.reasoning_tokens},"total_tokens":{u.total_tokens},'
        f'"token_source":{_str(u.source)},"ttft_ms":{_n(_ms(f.ttft))},'
        f'"upstream_ttft_ms":{_n(_ms(f.upstream_ttft))},'
        f'"overhead_ms":{_n(_ms(f.overhead))},"duration_ms":{_n(_ms(f.duration))},'
        f'"tpot_ms":{_n(_ms(f.time_per_output_token))},'
        f'"tokens_per_second":{_n(None if tps is None else round(tps, 1))},'
        f'"content_chunks":{f.content_chunks}}}'
    )


class LogFormat(enum.StrEnum):
    """`serve --log-format`: JSON lines for a service's log pipeline (the default), or text
    for a person reading a terminal."""

    JSON = "json"
    TEXT = "text"


def text_fields(fields: Mapping[str, object]) -> str:
    """An access-log object for people: its event, then `name=value` for each field that has
    a value (a string with spaces or quotes in JSON's quoting)."""
    parts = [str(fields.get("event", ""))]
    for name, value in fields.items():
        if name == "event" or value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = value if value and value.isprintable() and not any(
                c in value for c in ' "=') else json.dumps(value)
        else:
            text = str(value)
        parts.append(f"{name}={text}")
    return " ".join(parts)


class TextFormatter(logging.Formatter):
    """`--log-format text`: `time LEVEL logger: message`, an access-log line's JSON object as
    `text_fields` writes it."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if record.name == ACCESS_LOGGER:
            try:
                fields = json.loads(record.getMessage())
            except ValueError:
                fields = None
            if isinstance(fields, dict):
                record = logging.makeLogRecord(
                    {**record.__dict__, "msg": text_fields(fields), "args": ()})
        return super().format(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if record.name == "tokenmeter.access":
            return record.getMessage()  # already one JSON object
        out: dict[str, object] = {
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


class AuthFailureLog:
    """The sampled access-log line of failed authentications: the first at once, then at most
    one per AUTH_LOG_EVERY_S, when a failure comes (a flood that stops leaves its last count
    to the metric). Each names one request (its id, to find it) and counts the failures since
    the previous line, this one included. At warning level: it is about the gateway being
    probed or a client misconfigured, not about traffic served."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._next = float("-inf")
        self._since: float | None = None
        self._count = 0

    def failed(self, request_id: str, operation: str) -> None:
        self._count += 1
        now = self._clock()
        if now < self._next:
            return
        since = None if self._since is None else round(now - self._since, 1)
        access_log.warning(
            f'{{"event":"auth_failed","request_id":{_str(request_id)},'
            f'"operation":{_str(operation)},"status":401,"failures":{self._count},'
            f'"seconds":{_n(since)}}}'
        )
        self._count = 0
        self._since = now
        self._next = now + AUTH_LOG_EVERY_S


class LoopLineHandler(logging.Handler):
    """The access log's own handler (`serve` installs it; `propagate` off): each record's
    message, already one JSON line, goes to `stream` with the other lines of the same turn of
    the event loop in one write and flush (`loop.call_soon`), and with no lock of logging's:
    lines come from the loop's thread (settle), which alone touches the buffer. The stock
    StreamHandler takes a lock per line that every thread's logging shares, and writes and
    flushes each line on its own.
    A line from another thread (nothing logs access lines from one) is written at once, by
    itself."""

    def __init__(self, stream: TextIO, log_format: LogFormat = LogFormat.JSON) -> None:
        super().__init__()
        self._stream = stream
        self._lines: list[str] = []
        self.holding = False  # lines kept back (`held`)
        # JSON: a record's message is its line as it is; text: the formatter's.
        self.raw = log_format is LogFormat.JSON
        if not self.raw:
            self.setFormatter(TextFormatter())

    def createLock(self) -> None:
        self.lock = None  # Handler.acquire skips a None lock

    def handle(self, record: logging.LogRecord) -> bool:
        self.line(record.getMessage() if self.raw else self.format(record))
        return True

    def line(self, line: str) -> None:
        """One line (no newline): queued for this loop turn's write."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write(line + "\n")
            return
        lines = self._lines
        lines.append(line)
        if len(lines) == 1 and not self.holding:
            loop.call_soon(self.flush)

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)

    def flush(self) -> None:
        lines = self._lines
        if lines and not self.holding:
            self._lines = []
            lines.append("")
            self._write("\n".join(lines))

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):
            pass  # as a StreamHandler's: a log that cannot be written does not stop serving


_direct: LoopLineHandler | None = None  # the access log's own handler, once installed


def install_access_handler(stream: TextIO, log_format: LogFormat = LogFormat.JSON) -> None:
    """Access-log lines to `stream` by LoopLineHandler, not through the root logger's handlers;
    a request's JSON line goes to it without a LogRecord (`log_request`)."""
    global _direct  # noqa: PLW0603  one handler for the process, installed at its start
    _direct = LoopLineHandler(stream, log_format)
    access_log.handlers[:] = [_direct]
    access_log.propagate = False


@contextlib.contextmanager
def held() -> Iterator[None]:
    """The access log's lines kept back meanwhile, then written (`demo`: a stream's line is
    written as it settles, before its end reaches the client, and would cut its text)."""
    handler = _direct
    if handler is None:
        yield
        return
    handler.holding = True
    try:
        yield
    finally:
        handler.holding = False
        handler.flush()
