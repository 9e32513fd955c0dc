"""SIGTERM: stop accepting, let running streams finish, settle them, exit."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer

from tests.helpers import MESSAGES, relayed, until
from tests.servers import ServedProxy


def _refuses(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return False
    except OSError:
        return True


async def test_sigterm_drains_running_streams(upstream: TestServer, tmp_path: Path) -> None:
    cfg = tmp_path / "tm.yaml"
    cfg.write_text(
        f"server:\n  drain_seconds: 20\nupstreams:\n  mock:\n    base_url: {upstream.make_url('/v1')}\n"
        "metrics:\n  discover_models: false\n"
    )
    proxy = await ServedProxy(cfg, tmp_path / "proxy.log").started()
    try:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                f"{proxy.url}/v1/chat/completions",
                json={"model": "mock-gpt", "messages": MESSAGES, "stream": True},
                # 60 tokens at 40/s: the stream outlives the SIGTERM by about a second and a half.
                headers={"x-mock-output-tokens": "60", "x-mock-tokens-per-second": "40"},
            )
            body = await resp.content.readany()
            proxy.send(signal.SIGTERM)
            # No new connections while the running stream drains (a deadline, not a speed).
            await until(lambda: asyncio.to_thread(_refuses, proxy.port), deadline=10.0)
            async for chunk in resp.content.iter_any():
                body += chunk
        assert resp.status == 200
        # The running stream finished whole (its cost comment after `[DONE]`).
        assert relayed(body).rstrip().endswith(b"data: [DONE]")
        assert body.count(b'"content":" ') == 60
        assert await proxy.stopped() == 0
    finally:
        proxy.kill()
    access = [json.loads(x) for x in proxy.log_text().splitlines()
              if x.startswith('{"event":"request"')]
    assert len(access) == 1
    assert access[0]["output_tokens"] == 60 and access[0]["error_class"] == "none"


async def test_sighup_reloads_the_config(upstream: TestServer, tmp_path: Path) -> None:
    cfg = tmp_path / "tm.yaml"
    cfg.write_text(
        f"upstreams:\n  mock:\n    base_url: {upstream.make_url('/v1')}\n"
        "metrics:\n  discover_models: false\n"
    )
    proxy = await ServedProxy(cfg, tmp_path / "proxy.log").started()
    try:
        assert "configuration reloaded" not in proxy.log_text()
        # The file is unchanged, so only the signal can cause this reload.
        proxy.send(signal.SIGHUP)
        await until(lambda: "configuration reloaded" in proxy.log_text(), deadline=10)
    finally:
        await proxy.stopped()
