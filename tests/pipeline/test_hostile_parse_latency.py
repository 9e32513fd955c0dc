"""The latency guard of issue 20's item 7: input the tokenizer or the JSON parser used to choke
on (a megabyte of spaces, JSON nested 100,000 deep, a 2 MB array of numbers) is answered
cleanly by one proxy process while another client's small requests to it are each answered
within 300 ms. Before: the spaces were a 500 with a traceback, the nesting a RecursionError 500.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import ServerFactory, timed_client
from tests.servers import ServedProxy

SPACES = 1_000_000


def _chat(content: str) -> dict[str, Any]:
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": content}]}


def _upstream_app() -> web.Application:
    """Reads the body, counts nothing, answers without usage: the proxy estimates every prompt
    (at settle too)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-4o",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "Fine."}}],
        })

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.mark.timeout(150)
async def test_tokenizer_and_parser_hostile_input_does_not_stall_other_clients(
    aiohttp_server: ServerFactory, tmp_path: Path,
) -> None:
    upstream = await aiohttp_server(_upstream_app())
    cfg = tmp_path / "tm.yaml"
    cfg.write_text(
        f"upstreams:\n  mock:\n    base_url: {upstream.make_url('/v1')}\n"
        "models:\n  - {match: '*', upstream: mock}\n"
        "metrics:\n  discover_models: false\n"
    )
    proxy = ServedProxy(cfg, tmp_path / "proxy.log")
    url = f"{proxy.url}/v1/chat/completions"
    hostile_bodies = [
        ("spaces", json.dumps(_chat(" " * SPACES)).encode(), 200),
        ("spaces-and-words", json.dumps(_chat(("word " + " " * 4000) * 250)).encode(), 200),
        ("nested", b'{"model":"gpt-4o","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
         400),
        ("numbers", json.dumps({**_chat("hi"), "x": list(range(300_000))}).encode(), 200),
    ]
    seen: dict[str, tuple[int, str]] = {}
    try:
        await proxy.started()
        async with aiohttp.ClientSession() as ordinary, aiohttp.ClientSession() as hostile:

            async def ask() -> int:
                async with ordinary.post(url, json=_chat("How are you?"),
                                         timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    await resp.read()
                    return resp.status

            assert await ask() == 200  # warm: the connection, the proxy's first request
            async with timed_client(ask) as latencies:
                for _ in range(2):
                    for name, body, _status in hostile_bodies:
                        async with hostile.post(url, data=body, headers={
                                "content-type": "application/json"}) as r:
                            seen[name] = (r.status, (await r.text())[:300])
    finally:
        await proxy.stopped()
    for name, _body, status in hostile_bodies:
        assert seen[name][0] == status, (name, seen[name])
        assert "Traceback" not in seen[name][1]
    assert "Traceback" not in (tmp_path / "proxy.log").read_text()
    latencies.check(at_least=5)
