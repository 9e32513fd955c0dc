"""Replay captured requests as an upstream (issue 22): `tokenmeter mock-upstream --replay FILE`.

The file holds export lines (docs/capture.md). A request is answered with the recording whose
`messages` equal its own (as canonical JSON: the model may differ, that is the point of a
replay) on the same route: a JSON answer with its recorded status and body, a stream with its
recorded events, paced as they were recorded (divided by `speed`; 0 sends them at once). A
request that matches nothing gets a 404 naming that, in the route's API's error shape.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

__all__ = ["RecordedEvent", "Recording", "Recordings", "ReplayFileError", "canonical",
           "create_replay_app", "load_recordings", "parse_line", "run_replay"]

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
    return Recording(
        line=line, path=data["path"], key=canonical(data["messages"]),
        stream=data.get("stream", False), status=status, body=response.get("body"),
        events=tuple(_event(event) for event in events),
    )


def parse_line(text: str, line: int) -> Recording:
    """One export line (`line` counts from 1) as a Recording; ReplayFileError names the line."""
    try:
        return _recording(json.loads(text), line)
    except ValueError as exc:  # json.JSONDecodeError included
        raise ReplayFileError(f"line {line}: {exc}") from None


@dataclass(frozen=True)
class Recordings:
    by_key: Mapping[tuple[str, str], tuple[Recording, ...]]

    @classmethod
    def of(cls, recordings: Iterable[Recording]) -> Recordings:
        grouped: dict[tuple[str, str], list[Recording]] = {}
        for rec in recordings:
            grouped.setdefault((rec.path, rec.key), []).append(rec)
        return cls({key: tuple(found) for key, found in grouped.items()})

    def find(self, path: str, messages: Any, stream: bool) -> Recording | None:
        """The recording for a request to `path` with these messages: of several, the first
        with the same `stream` (an SDK cannot read a stream it did not ask for), else the
        first; None when no recording on this route has these messages."""
        found = self.by_key.get((path, canonical(messages)), ())
        return next((r for r in found if r.stream == stream), found[0] if found else None)


def load_recordings(path: Path) -> Recordings:
    """Every line of `path` (blank lines skipped), checked before anything is served; the
    errors' messages name the line, not the file (the caller knows that)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayFileError(f"cannot read it: {exc}") from None
    found = [parse_line(text, n) for n, text in enumerate(lines, 1) if text.strip()]
    if not found:
        raise ReplayFileError("it holds no recorded request")
    return Recordings.of(found)


RECORDINGS = web.AppKey("tokenmeter_replay_recordings", Recordings)
SPEED = web.AppKey("tokenmeter_replay_speed", float)


def _no_match(path: str, *, anthropic: bool) -> web.Response:
    message = f"No recorded request matches this request's messages on {path}."
    if anthropic:
        body: dict[str, Any] = {"type": "error",
                                "error": {"type": "not_found_error", "message": message}}
    else:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                          "code": "replay_no_match"}}
    return web.json_response(body, status=404)


async def _replay_stream(request: web.Request, rec: Recording, speed: float) -> web.StreamResponse:
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    resp = web.StreamResponse(status=rec.status, headers=headers)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await resp.prepare(request)
    for event in rec.events:
        if speed > 0 and (wait := started + event.at_ms / 1000 / speed - loop.time()) > 0:
            await asyncio.sleep(wait)
        await resp.write(f"{event.text}\n\n".encode())
    await resp.write_eof()
    return resp


async def _answer(request: web.Request) -> web.StreamResponse:
    anthropic = request.path == "/v1/messages"
    try:
        body = json.loads(await request.read())
    except ValueError:
        body = None
    if not isinstance(body, dict) or "messages" not in body:
        return _no_match(request.path, anthropic=anthropic)
    rec = request.app[RECORDINGS].find(request.path, body["messages"], body.get("stream") is True)
    if rec is None:
        return _no_match(request.path, anthropic=anthropic)
    if rec.streamed:
        return await _replay_stream(request, rec, request.app[SPEED])
    text = b"" if rec.body is None else json.dumps(rec.body, ensure_ascii=False).encode()
    return web.Response(status=rec.status, body=text, content_type="application/json")


async def _unknown_route(request: web.Request) -> web.StreamResponse:
    error = {"message": f"Invalid URL ({request.method} {request.path}): the replay serves "
                        f"only {', '.join(ROUTES)}", "type": "invalid_request_error",
             "param": None, "code": None}
    return web.json_response({"error": error}, status=404)


def create_replay_app(recordings: Recordings, speed: float = 1.0) -> web.Application:
    if not (math.isfinite(speed) and speed >= 0):
        raise ValueError("speed must be a finite number, 0 or more")
    app = web.Application(client_max_size=64 * 1024 * 1024)  # as the mock: long prompts
    app[RECORDINGS] = recordings
    app[SPEED] = float(speed)
    for route in ROUTES:
        app.router.add_post(route, _answer)
    app.router.add_route("*", "/{tail:.*}", _unknown_route)
    return app


def run_replay(recordings: Recordings, speed: float, host: str, port: int) -> None:
    line = f"replay upstream listening on http://{host}:{port}/v1"

    def announce(*_: Any) -> None:
        print(line, flush=True)

    web.run_app(create_replay_app(recordings, speed), host=host, port=port, print=announce,
                access_log=None, handler_cancellation=True)
