"""SIGTERM: stop accepting, let running streams finish, settle them, exit."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer

from tests.helpers import MESSAGES, until
from tests.servers import free_port, wait_for_port


def _serve(cfg: Path, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


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
    port = free_port()
    proc = _serve(cfg, port)
    try:
        await asyncio.to_thread(wait_for_port, port, 20.0)
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": "mock-gpt", "messages": MESSAGES, "stream": True},
                # 60 tokens at 40/s: the stream outlives the SIGTERM by about a second and a half.
                headers={"x-mock-output-tokens": "60", "x-mock-tokens-per-second": "40"},
            )
            body = await resp.content.readany()
            proc.send_signal(signal.SIGTERM)
            # No new connections while the running stream drains (a deadline, not a speed).
            await until(lambda: asyncio.to_thread(_refuses, port), deadline=10.0)
            async for chunk in resp.content.iter_any():
                body += chunk
        assert resp.status == 200
        assert body.rstrip().endswith(b"data: [DONE]")  # the running stream finished whole
        assert body.count(b'"content":" ') == 60
        _, err = await asyncio.to_thread(proc.communicate, timeout=30)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    access = [json.loads(x) for x in err.splitlines() if x.startswith('{"event":"request"')]
    assert len(access) == 1
    assert access[0]["output_tokens"] == 60 and access[0]["error_class"] == "none"


async def test_sighup_reloads_the_config(upstream: TestServer, tmp_path: Path) -> None:
    cfg = tmp_path / "tm.yaml"
    cfg.write_text(
        f"upstreams:\n  mock:\n    base_url: {upstream.make_url('/v1')}\n"
        "metrics:\n  discover_models: false\n"
    )
    port = free_port()
    proc = _serve(cfg, port)

    def read_until(text: str) -> bool:
        assert proc.stderr is not None
        return any(text in line for line in iter(proc.stderr.readline, ""))

    try:
        await asyncio.to_thread(wait_for_port, port, 20.0)
        # The file is unchanged, so only the signal can cause this reload.
        proc.send_signal(signal.SIGHUP)
        assert await asyncio.wait_for(asyncio.to_thread(read_until, "configuration reloaded"), 10)
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)
