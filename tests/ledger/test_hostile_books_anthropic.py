"""An Anthropic stream the upstream ends with an `error` event (issue 20, item 14a) is booked as
the class of that error, not as a success: a real proxy process, a small upstream that
overloads mid-stream, the anthropic SDK as the client, a PostgreSQL ledger."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import asyncpg
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.ledger.schema import TABLE
from tests.helpers import ServerFactory, until
from tests.servers import ServedProxy


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


async def _overloaded_midway(request: web.Request) -> web.StreamResponse:
    """Anthropic's stream as it goes when the service overloads mid-answer: a 200, a few
    deltas, then `event: error` with `overloaded_error`, and the end of the stream."""
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_event("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 1}}}))
    await resp.write(_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                     "content_block": {"type": "text",
                                                                       "text": ""}}))
    for word in ("one", " two", " three"):
        await resp.write(_event("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": word}}))
    await resp.write(_event("error", {"type": "error", "error": {
        "type": "overloaded_error", "message": "Overloaded"}}))
    await resp.write_eof()
    return resp


@pytest.mark.timeout(90)
async def test_a_stream_ended_by_an_overloaded_error_is_booked_as_upstream_5xx(
    aiohttp_server: ServerFactory, pg_url: str, tmp_path: Path
) -> None:
    app = web.Application()
    app.router.add_post("/v1/messages", _overloaded_midway)
    upstream: TestServer = await aiohttp_server(app)
    cfg = tmp_path / "tm.yaml"
    cfg.write_text(f"""
upstreams:
  claude:
    base_url: {upstream.make_url("/v1")}
    api: anthropic
    api_key: sk-upstream-0123456789
models:
  - match: "*"
    upstream: claude
metrics:
  discover_models: false
ledger:
  url: {pg_url}
""")
    proxy = ServedProxy(cfg, tmp_path / "proxy.log",
                        env={"TOKENMETER_STATE_DIR": str(tmp_path / "state")})
    db = None
    try:
        await proxy.started()
        async with anthropic.AsyncAnthropic(base_url=proxy.url,
                                            api_key="sk-any", max_retries=0) as client:
            texts = []
            with pytest.raises(anthropic.APIStatusError, match="Overloaded"):
                stream = await client.messages.create(
                    model="claude-test", max_tokens=64, stream=True,
                    messages=[{"role": "user", "content": "count to three"}])
                async for event in stream:
                    if event.type == "content_block_delta" and event.delta.type == "text_delta":
                        texts.append(event.delta.text)
            assert "".join(texts) == "one two three"  # relayed as it came, error included

        db = await asyncpg.connect(pg_url)

        async def booked() -> bool:
            try:
                return bool(await db.fetchval(f"SELECT count(*) FROM {TABLE}"))
            except asyncpg.UndefinedTableError:
                return False

        await until(booked, deadline=20)
        row = await db.fetchrow(f"SELECT status, error_class, output_tokens FROM {TABLE}")
        assert row is not None
        # On main: 200 / none, a failed request booked as a success.
        assert (row["status"], row["error_class"]) == (200, "upstream_5xx")
        assert row["output_tokens"] > 0  # what was streamed is still charged
    finally:
        if db is not None:
            await db.close()
        await proxy.stopped()
