"""`tokenmeter bench --replay`: recorded requests sent to two replay upstreams
(`mock-upstream --replay`'s app) over real loopback HTTP, the answers and cost compared."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.bench.client import RequestSpec
from proxy.bench.workload import Prompt
from proxy.cli import main
from proxy.testing.replay import create_replay_app, load_recordings
from tests.helpers import ServerFactory, config_data

ROUTE = "/v1/chat/completions"
USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
STREAMED = {1, 2, 4, 5}  # of the 6 requests; 3 and 6 are answered as JSON
LAST_EVENT_MS = 800.0  # when a recorded stream's last text arrives (pacing of target A)


def _answer_a(i: int) -> str:
    return f"answer {i}"


def _answer_b(i: int) -> str:
    # The same for the first half, a longer other text for the second.
    return _answer_a(i) if i <= 3 else f"a different answer {i}"


def _data(obj: Any) -> str:
    return "data: " + json.dumps(obj)


def _line(i: int, answer: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": f"question {i}"}]
    stream = i in STREAMED
    request = {"model": "recorded-model", "messages": messages, "max_tokens": 50,
               "temperature": 0.3, **({"stream": True} if stream else {})}
    head, _, tail = answer.partition(" ")
    if stream:
        events = [{"at_ms": 0.0, "text": _data({"choices": [{"delta": {"content": head}}]})},
                  {"at_ms": LAST_EVENT_MS,
                   "text": _data({"choices": [{"delta": {"content": " " + tail},
                                               "finish_reason": "stop"}]})},
                  {"at_ms": LAST_EVENT_MS, "text": _data({"choices": [], "usage": USAGE})},
                  {"at_ms": LAST_EVENT_MS, "text": "data: [DONE]"}]
        response: dict[str, Any] = {"status": 200, "body": None, "events": events}
    else:
        body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                             "finish_reason": "stop"}], "usage": USAGE}
        response = {"status": 200, "body": body, "events": []}
    return {"request_id": f"r{i}", "api": "openai", "path": ROUTE, "model": "recorded-model",
            "messages": messages, "max_tokens": 50, "stream": stream, "request": request,
            "response": response}


def _write(path: Path, answer: Any) -> Path:
    path.write_text("".join(json.dumps(_line(i, answer(i))) + "\n" for i in range(1, 7)))
    return path


async def _bench(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "bench", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_replay_compares_answers_speed_and_cost(
    aiohttp_server: ServerFactory, tmp_path: Path,
) -> None:
    file_a = _write(tmp_path / "a.jsonl", _answer_a)
    file_b = _write(tmp_path / "b.jsonl", _answer_b)
    server_a = await aiohttp_server(create_replay_app(load_recordings(file_a), speed=1))
    # B: the same pacing eight times as fast, so its streams end 700 ms earlier.
    server_b = await aiohttp_server(create_replay_app(load_recordings(file_b), speed=8))
    prices = tmp_path / "prices.yaml"
    prices.write_text("prices:\n  recorded-model: {input: 1.0, output: 2.0}\n")
    out = tmp_path / "out"
    code, text, err = await _bench(
        "--base-url", str(server_a.make_url("/v1")), "--label", "A",
        "--compare", str(server_b.make_url("/v1")), "--compare-label", "B",
        "--replay", str(file_a), "--prices", str(prices),
        "--json", f"{out}.json", "--plot", f"{out}.html")
    assert code == 0, err
    data = json.loads(Path(f"{out}.json").read_text())
    replay = data["replay"]
    answers = replay["answers"]
    assert answers["pairs"] == 6 and answers["exact_match_rate"] == 0.5
    assert [(p["line"], p["a"], p["b"], p["match"]) for p in answers["per_request"]] == [
        (i, _answer_a(i), _answer_b(i), i <= 3) for i in range(1, 7)]
    arranged = sum(len(_answer_b(i)) for i in range(1, 7)) / sum(
        len(_answer_a(i)) for i in range(1, 7))
    assert answers["length_ratio"] == pytest.approx(arranged)
    # Every request was sent once per target, each streamed as it was recorded.
    level_a, level_b = data["levels"]
    assert (level_a["endpoint"], level_a["ok"], level_b["endpoint"], level_b["ok"]) == (
        "A", 6, "B", 6)
    # 4 of 6 streamed: each E2E median is a stream's. A's cannot be below its pacing; B's,
    # paced 8x faster, is far below it (only the order is checked, no threshold of B's own).
    assert level_a["e2e"]["p50"] >= LAST_EVENT_MS / 1000
    assert level_b["e2e"]["p50"] < level_a["e2e"]["p50"]
    # 10 prompt tokens at $1/M and 5 output tokens at $2/M, per request.
    per_request = (10 * 1.0 + 5 * 2.0) / 1e6
    for cost in replay["cost"]:
        assert cost["requests"] == 6 and cost["unpriced_models"] == []
        assert cost["cost_usd"] == pytest.approx(6 * per_request)
        assert cost["cost_per_1k_requests_usd"] == pytest.approx(1000 * per_request)
    assert "exact match 50.0%" in text and "cost A: $0.000120" in text
    page = Path(f"{out}.html").read_text()
    assert 'id="answers"' in page and "question 4" in page
    assert "<ins>a different</ins> answer 4" in page


def test_replay_body_is_the_recorded_one_but_the_model() -> None:
    body = {"model": "recorded-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 7, "temperature": 0.3, "tools": [{"type": "function"}], "stream": True}
    prompt = Prompt(({"role": "user", "content": "hi"},), 1, 7, body=body, stream=True, line=1)
    sent = json.loads(RequestSpec(model="other-model", stream=False).body(prompt))
    assert sent == {**body, "model": "other-model",
                    "stream_options": {"include_usage": True}}
    kept = json.loads(RequestSpec(model="", stream=False).body(prompt))
    assert kept["model"] == "recorded-model"
    assert RequestSpec(model="m", stream=False).stream_for(prompt) is True


def test_bad_replay_file_names_the_line_and_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    # A bad line is skipped and named in a warning; a file with nothing to replay is refused.
    bad = tmp_path / "bad.jsonl"
    good = json.dumps(_line(1, "x"))
    bad.write_text(f"\n\n{{\"path\": \"{ROUTE}\", \"messages\": 3}}\n")
    base = ["bench", "--base-url", "http://127.0.0.1:9/v1"]
    assert main([*base, "--replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: line 3: messages must be a list (skipped)" in err
    assert f"--replay {bad}: it holds no recorded request" in err
    prices = tmp_path / "prices.yaml"
    prices.write_text("prices:\n  m: {input: -1, output: 1}\n")
    bad.write_text(good + "\n")
    assert main([*base, "--replay", str(bad), "--prices", str(prices)]) == 2
    assert f"--prices {prices}" in capsys.readouterr().err
    assert main([*base]) == 2
    assert "--model is required" in capsys.readouterr().err


async def test_replay_to_one_target_priced_by_a_config_by_the_model_sent(
    aiohttp_server: ServerFactory, tmp_path: Path,
) -> None:
    file = _write(tmp_path / "a.jsonl", _answer_a)
    # A line of a route bench does not send (embeddings) is read, counted skipped, not sent.
    other = {"path": "/v1/embeddings", "response": {"status": 200, "body": {}}}
    file.write_text(file.read_text() + json.dumps(other) + "\n")
    server = await aiohttp_server(create_replay_app(load_recordings(file), speed=0))
    config = tmp_path / "tm.yaml"
    data = config_data(str(server.make_url("/v1")),
                       extra={"prices": {"other-*": {"input": 3.0, "output": 4.0}}})
    config.write_text(yaml.safe_dump(data))
    runs, texts = {}, {}
    for model in ("other-model", None):
        out = tmp_path / f"{model}.json"
        code, text, err = await _bench(
            "--base-url", str(server.make_url("/v1")), "--replay", str(file),
            "--config", str(config), "--json", str(out), *(["--model", model] if model else []))
        assert code == 0, err
        runs[model] = json.loads(out.read_text())["replay"]
        texts[model] = text
    priced = runs["other-model"]
    assert priced["requests"] == 6 and priced["answers"] is None
    (cost,) = priced["cost"]
    assert cost["cost_usd"] == pytest.approx(6 * (10 * 3.0 + 5 * 4.0) / 1e6)
    assert cost["unpriced_models"] == []
    # Without --model each request keeps its recorded model, which this table does not price.
    (cost,) = runs[None]["cost"]
    assert cost["unpriced_models"] == ["recorded-model"] and cost["cost_usd"] == 0
    assert "(no price for: recorded-model)" in texts[None]
