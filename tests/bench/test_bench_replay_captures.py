"""`tokenmeter bench --replay-captures`: traffic captured through a served proxy (the openai SDK
as the client, an SQLite capture store) replayed from the store, chosen by the filters of
`tokenmeter captures list`, against a second simulated upstream that records what arrived."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.capture.store import CaptureFilter, CaptureStore
from proxy.server.app import create_app
from proxy.testing.mock_upstream import MOCK_STATE, MockSettings, create_mock_app
from tests.helpers import ServerFactory, make_config, until

ALICE = "sk-alice-replay-cap-0001"
BOB = "sk-bob-replay-cap-00002"


async def _bench(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "bench", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _captured(url: str, count: int) -> None:
    store = await CaptureStore.open(url)
    try:
        async def all_there() -> bool:
            return len(await store.list(CaptureFilter())) >= count

        await until(all_there, deadline=20)
    finally:
        await store.close()


@pytest.mark.timeout(120)
async def test_captured_traffic_is_replayed_from_the_store_with_the_list_filters(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path,
) -> None:
    url = f"sqlite://{tmp_path / 'captures.sqlite3'}"
    config = make_config(
        str(upstream.make_url("/v1")),
        users={"alice": {"keys": [ALICE]}, "bob": {"keys": [BOB]}},
        extra={"capture": {"enabled": True, "sample": 1.0, "url": url}},
    )
    proxy = await aiohttp_server(create_app(config))
    base = str(proxy.make_url("/v1"))
    alice = openai.AsyncOpenAI(base_url=base, api_key=ALICE, max_retries=0)
    bob = openai.AsyncOpenAI(base_url=base, api_key=BOB, max_retries=0)
    await alice.chat.completions.create(
        model="mock-gpt", messages=[{"role": "user", "content": "alice asks, as JSON"}],
        max_tokens=7, temperature=0.25)
    stream = await alice.chat.completions.create(
        model="mock-gpt", messages=[{"role": "user", "content": "alice asks, streamed"}],
        max_tokens=9, stream=True)
    async for _ in stream:
        pass
    await bob.chat.completions.create(
        model="mock-gpt", messages=[{"role": "user", "content": "bob asks"}], max_tokens=5)
    await _captured(url, 3)

    target = await aiohttp_server(create_mock_app(
        MockSettings(tokens_per_second=0, ttft_ms=0, output_tokens=4)))
    code, _, err = await _bench(
        "--base-url", str(target.make_url("/v1")), "--replay-captures", "--url", url,
        "--user", "alice", "--captured-model", "mock-gpt", "--json", str(tmp_path / "r.json"))
    assert code == 0, err
    arrived = [r.body for r in target.app[MOCK_STATE].requests
               if r.path == "/v1/chat/completions" and r.body is not None]
    # Alice's two requests (not Bob's), oldest first, each with its own parameters.
    assert [b["messages"][0]["content"] for b in arrived] == [
        "alice asks, as JSON", "alice asks, streamed"]
    assert (arrived[0]["max_tokens"], arrived[0]["temperature"]) == (7, 0.25)
    assert arrived[1]["stream"] is True and arrived[1]["max_tokens"] == 9
    report: dict[str, Any] = json.loads((tmp_path / "r.json").read_text())
    assert report["replay"]["file"] == f"captures in {url}"
    # Both sent as captured, both answered as recorded (200, no error), nothing skipped.
    outcomes = report["replay"]["outcomes"]
    assert [(s["same"], s["of"]) for s in outcomes["same_as_recorded"]] == [(2, 2)]
    assert [r["recorded"] for r in outcomes["per_request"]] == [
        {"status": 200, "error_class": None}] * 2
    assert (report["replay"]["lines"], report["replay"]["skipped"]["total"]) == (2, 0)

    # A filter that chooses nothing is a usage error, named as such.
    code, _, err = await _bench(
        "--base-url", str(target.make_url("/v1")), "--replay-captures", "--url", url,
        "--user", "carol")
    assert code == 2 and "no recorded request" in err
    # The filters without --replay-captures are refused.
    code, _, err = await _bench("--base-url", "http://127.0.0.1:1/v1", "--model", "m",
                                "--user", "alice")
    assert code == 2 and "--user applies to --replay-captures only" in err
