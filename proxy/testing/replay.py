"""Replay captured requests as an upstream: `tokenmeter mock-upstream --replay FILE`.

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

# The export line's parser is shared with `bench --replay`; its names stay importable here.
from proxy.protocol.export_line import (
    ROUTES,
    RecordedEvent,
    Recording,
    ReplayFileError,
    canonical,
    parse_line,
    read_lines,
)

__all__ = ["RecordedEvent", "Recording", "Recordings", "ReplayFileError", "canonical",
           "create_replay_app", "load_recordings", "parse_line", "run_replay"]


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
    return Recordings.of(read_lines(path))


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
