"""`tokenmeter bench --replay` of a mixed export: OpenAI and Anthropic lines each sent in their
own API, an embeddings line counted as skipped, and each request's recorded outcome beside
A's and B's. Two replay upstreams (`mock-upstream --replay`'s app) over real loopback HTTP,
the bench a real subprocess."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.bench.cli import add_parser, build_config
from proxy.bench.client import Api, Endpoint
from proxy.bench.replay import ReplayOutcome, recorded_outcome
from proxy.protocol.export_line import Recording, parse_line
from proxy.testing.replay import create_replay_app, load_recordings
from tests.helpers import ServerFactory

OPENAI_KEY = "sk-openai-replay-mixed-01"
ANTHROPIC_KEY = "sk-ant-replay-mixed-0002"
SEEN = web.AppKey("seen", list)


def _openai(i: int, answer: str, status: int = 200) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"openai question {i}"}]
    if status == 200:
        body: Any = {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                  "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}
    else:
        body = {"error": {"message": "Rate limit reached", "type": "rate_limit_error",
                          "param": None, "code": "rate_limit_exceeded"}}
    return {"request_id": f"o{i}", "api": "openai", "path": "/v1/chat/completions",
            "model": "gpt-x", "messages": messages, "max_tokens": 20, "stream": False,
            "request": {"model": "gpt-x", "messages": messages, "max_tokens": 20},
            "response": {"status": status, "body": body, "events": []}}


def _anthropic(i: int, answer: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"anthropic question {i}"}]
    body = {"id": f"msg_{i}", "type": "message", "role": "assistant", "model": "claude-x",
            "content": [{"type": "text", "text": answer}], "stop_reason": "end_turn",
            "usage": {"input_tokens": 5, "output_tokens": 3}}
    return {"request_id": f"a{i}", "api": "anthropic", "path": "/v1/messages",
            "model": "claude-x", "messages": messages, "max_tokens": 30, "stream": False,
            "request": {"model": "claude-x", "messages": messages, "max_tokens": 30},
            "response": {"status": 200, "body": body, "events": []}}


EMBEDDINGS = {"request_id": "e1", "api": "openai", "path": "/v1/embeddings",
              "response": {"status": 200, "body": {"data": []}}}


def _export(path: Path, *, rate_limited: bool) -> Path:
    """Lines 1-2 OpenAI, 3 embeddings, 4-5 Anthropic, 6 OpenAI: recorded as a 429 in A's
    file, answered in B's (so B's outcome of line 6 differs from the recording)."""
    lines = [_openai(1, "one"), _openai(2, "two"), EMBEDDINGS, _anthropic(4, "four"),
             _anthropic(5, "five"), _openai(6, "six", 429 if rate_limited else 200)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@web.middleware
async def _record(request: web.Request,
                  handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                  ) -> web.StreamResponse:
    request.app[SEEN].append((request.path, dict(request.headers)))
    return await handler(request)


def _upstream(file: Path) -> web.Application:
    app = create_replay_app(load_recordings(file), speed=0)
    app[SEEN] = []
    app.middlewares.append(_record)
    return app


async def _bench(*args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env |= {"OPENAI_API_KEY": OPENAI_KEY, "ANTHROPIC_API_KEY": ANTHROPIC_KEY}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "bench", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_mixed_export_is_replayed_each_line_in_its_own_api(
    aiohttp_server: ServerFactory, tmp_path: Path,
) -> None:
    recorded = _export(tmp_path / "a.jsonl", rate_limited=True)
    server_a = await aiohttp_server(_upstream(recorded))
    server_b = await aiohttp_server(_upstream(_export(tmp_path / "b.jsonl", rate_limited=False)))
    out = tmp_path / "out.json"
    code, text, err = await _bench(
        "--base-url", str(server_a.make_url("/v1")), "--label", "A",
        "--compare", str(server_b.make_url("/v1")), "--compare-label", "B",
        "--replay", str(recorded), "--json", str(out))
    assert code == 0, err
    for server in (server_a, server_b):
        seen = server.app[SEEN]
        assert sorted(p for p, _ in seen) == ["/v1/chat/completions"] * 3 + ["/v1/messages"] * 2
        for path, headers in seen:
            if path == "/v1/messages":
                assert headers["x-api-key"] == ANTHROPIC_KEY
                assert headers["anthropic-version"] == "2023-06-01"
                assert "Authorization" not in headers
            else:
                assert headers["Authorization"] == f"Bearer {OPENAI_KEY}"
                assert "x-api-key" not in headers
    assert OPENAI_KEY not in text + err and ANTHROPIC_KEY not in text + err

    data = json.loads(out.read_text())
    replay = data["replay"]
    assert (replay["requests"], replay["lines"]) == (5, 6)
    assert replay["skipped"]["total"] == 1
    assert [(s["reason"], s["what"], s["count"]) for s in replay["skipped"]["by_reason"]] == [
        ("route", "/v1/embeddings", 1)]
    rows = {r["line"]: r for r in replay["outcomes"]["per_request"]}
    assert sorted(rows) == [1, 2, 4, 5, 6]
    assert {line: r["api"] for line, r in rows.items()} == {
        1: "openai", 2: "openai", 4: "anthropic", 5: "anthropic", 6: "openai"}
    assert rows[6]["recorded"] == {"status": 429, "error_class": "rate_limit"}
    a6, b6 = rows[6]["endpoints"]
    assert (a6["endpoint"], a6["status"], a6["error_class"], a6["same"]) == (
        "A", 429, "rate_limit", True)
    assert (b6["endpoint"], b6["status"], b6["error_class"], b6["same"]) == (
        "B", 200, None, False)
    for line in (1, 2, 4, 5):
        assert rows[line]["recorded"] == {"status": 200, "error_class": None}
        assert [(e["status"], e["same"]) for e in rows[line]["endpoints"]] == [
            (200, True), (200, True)]
    assert replay["outcomes"]["differ"] == 1
    assert replay["outcomes"]["same_as_recorded"] == [
        {"endpoint": "A", "same": 5, "of": 5}, {"endpoint": "B", "same": 4, "of": 5}]
    # The Anthropic answers were read as Anthropic's (their text, compared across A and B).
    pairs = {p["line"]: (p["a"], p["b"]) for p in replay["answers"]["per_request"]}
    assert pairs[4] == ("four", "four") and pairs[5] == ("five", "five")
    config = data["config"]
    assert config["api"] == "per line" and config["api_key_set"] is True
    assert config["api_key_env"] == "OPENAI_API_KEY, ANTHROPIC_API_KEY"

    assert "replayed 5 of 6 lines; skipped 1: 1 /v1/embeddings (not replayed by bench)" in text
    assert "same outcome as recorded: A 5/5, B 4/5" in text
    assert "outcome differs from the recording for 1 of 5 requests:" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("6 "))
    assert row.split() == ["6", "openai", "429", "rate_limit", "429", "rate_limit", "200", "ok"]


async def test_api_given_with_replay_keeps_that_api_and_counts_the_others_skipped(
    aiohttp_server: ServerFactory, tmp_path: Path,
) -> None:
    recorded = _export(tmp_path / "a.jsonl", rate_limited=True)
    server = await aiohttp_server(_upstream(recorded))
    out = tmp_path / "out.json"
    code, text, err = await _bench(
        "--base-url", str(server.make_url("/v1")), "--replay", str(recorded),
        "--api", "anthropic", "--json", str(out))
    assert code == 0, err
    assert [p for p, _ in server.app[SEEN]] == ["/v1/messages"] * 2
    replay = json.loads(out.read_text())["replay"]
    assert (replay["requests"], replay["lines"], replay["skipped"]["total"]) == (2, 6, 4)
    assert [(s["reason"], s["what"], s["count"]) for s in replay["skipped"]["by_reason"]] == [
        ("route", "/v1/embeddings", 1), ("api", "anthropic", 3)]
    assert ("replayed 2 of 6 lines; skipped 4: 1 /v1/embeddings (not replayed by bench), "
            "3 not --api anthropic") in text

    # Every line skipped: a usage error that says why, with the counts.
    only_openai = tmp_path / "openai.jsonl"
    only_openai.write_text(json.dumps(_openai(1, "one")) + "\n" + json.dumps(EMBEDDINGS) + "\n")
    code, _, err = await _bench("--base-url", str(server.make_url("/v1")),
                                "--replay", str(only_openai), "--api", "anthropic")
    assert code == 2
    assert ("no recorded request to replay (of 2 lines skipped: 1 /v1/embeddings (not "
            "replayed by bench); 1 not --api anthropic)") in err


def _config(monkeypatch: pytest.MonkeyPatch, file: Path, *extra: str) -> Sequence[Endpoint]:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", OPENAI_KEY)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--base-url", "http://127.0.0.1:9/v1",
                              "--replay", str(file), *extra])
    config, _, _ = build_config(args)
    return config.endpoints


def test_each_api_gets_its_own_key_never_the_others(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    file = _export(tmp_path / "a.jsonl", rate_limited=False)
    (endpoint,) = _config(monkeypatch, file)
    assert endpoint.request_headers(Api.OPENAI)["Authorization"] == f"Bearer {OPENAI_KEY}"
    # ANTHROPIC_API_KEY unset: the Anthropic lines go without a key, not with OpenAI's.
    assert "x-api-key" not in endpoint.request_headers(Api.ANTHROPIC)
    with monkeypatch.context() as env:
        env.setenv("ONE_KEY", "sk-one-for-both")
        (endpoint,) = _config(env, file, "--api-key-env", "ONE_KEY")
    assert endpoint.request_headers(Api.ANTHROPIC)["x-api-key"] == "sk-one-for-both"
    assert endpoint.request_headers(Api.OPENAI)["Authorization"] == "Bearer sk-one-for-both"


def test_a_recorded_answer_is_classified_as_bench_classifies_one_it_gets() -> None:
    def line(status: int, body: Any, events: Sequence[str] = ()) -> Recording:
        data = {**_openai(1, "x"), "response": {
            "status": status, "body": body,
            "events": [{"at_ms": 0, "text": e} for e in events]}}
        return parse_line(json.dumps(data), 1)

    too_long = {"error": {"message": "This model's maximum context length is 8192 tokens",
                          "type": "invalid_request_error", "code": "context_length_exceeded"}}
    assert recorded_outcome(line(400, too_long)) == ReplayOutcome(400, "context_length")
    assert recorded_outcome(line(401, None)) == ReplayOutcome(401, "auth")
    assert recorded_outcome(line(503, None)) == ReplayOutcome(503, "server_error")
    broken = ['data: {"choices": [{"delta": {"content": "a"}}]}',
              'data: {"error": {"message": "overloaded"}}']
    assert recorded_outcome(line(200, None, broken)) == ReplayOutcome(200, "stream_error")
    assert recorded_outcome(line(200, None, broken[:1])) == ReplayOutcome(200, None)
