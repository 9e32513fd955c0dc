"""Capture through the whole proxy, with the openai SDK as the client and a real capture store
(an SQLite file, read back by `tokenmeter captures show` in a process of its own)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.capture.record import Body, Capture
from proxy.capture.store import CaptureStore
from proxy.capture.writer import CaptureWriter
from proxy.config.load import load_config
from proxy.pipeline import services as st
from proxy.server.app import create_app
from proxy.telemetry.metrics import Metrics
from tests.helpers import (
    ServerFactory,
    budget_yaml,
    make_config,
    sample,
    scrape,
    tokenmeter,
    until,
)

ALICE = "sk-alice-capture-0001"
BOB = "sk-bob-never-capture-01"
SECRET = "sk-proj-Zx9Qw8Er7Ty6Ui5Op4As3Df2"  # key-shaped text a user pasted into a prompt


async def _proxy(aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path,
                 capture: dict[str, Any]) -> tuple[TestServer, str]:
    url = f"sqlite://{tmp_path / 'captures.sqlite3'}"
    config = make_config(
        str(upstream.make_url("/v1")),
        users={"alice": {"keys": [ALICE]}, "bob": {"keys": [BOB], "capture": False}},
        extra={"capture": {"enabled": True, "url": url, **capture}},
    )
    return await aiohttp_server(create_app(config)), url


async def _stored(url: str, request_id: str) -> Capture:
    store = await CaptureStore.open(url)
    try:
        async def there() -> bool:
            return await store.get(request_id) is not None

        await until(there, deadline=20)
        found = await store.get(request_id)
        assert found is not None
        return found
    finally:
        await store.close()


def _show(url: str, request_id: str) -> dict[str, Any]:
    done = tokenmeter("captures", "show", request_id, "--format", "json", "--url", url)
    assert done.returncode == 0, done.stderr
    shown: dict[str, Any] = json.loads(done.stdout)
    return shown


@pytest.mark.timeout(90)
async def test_a_refused_request_is_shown_exactly_as_sent_with_the_upstream_error(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path
) -> None:
    proxy, url = await _proxy(aiohttp_server, upstream, tmp_path, {"sample": 0.0})
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=ALICE,
                                max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=[{"role": "user", "content": "ok"}], max_tokens=5,
    )  # sample 0: a success is not captured
    kept = raw.headers["x-tokenmeter-request-id"]
    sent: dict[str, Any] = {}
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model="mock-gpt", messages=[{"role": "user", "content": "a very long prompt"}],
            max_tokens=7, temperature=0.5,
            extra_headers={"x-mock-status": "400", "x-mock-error-code": "context_length_exceeded"},
        )
    request_id = refused.value.response.headers["x-tokenmeter-request-id"]
    sent = json.loads(refused.value.response.request.content)
    capture = await _stored(url, request_id)
    shown = await asyncio.to_thread(_show, url, request_id)
    # Byte-exact: what the SDK put on the wire is what `captures show` gives back.
    assert shown["request"]["text"] == refused.value.response.request.content.decode()
    assert json.loads(shown["request"]["text"]) == sent
    assert capture.status == 400 and capture.error_class == "context_length"
    assert capture.upstream_error is not None
    assert "maximum context length" in capture.upstream_error.text
    assert capture.upstream_request is not None
    assert json.loads(capture.upstream_request.text)["max_tokens"] == 7
    assert shown["ledger"] is None or shown["ledger"]["input_tokens"] >= 0
    store = await CaptureStore.open(url)
    try:
        assert await store.get(kept) is None
    finally:
        await store.close()


@pytest.mark.timeout(90)
async def test_a_stream_is_reassembled_as_the_sdk_saw_it_and_secrets_never_reach_disk(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path
) -> None:
    proxy, url = await _proxy(aiohttp_server, upstream, tmp_path, {"sample": 1.0})
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=ALICE,
                                max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", stream=True, max_tokens=40,
        messages=[{"role": "user", "content": f"my key is {SECRET}, keep it"}],
    )
    request_id = raw.headers["x-tokenmeter-request-id"]
    text = ""
    async for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    capture = await _stored(url, request_id)
    assert capture.stream and capture.output_text == text and text
    assert capture.events and capture.events[-1].text == "data: [DONE]"
    assert [e.at_ms for e in capture.events] == sorted(e.at_ms for e in capture.events)
    assert "[REDACTED]" in capture.request.text
    # The file itself: the secret was redacted before anything was written (compressed rows
    # included: decompress every row and look).
    await proxy.close()
    database = Path(url.removeprefix("sqlite://"))
    for path in database.parent.glob(database.name + "*"):
        assert SECRET.encode() not in path.read_bytes()
    dump = json.dumps(capture.to_json())
    assert SECRET not in dump


@pytest.mark.timeout(90)
async def test_a_never_capture_user_leaves_nothing_and_a_dead_store_fails_no_request(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path
) -> None:
    proxy, _ = await _proxy(aiohttp_server, upstream, tmp_path, {"sample": 1.0})
    bob = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=BOB, max_retries=0)
    done = await bob.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    bob_id = done.headers["x-tokenmeter-request-id"]
    # A store that cannot be opened (its directory is a file): requests are served, the
    # captures dropped and counted.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    dead = make_config(str(upstream.make_url("/v1")), users={"alice": {"keys": [ALICE]}},
                       extra={"capture": {"enabled": True, "sample": 1.0,
                                          "url": f"sqlite://{blocker / 'c.sqlite3'}"}})
    broken = await aiohttp_server(create_app(dead))
    alice = openai.AsyncOpenAI(base_url=str(broken.make_url("/v1")), api_key=ALICE,
                               max_retries=0)
    for _ in range(3):
        answer = await alice.chat.completions.create(
            model="mock-gpt", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert answer.choices[0].message.content

    async def dropped() -> bool:
        return sample(await scrape(broken), "tokenmeter_captures_dropped_total",
                      reason="store") == 3

    await until(dropped, deadline=20)
    await proxy.close()
    store = await CaptureStore.open(f"sqlite://{tmp_path / 'captures.sqlite3'}")
    try:
        assert await store.get(bob_id) is None
    finally:
        await store.close()
    assert proxy.app[st.SERVICES].capture is not None


@pytest.mark.timeout(60)
async def test_retention_deletes_what_is_older_than_its_days_and_keeps_the_rest(
    store_url: str,
) -> None:
    """The writer's retention run on a real store of either kind: captures older than
    capture.retention_days go, the others stay; with capture off it does nothing."""
    now = time.time()
    base = Capture(request_id="-", started_at=now, api="openai", path="/v1/chat/completions",
                   operation="chat", user="alice", key_name=None, team=None,
                   requested_model="m", model="m", stream=False, status=200,
                   error_class="none", request=Body("{}", 2), upstream_request=None,
                   response=None)
    store = await CaptureStore.open(store_url)
    await store.write([replace(base, request_id="old", started_at=now - 9 * 86400),
                       replace(base, request_id="new", started_at=now - 86400)])
    enabled = [False]

    async def opened() -> CaptureStore:
        return store

    writer = CaptureWriter(opened, Metrics(), 10, lambda: (enabled[0], 7))
    try:
        assert await writer.retain() == 0  # off, and nothing opened: nothing touched
        assert await store.get("old") is not None
        enabled[0] = True
        assert await writer.retain() == 1
        assert await store.get("old") is None and await store.get("new") is not None
    finally:
        await writer.stop(drain_s=1)  # closes the store it opened


@pytest.mark.timeout(90)
async def test_an_anthropic_stream_is_reassembled_as_the_sdk_saw_it(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path
) -> None:
    url = f"sqlite://{tmp_path / 'captures.sqlite3'}"
    config = make_config(
        str(upstream.make_url("/v1")), api="anthropic", users={"alice": {"keys": [ALICE]}},
        extra={"capture": {"enabled": True, "url": url, "sample": 1.0}},
    )
    proxy = await aiohttp_server(create_app(config))
    client = anthropic.AsyncAnthropic(base_url=str(proxy.make_url("")).rstrip("/"),
                                      api_key=ALICE, max_retries=0)
    async with client.messages.stream(
        model="claude-test", max_tokens=32, messages=[{"role": "user", "content": "hi"}],
    ) as stream:
        text = await stream.get_final_text()
        request_id = stream.response.headers["x-tokenmeter-request-id"]
    capture = await _stored(url, request_id)
    assert (capture.api, capture.path, capture.operation) == ("anthropic", "/v1/messages",
                                                              "messages")
    assert capture.output_text == text and text
    assert json.loads(capture.request.text)["max_tokens"] == 32


@pytest.mark.timeout(90)
async def test_a_reload_turns_capture_on_without_a_restart(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path
) -> None:
    """Off at start (nothing kept, no table made), on after the file changes: the next request
    is captured by the same process."""
    url = f"sqlite://{tmp_path / 'captures.sqlite3'}"
    path = tmp_path / "tm.yaml"
    users = f'  alice:\n    keys: ["{ALICE}"]\n'
    base = budget_yaml(str(upstream.make_url("/v1")), "memory", users)
    path.write_text(base + f"capture: {{enabled: false, sample: 1.0, url: '{url}'}}\n")
    proxy = await aiohttp_server(create_app(load_config(path), config_path=path))
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=ALICE,
                                max_retries=0)

    async def ask() -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model="mock-gpt", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        return raw.headers["x-tokenmeter-request-id"]

    await ask()
    assert not Path(url.removeprefix("sqlite://")).exists()  # off: not even the table
    path.write_text(base + f"capture: {{enabled: true, sample: 1.0, url: '{url}'}}\n")
    await until(lambda: proxy.app[st.SERVICES].runtime.current.config.capture.enabled,
                deadline=10)
    captured = await _stored(url, await ask())
    assert captured.status == 200


@pytest.mark.timeout(60)
async def test_a_capture_carries_the_requests_tags(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path
) -> None:
    url = f"sqlite://{tmp_path / 'captures.sqlite3'}"
    config = make_config(
        str(upstream.make_url("/v1")),
        users={"alice": {"keys": [ALICE], "tags": {"env": "prod"}}},
        extra={"capture": {"enabled": True, "url": url, "sample": 1.0},
               "tags": {"env": {"values": ["prod"]}, "feature": {"free": True}}},
    )
    proxy = await aiohttp_server(create_app(config))
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=ALICE,
                                max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=[{"role": "user", "content": "ok"}], max_tokens=5,
        extra_headers={"x-tokenmeter-tags": "feature=faq"})
    await client.close()
    captured = await _stored(url, raw.headers["x-tokenmeter-request-id"])
    assert captured.tags == {"env": "prod", "feature": "faq"}
    assert Capture.from_json(captured.to_json()).tags == captured.tags
    older = captured.to_json()
    del older["tags"]  # a capture written before tags existed
    assert Capture.from_json(older).tags == {}


@pytest.mark.timeout(60)
async def test_retention_runs_when_the_writer_starts(store_url: str) -> None:
    """A replica restarted more often than the retention period still deletes: the writer's
    first retention run is at its start, not a period later (real store of either kind)."""
    now = time.time()
    base = Capture(request_id="-", started_at=now, api="openai", path="/v1/chat/completions",
                   operation="chat", user="alice", key_name=None, team=None,
                   requested_model="m", model="m", stream=False, status=200,
                   error_class="none", request=Body("{}", 2), upstream_request=None,
                   response=None)
    store = await CaptureStore.open(store_url)
    await store.write([replace(base, request_id="old", started_at=now - 9 * 86400),
                       replace(base, request_id="new", started_at=now - 86400)])
    writer = CaptureWriter(lambda: CaptureStore.open(store_url), Metrics(), 10,
                           lambda: (True, 7))
    writer.start()
    try:
        async def gone() -> bool:
            return await store.get("old") is None

        await until(gone, deadline=30)
        assert await store.get("new") is not None
    finally:
        await writer.stop(drain_s=1)
        await store.close()
