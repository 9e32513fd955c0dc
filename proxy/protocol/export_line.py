"""The export line of docs/capture.md as read back: one captured request and its answer.

The one parser of that line: `tokenmeter mock-upstream --replay` (proxy/testing/replay.py)
serves its answers, `tokenmeter bench --replay` (proxy/bench/replay.py) sends its requests.
It lives here, below both, because those two are sibling layers that may not import each other.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ROUTES", "RecordedEvent", "Recording", "ReplayFileError", "canonical", "parse_line",
           "read_counted", "read_lines"]

log = logging.getLogger("tokenmeter.replay")

# The routes a replay serves and sends; lines of other routes are read but never replayed.
ROUTES = ("/v1/chat/completions", "/v1/messages")


class ReplayFileError(ValueError):
    """A line of the replay file that cannot be replayed; the message names the line."""


@dataclass(frozen=True)
class RecordedEvent:
    at_ms: float  # after the upstream request was sent, as captured
    text: str  # the SSE event without its closing blank line


@dataclass(frozen=True)
class Recording:
    line: int
    path: str
    key: str  # the request's messages as canonical JSON
    stream: bool
    status: int
    body: Any  # a JSON answer's (or error's) body as parsed JSON; None for none
    events: tuple[RecordedEvent, ...]
    messages: tuple[Any, ...] = ()
    max_tokens: int | None = None
    request: Mapping[str, Any] | None = None  # the client's body as JSON, when exported

    @property
    def streamed(self) -> bool:
        # A stream request that failed before streaming was answered with a JSON error body.
        return self.stream and self.status == 200 and self.body is None


def canonical(messages: Any) -> str:
    """The form two requests' messages are compared in (docs/capture.md)."""
    return json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _event(raw: Any) -> RecordedEvent:
    if not isinstance(raw, dict) or not isinstance(raw.get("text"), str):
        raise ValueError("each of response.events must be an object with a text")
    at_ms = raw.get("at_ms")
    if isinstance(at_ms, bool) or not isinstance(at_ms, int | float) or not (
            math.isfinite(at_ms) and at_ms >= 0):
        raise ValueError("an event's at_ms must be a finite number, not negative")
    return RecordedEvent(at_ms=float(at_ms), text=raw["text"])


def _request_fields(data: dict[str, Any]) -> tuple[int | None, Mapping[str, Any] | None]:
    # The client's cap as it sent it, which may be anything (a request the upstream refused):
    # kept only when it is a cap; the body sent again carries it as it was.
    max_tokens = data.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        max_tokens = None
    request = data.get("request")
    if request is not None and not isinstance(request, dict):
        raise ValueError("request must be an object (the client's body)")
    return max_tokens, request


def _recording(data: Any, line: int) -> Recording:
    if not isinstance(data, dict):
        raise ValueError("a line must be a JSON object")
    if not isinstance(data.get("path"), str):
        raise ValueError("path must be a string")
    # Lines of other routes (the Responses API, embeddings) are kept but never matched: the
    # replay serves only ROUTES, and an export may hold them all.
    if data["path"] in ROUTES and not isinstance(data.get("messages"), list):
        raise ValueError("messages must be a list")
    if not isinstance(data.get("stream", False), bool):
        raise ValueError("stream must be true or false")
    response = data.get("response")
    if not isinstance(response, dict):
        raise ValueError("response must be an object")
    status = response.get("status")
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        raise ValueError("response.status must be an HTTP status (200-599)")
    events = response.get("events") or []
    if not isinstance(events, list):
        raise ValueError("response.events must be a list")
    max_tokens, request = _request_fields(data)
    messages = data.get("messages")
    return Recording(
        line=line, path=data["path"], key=canonical(messages),
        stream=data.get("stream", False), status=status, body=response.get("body"),
        events=tuple(_event(event) for event in events),
        messages=tuple(messages) if isinstance(messages, list) else (),
        max_tokens=max_tokens, request=request,
    )


def parse_line(text: str, line: int) -> Recording:
    """One export line (`line` counts from 1) as a Recording; ReplayFileError names the line."""
    try:
        return _recording(json.loads(text), line)
    except ValueError as exc:  # json.JSONDecodeError included
        raise ReplayFileError(f"line {line}: {exc}") from None


def read_lines(path: Path) -> list[Recording]:
    """Every line of `path` that can be replayed: `read_counted`'s lines."""
    return read_counted(path)[0]


def read_counted(path: Path) -> tuple[list[Recording], int]:
    """Every line of `path` (blank lines skipped), and how many lines were skipped as not
    readable. Lines are split on `\\n` alone, as the export
    writes them (JSON text holds no raw newline), never on the other Unicode line breaks
    (U+2028, U+0085...) that a captured text may hold. A line that cannot be replayed is
    skipped with a warning naming it (`FILE: line N: ...`): one bad capture never refuses the
    file. ReplayFileError: the file cannot be read, or holds no request at all."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ReplayFileError(f"cannot read it: {exc}") from None
    found: list[Recording] = []
    unreadable = 0
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            found.append(parse_line(line.decode("utf-8"), n))
        except UnicodeDecodeError as exc:
            unreadable += 1
            log.warning("%s: line %d skipped: not UTF-8 (%s)", path, n, exc.reason)
        except ReplayFileError as exc:
            unreadable += 1
            log.warning("%s: %s (skipped)", path, exc)
    if not found:
        raise ReplayFileError("it holds no recorded request")
    return found, unreadable
