"""The commands a newcomer runs, as real processes."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import openai
from aiohttp.test_utils import TestServer

from proxy.testing.mock_upstream import generated_text
from tests.helpers import MESSAGES
from tests.servers import ServedProxy


def test_demo_quickstart_makes_a_metered_streaming_request() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "demo", "--once", "--port", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert generated_text(64) in proc.stdout
    assert 'tokenmeter_tokens_total{model="mock-gpt",source="reported",type="output"' in proc.stdout
    lines = [json.loads(x) for x in proc.stderr.splitlines() if x.startswith("{")]
    (access,) = [x for x in lines if x.get("event") == "request"]
    assert access["output_tokens"] == 64 and access["token_source"] == "reported"
    assert access["stream"] is True and access["ttft_ms"] > 0
    assert any("OPEN" in x.get("message", "") for x in lines)  # says loudly it is open


async def test_usage_reads_the_books_a_served_proxy_kept(
    upstream: TestServer, tmp_path: Path
) -> None:
    """Zero set-up: `serve --upstream` keeps books in the state directory's SQLite file, and
    `usage` reads them from there (both find it through $TOKENMETER_STATE_DIR)."""
    proxy = ServedProxy(None, tmp_path / "proxy.log",
                        ("--upstream", str(upstream.make_url("/v1")), "--log-level", "WARNING"))
    try:
        await proxy.started()
        client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="unused",
                                    max_retries=0)
        for _ in range(2):
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    finally:
        code = await proxy.stopped()  # SIGTERM drains: the shipper writes what is spooled
    assert code == 0, proxy.log_text()

    def usage(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "proxy.cli", "usage", *args],
                              capture_output=True, text=True, timeout=60, check=False)

    done = await asyncio.to_thread(usage, "--format", "csv", "--by", "user,model")
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert [(r["user"], r["model"], r["requests"]) for r in rows] == [
        ("default", "mock-gpt", "2"), ("total", "", "2")]
    assert int(rows[-1]["total_tokens"]) > 0
    done = await asyncio.to_thread(usage, "--help")
    assert "--source store" in done.stdout and "--to D includes all of day D" in done.stdout
