"""Tags and the cost in the answer, end to end: the real openai and anthropic SDKs (Python and
Node) as clients, the ledger (SQLite) the proxy writes, `tokenmeter usage --by tag:...` and the
proxy's /metrics.

- A JSON answer's `x-tokenmeter-cost-usd` and token headers are its ledger row's figures; a
  stream ends with `: tokenmeter cost_usd=... input_tokens=...`, the same figures, and every SDK
  reads the stream as it reads it without the comment (the same events, text and usage).
- Tags from `x-tokenmeter-tags` and an OpenAI body's `metadata` (the header wins per key) over
  a key's and a user's defaults reach the ledger row; what the rules refuse is dropped and
  counted; a closed-list tag is a Prometheus label, a free one never is.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
from contextlib import closing
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest

from proxy.cli import main
from proxy.config.load import Config
from proxy.ledger.schema import TABLE
from proxy.pipeline.relay import REQUEST_ID_HEADER
from proxy.testing.mock_upstream import MockSettings
from tests.helpers import (
    ALICE_KEY,
    BOB_KEY,
    FAST_RETRY,
    MESSAGES,
    Stack,
    StackFactory,
    sample,
    until,
)

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
# USD per million tokens, with cache prices of their own (Anthropic's shape).
PRICE = {"input": 3.0, "output": 15.0, "cached_input": 0.30, "cache_write_5m": 3.75,
         "cache_write_1h": 6.0}
# The mock reports these cache tokens of a Messages request (reads 40, writes 30).
CACHE = {"x-mock-cache-read-tokens": "40", "x-mock-cache-creation-tokens": "30"}
TAG_RULES = {"feature": {"values": ["faq", "search", "agent"]},
             "env": {"values": ["prod", "staging"]},
             "customer": {"free": True, "max_length": 16}}


@pytest.fixture
def mock_settings() -> MockSettings:
    return MockSettings(tokens_per_second=0, ttft_ms=0, output_tokens=12)


def config(upstream_url: str, **extra: Any) -> Config:
    """An OpenAI-shaped upstream for `mock-*` and an Anthropic-shaped one for `claude-*` (the
    same mock serves both), priced; alice (key default `env: prod`) and bob."""
    data: dict[str, Any] = {
        "upstreams": {
            "mock": {"base_url": upstream_url, "retry": dict(FAST_RETRY)},
            "claude": {"base_url": upstream_url, "retry": dict(FAST_RETRY), "api": "anthropic"},
        },
        "models": [{"match": "claude-*", "upstream": "claude"},
                   {"match": "*", "upstream": "mock"}],
        "metrics": {"model_labels": ["mock-gpt"], "discover_models": False},
        "prices": {"*": PRICE},
        "tags": TAG_RULES,
        "users": {
            "alice": {"tags": {"feature": "agent", "customer": "acme"},
                      "keys": [{"key": ALICE_KEY, "name": "ci", "tags": {"env": "prod"}}]},
            "bob": {"keys": [BOB_KEY]},
        },
        **extra,
    }
    return Config.model_validate(data)


@pytest.fixture
async def tagged(make_stack: StackFactory, upstream: Any) -> Stack:
    return await make_stack(config(str(upstream.make_url("/v1"))))


def _ledger() -> Path:
    return Path(os.environ["TOKENMETER_STATE_DIR"]) / "ledger.sqlite3"


async def ledger_row(request_id: str) -> dict[str, Any]:
    """The request's ledger row, once the proxy's shipper has written it."""
    query = f"SELECT * FROM {TABLE} WHERE request_id = ?"

    def row() -> dict[str, Any] | None:
        if not _ledger().exists():
            return None
        with closing(sqlite3.connect(f"file:{_ledger()}?mode=ro", uri=True)) as db:
            db.row_factory = sqlite3.Row
            try:
                found = db.execute(query, (request_id,)).fetchone()
            except sqlite3.OperationalError:  # the table is not there yet
                return None
        return None if found is None else dict(found)

    await until(lambda: row() is not None, deadline=20, every=0.05)
    found = row()
    assert found is not None
    return found


def usd(row: dict[str, Any]) -> str:
    """The row's cost as the proxy writes it in an answer: nine decimals, exact."""
    return f"{Decimal(row['cost_nanousd']).scaleb(-9):f}"


def comment(raw: bytes) -> dict[str, str]:
    """The figures of the stream's closing comment line, which must be its last line."""
    lines = raw.decode().rstrip("\n").split("\n")
    last = lines[-1]
    assert last.startswith(": tokenmeter "), raw[-300:]
    assert sum(1 for line in lines if line.startswith(": tokenmeter")) == 1
    return dict(pair.split("=", 1) for pair in last.removeprefix(": tokenmeter ").split())


async def raw_post(stack: Stack, path: str, body: dict[str, Any],
                   headers: dict[str, str]) -> tuple[bytes, str]:
    """A request over plain HTTP: the answer's bytes as the client gets them, and its id."""
    async with aiohttp.ClientSession() as s, s.post(
        stack.proxy.make_url(path), json=body, headers=headers,
        timeout=aiohttp.ClientTimeout(total=20),
    ) as r:
        assert r.status == 200
        return await r.read(), r.headers[REQUEST_ID_HEADER]


# --- JSON answers -------------------------------------------------------------------------------


async def test_json_answer_carries_the_ledger_rows_cost_and_tags(tagged: Stack) -> None:
    client = tagged.client(ALICE_KEY)
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=MESSAGES,
        # metadata says search and staging; the header says faq: the header wins per key,
        # metadata's env stands over the key's default, the user's customer stays.
        metadata={"feature": "search", "env": "staging"},
        extra_headers={"x-tokenmeter-tags": "feature=faq"},
    )
    answer = raw.parse()
    assert answer.usage is not None
    row = await ledger_row(raw.headers[REQUEST_ID_HEADER])
    assert raw.headers["x-tokenmeter-cost-usd"] == usd(row)
    assert int(row["cost_nanousd"]) > 0
    assert raw.headers["x-tokenmeter-input-tokens"] == str(row["input_tokens"])
    assert raw.headers["x-tokenmeter-output-tokens"] == str(row["output_tokens"])
    assert row["output_tokens"] == answer.usage.completion_tokens
    assert "x-tokenmeter-cached-input-tokens" not in raw.headers  # none were cached
    assert json.loads(row["tags"]) == {"customer": "acme", "env": "staging", "feature": "faq"}
    assert row["tags"] == '{"customer":"acme","env":"staging","feature":"faq"}'  # canonical
    # The body's metadata went upstream untouched.
    sent = tagged.mock.requests[-1].body
    assert sent is not None and sent["metadata"] == {"feature": "search", "env": "staging"}
    assert "x-tokenmeter-tags" not in tagged.mock.requests[-1].headers  # the proxy's own


async def test_cost_headers_can_be_turned_off(make_stack: StackFactory, upstream: Any) -> None:
    stack = await make_stack(config(str(upstream.make_url("/v1")),
                                    cost_headers={"json_answers": False, "streams": False}))
    raw = await stack.client(BOB_KEY).chat.completions.with_raw_response.create(
        model="mock-gpt", messages=MESSAGES)
    assert "x-tokenmeter-cost-usd" not in raw.headers
    body, _ = await raw_post(stack, "/v1/chat/completions",
                             {"model": "mock-gpt", "messages": MESSAGES, "stream": True},
                             {"Authorization": f"Bearer {BOB_KEY}"})
    assert b": tokenmeter" not in body
    assert body.rstrip().endswith(b"data: [DONE]")


# --- streams ------------------------------------------------------------------------------------


async def test_openai_stream_ends_with_the_ledger_rows_figures(tagged: Stack) -> None:
    body = {"model": "mock-gpt", "messages": MESSAGES, "stream": True,
            "stream_options": {"include_usage": True}}
    raw, request_id = await raw_post(tagged, "/v1/chat/completions", body,
                                     {"Authorization": f"Bearer {BOB_KEY}"})
    row = await ledger_row(request_id)
    figures = comment(raw)
    assert figures == {"cost_usd": usd(row), "input_tokens": str(row["input_tokens"]),
                       "output_tokens": str(row["output_tokens"])}
    # After `[DONE]`, the stream's last event: every SDK has its whole answer by then.
    events = raw.decode().split("\n\n")
    assert events[-3] == "data: [DONE]" and events[-2].startswith(": tokenmeter")

    # The Python SDK reads the stream as it reads it without the comment: the same chunks,
    # text and usage as the stream the proxy relayed.
    data = [e.removeprefix("data: ") for e in events if e.startswith("data: {")]
    chunks = await tagged.client(BOB_KEY).chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True})
    got = [chunk async for chunk in chunks]
    assert len(got) == len(data)
    assert got[-1].usage is not None
    assert got[-1].usage.completion_tokens == row["output_tokens"]
    text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
    assert text == "".join(json.loads(d)["choices"][0]["delta"].get("content") or ""
                           for d in data if json.loads(d)["choices"])


async def test_messages_stream_with_cache_tokens(tagged: Stack) -> None:
    """A Messages stream whose upstream reports cache reads and writes: the comment names
    them, and the cost is the row's, cache prices included, to the nano-dollar."""
    body = {"model": "claude-x", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "count to three"}]}
    headers = {"x-api-key": ALICE_KEY, "anthropic-version": "2023-06-01",
               "x-tokenmeter-tags": "feature=search", **CACHE}
    raw, request_id = await raw_post(tagged, "/v1/messages", body, headers)
    row = await ledger_row(request_id)
    assert row["cache_creation_input_tokens"] == 30 and row["cached_input_tokens"] == 40
    assert comment(raw) == {
        "cost_usd": usd(row), "input_tokens": str(row["input_tokens"]),
        "output_tokens": str(row["output_tokens"]), "cached_input_tokens": "40",
        "cache_creation_input_tokens": "30"}
    assert json.loads(row["tags"]) == {"customer": "acme", "env": "prod", "feature": "search"}

    client = anthropic.AsyncAnthropic(base_url=str(tagged.proxy.make_url("")).rstrip("/"),
                                      api_key=ALICE_KEY, max_retries=0)
    try:
        async with client.messages.stream(
            model="claude-x", max_tokens=64, extra_headers=CACHE,
            messages=[{"role": "user", "content": "count to three"}],
        ) as stream:
            events = [event.type async for event in stream]
            message = await stream.get_final_message()
    finally:
        await client.close()
    assert events[-1] == "message_stop"
    assert message.usage.cache_read_input_tokens == 40
    assert message.usage.cache_creation_input_tokens == 30
    assert message.usage.output_tokens == row["output_tokens"]


async def _node(*args: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        "node", str(NODE_DIR / "stream.mjs"), *args, cwd=NODE_DIR,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    # tests/node/node_modules comes from `npm ci --prefix tests/node` (.ci/run does it).
    assert proc.returncode == 0, err.decode()[-2000:]
    result: dict[str, Any] = json.loads(out)
    return result


async def test_node_sdks_read_the_stream_unchanged(tagged: Stack) -> None:
    """The openai and anthropic Node SDKs (tests/node, pinned) read a stream ending with the
    comment: the same events, text and usage as the Python SDKs read."""
    base = str(tagged.proxy.make_url("/v1"))
    node = await _node("openai", base, BOB_KEY, "mock-gpt")
    chunks = await tagged.client(BOB_KEY).chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True})
    got = [chunk async for chunk in chunks]
    assert node["events"] == len(got)
    assert node["text"] == "".join(c.choices[0].delta.content or "" for c in got if c.choices)
    assert got[-1].usage is not None
    assert node["usage"]["completion_tokens"] == got[-1].usage.completion_tokens

    root = str(tagged.proxy.make_url("")).rstrip("/")
    message = await _node("anthropic", root, ALICE_KEY, "claude-x", json.dumps(CACHE))
    assert message["text"]
    assert message["events"] >= 4  # message_start ... message_stop, nothing dropped or added
    assert message["usage"]["cache_read_input_tokens"] == 40
    assert message["usage"]["cache_creation_input_tokens"] == 30


# --- tags into the books and the metrics ----------------------------------------------------


async def test_usage_by_tag_sums_the_rows(tagged: Stack,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    client = tagged.client(BOB_KEY)
    asked = [("feature=faq,env=prod", "faq"), ("feature=faq", "faq"),
             ("feature=search, env=staging", "search"), ("env=prod", None),
             ("feature=unknown", None), ("colour=red,feature=agent", "agent")]
    ids = []
    for header, _ in asked:
        raw = await client.chat.completions.with_raw_response.create(
            model="mock-gpt", messages=MESSAGES,
            extra_headers={"x-tokenmeter-tags": header})
        ids.append(raw.headers[REQUEST_ID_HEADER])
    rows = [await ledger_row(i) for i in ids]
    want: dict[str | None, list[int]] = {}
    for (_, feature), row in zip(asked, rows, strict=True):
        sums = want.setdefault(feature, [0, 0, 0, 0])
        for i, col in enumerate(("input_tokens", "output_tokens", "cost_nanousd")):
            sums[i] += int(row[col])
        sums[3] += 1
    # `usage` runs its own event loop: in a thread, beside this test's.
    assert await asyncio.to_thread(main, [
        "usage", "--ledger", f"sqlite://{_ledger()}", "--timezone", "UTC",
        "--by", "tag:feature", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["by"] == ["tag:feature"]
    got = {r["tag:feature"]: [r["input_tokens"], r["output_tokens"], r["cost_nanousd"],
                              r["requests"]] for r in doc["rows"]}
    assert got == want
    assert doc["totals"]["cost_nanousd"] == sum(int(r["cost_nanousd"]) for r in rows)
    # Grouped by two tags, as CSV: the rows without a tag are an empty cell.
    assert await asyncio.to_thread(main, [
        "usage", "--ledger", f"sqlite://{_ledger()}", "--timezone", "UTC",
        "--by", "tag:feature,tag:env", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tag:feature,tag:env,requests")
    assert any(line.startswith("faq,prod,1,") for line in lines)
    assert any(line.startswith(",prod,1,") for line in lines)
    # The unknown value and the undeclared key were dropped and counted.
    metrics = await tagged.metrics()
    assert sample(metrics, "tokenmeter_tags_dropped_total", reason="not_listed") == 1
    assert sample(metrics, "tokenmeter_tags_dropped_total", reason="undeclared") == 1


async def test_closed_list_tags_are_labels_free_ones_never(tagged: Stack) -> None:
    client = tagged.client(ALICE_KEY)  # alice's defaults: feature=agent, customer=acme (free)
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=MESSAGES,
        extra_headers={"x-tokenmeter-tags": "customer=globex"})
    row = await ledger_row(raw.headers[REQUEST_ID_HEADER])
    assert json.loads(row["tags"])["customer"] == "globex"
    metrics = await tagged.metrics()
    assert sample(metrics, "tokenmeter_tag_tokens_total", tag="feature", value="agent",
                  type="output") == row["output_tokens"]
    assert sample(metrics, "tokenmeter_tag_tokens_total", tag="env", value="prod",
                  type="input") == row["input_tokens"]
    assert sample(metrics, "tokenmeter_tag_cost_usd_total", tag="feature",
                  value="agent") == pytest.approx(int(row["cost_nanousd"]) / 1e9)
    free = [key for key in metrics if key[0].startswith("tokenmeter_tag_")
            and ("tag", "customer") in key[1]]
    assert free == []
    assert not any("globex" in str(key) for key in metrics)


async def test_responses_stream_ends_with_the_comment_the_sdk_skips(tagged: Stack) -> None:
    """The Responses API's named events: the comment follows `response.completed`, and the
    Python SDK's typed stream reads every event as the proxy relayed it."""
    body = {"model": "mock-gpt", "input": "count to three", "stream": True}
    raw, request_id = await raw_post(tagged, "/v1/responses", body,
                                     {"Authorization": f"Bearer {BOB_KEY}"})
    row = await ledger_row(request_id)
    assert comment(raw)["output_tokens"] == str(row["output_tokens"])
    relayed_events = [e for e in raw.decode().split("\n\n") if e.startswith("event: ")]
    stream = await tagged.client(BOB_KEY).responses.create(
        model="mock-gpt", input="count to three", stream=True)
    types = [event.type async for event in stream]
    assert types[-1] == "response.completed"
    assert len(types) == len(relayed_events)


async def test_hostile_tag_headers_never_fail_a_request(tagged: Stack) -> None:
    """Undecodable bytes, a huge header and junk (control characters aiohttp refuses itself,
    before any handler): the request is answered and booked, the tags the rules accept kept,
    the rest counted."""
    body = json.dumps({"model": "mock-gpt", "messages": MESSAGES}).encode()
    ids = []
    for tags in (b"customer=\xff\xfe,feature=faq", b"feature=faq," + b"x" * 5000,
                 b"=,==,feature,customer="):
        reader, writer = await asyncio.open_connection(tagged.proxy.host, tagged.proxy.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + BOB_KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     b"x-tokenmeter-tags: " + tags + b"\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        async with asyncio.timeout(20):
            answer = await reader.read()
        writer.close()
        head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1")
        assert head.startswith("HTTP/1.1 200"), head
        ids.append(next(line.split(": ", 1)[1] for line in head.split("\r\n")
                        if line.lower().startswith(REQUEST_ID_HEADER)))
    rows = [await ledger_row(i) for i in ids]
    assert [json.loads(r["tags"]) for r in rows] == [{"feature": "faq"}, {}, {}]
    metrics = await tagged.metrics()
    # The undecodable value, `feature` without a value and `customer=` with an empty one.
    assert sample(metrics, "tokenmeter_tags_dropped_total", reason="malformed") == 3
    assert sample(metrics, "tokenmeter_tags_dropped_total", reason="undeclared") == 2  # `=`
    assert sample(metrics, "tokenmeter_tags_dropped_total", reason="header_too_long") == 1


# --- issue 31, item 10: the upstream cannot write the proxy's own word ---------------------------

# What a hostile (or confused) upstream adds to every answer: the proxy's own headers, and in a
# stream its cost comment, one before the last event (cut across two writes) and one after it.
FORGED_HEADERS = {"x-tokenmeter-cost-usd": "0.000000000", "x-tokenmeter-cache": "hit",
                  "x-tokenmeter-input-tokens": "1", "x-tokenmeter-output-tokens": "1",
                  "X-Tokenmeter-Model": "forged", "x-tokenmeter-request-id": "forged"}
FORGED_COMMENT = b": tokenmeter cost_usd=0.000000000 input_tokens=0 output_tokens=0\n\n"


async def _forging_upstream(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
    """An OpenAI-shaped upstream written out by hand (it shares nothing with the proxy)."""
    body = await request.json()
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    base = {"id": "c1", "created": 1, "model": body["model"]}
    if not body.get("stream"):
        return aiohttp.web.json_response({
            **base, "object": "chat.completion", "usage": usage,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "one two three"}}],
        }, headers=FORGED_HEADERS)
    resp = aiohttp.web.StreamResponse(headers={**FORGED_HEADERS,
                                               "Content-Type": "text/event-stream"})
    await resp.prepare(request)

    def event(choices: list[Any], **more: Any) -> bytes:
        chunk = {**base, "object": "chat.completion.chunk", "choices": choices, **more}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    for word in ("one", " two", " three"):
        await resp.write(event([{"index": 0, "delta": {"content": word},
                                 "finish_reason": None}]))
    await resp.write(event([{"index": 0, "delta": {}, "finish_reason": "stop"}]))
    await resp.write(FORGED_COMMENT[:7])
    await resp.write(FORGED_COMMENT[7:])
    await resp.write(event([], usage=usage) + b"data: [DONE]\n\n" + FORGED_COMMENT)
    return resp


@pytest.fixture
async def forged(make_stack: StackFactory, aiohttp_server: Any) -> Stack:
    app = aiohttp.web.Application()
    app.router.add_post("/v1/chat/completions", _forging_upstream)
    up = await aiohttp_server(app)
    cfg = config(str(up.make_url("/v1"))).model_dump()
    cfg["prices"] = {"priced-*": PRICE}  # `free-model` has no price: no cost, tokens only
    return await make_stack(Config.model_validate(cfg))


@pytest.mark.parametrize("model", ["priced-model", "free-model"])
async def test_the_upstreams_own_headers_and_comment_never_reach_the_client(
    forged: Stack, model: str,
) -> None:
    """The upstream's `x-tokenmeter-*` headers (a cost of 0, a cache hit, tokens) and its
    `: tokenmeter` comment lines used to reach the client, the comment before the proxy's own;
    now every figure the client reads is the ledger row's, on JSON answers and streams, priced
    models and unpriced."""
    client = forged.client(BOB_KEY)
    raw = await client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES)
    assert raw.parse().choices[0].message.content == "one two three"
    row = await ledger_row(raw.headers[REQUEST_ID_HEADER])
    assert raw.headers[REQUEST_ID_HEADER] != "forged"
    assert raw.headers["x-tokenmeter-model"] == model
    assert "x-tokenmeter-cache" not in raw.headers  # the cache is off: it says nothing
    assert raw.headers["x-tokenmeter-input-tokens"] == str(row["input_tokens"]) == "7"
    assert raw.headers["x-tokenmeter-output-tokens"] == str(row["output_tokens"]) == "3"
    if model == "priced-model":
        assert raw.headers["x-tokenmeter-cost-usd"] == usd(row) != "0.000000000"
    else:
        assert "x-tokenmeter-cost-usd" not in raw.headers
    for name in FORGED_HEADERS:  # each once at most: the proxy's, never a second line
        assert len(raw.headers.get_list(name)) <= 1, name

    # A stream, through the SDK (its raw headers) and read raw.
    raw_stream = await client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, stream=True)
    assert not [n for n in raw_stream.headers if n.lower().startswith("x-tokenmeter-")
                and n.lower() not in ("x-tokenmeter-request-id", "x-tokenmeter-model")]
    assert raw_stream.headers[REQUEST_ID_HEADER] != "forged"
    text = "".join([c.choices[0].delta.content or "" async for c in raw_stream.parse()
                    if c.choices])
    assert text == "one two three"
    body, request_id = await raw_post(forged, "/v1/chat/completions",
                                      {"model": model, "messages": MESSAGES, "stream": True},
                                      {"Authorization": f"Bearer {BOB_KEY}"})
    row = await ledger_row(request_id)
    assert b"0.000000000" not in body
    figures = comment(body)  # the one comment line, the proxy's, last
    expected = {"input_tokens": "7", "output_tokens": "3"}
    if model == "priced-model":
        expected["cost_usd"] = usd(row)
    assert figures == expected
    assert str(row["input_tokens"]) == "7" and str(row["output_tokens"]) == "3"
