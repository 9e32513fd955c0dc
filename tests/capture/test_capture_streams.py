"""A capture of every stream of the recorded corpus (tests/protocol/streams), through a real
proxy whose upstream streams the recorded bytes: `captures show` shows each text kind of the
answer (the output of Chat, Completions, Responses and Messages streams, the reasoning, the
refusal, each tool call's name and arguments), every one redacted, and no secret the stream
carried, in any form, anywhere in what it prints. What is expected is read off the corpus's
non-streamed answer, not through the code under test.

One proxy per API (each with its capture store and state directory) takes every case of the
module, one request after another, and is stopped before the first check: a proxy, its ledger
shipper and a `captures show` process a case cost seconds each on a 2-core box. `captures show`
runs in-process (tests.helpers.tokenmeter), and in a process of its own once, which must print
the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.capture.redact import Redactor
from proxy.capture.store import CaptureStore
from proxy.config.capture import DEFAULT_REDACT
from proxy.server.app import create_app
from tests.helpers import make_config, tokenmeter, until

STREAMS = Path(__file__).parents[1] / "protocol" / "streams"
CASES = sorted(STREAMS.glob("*/*.sse"))
KEY = "sk-proj-AbCdEfGh1234567890abcdEFGH"  # the secrets the corpus's texts carry
MAIL = "jane.doe@example.com"
CLIENT = "sk-alice-capture-streams-01"
_REDACT = Redactor.of(DEFAULT_REDACT)

# By the corpus's folder: the route, the request's body, the API the proxy serves.
_ASK: dict[str, tuple[str, dict[str, Any], str]] = {
    "chat": ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}, "openai"),
    "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 64}, "openai"),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 64}, "openai"),
    "messages": ("/v1/messages",
                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64},
                 "anthropic"),
}


def _upstream(recorded: Callable[[], bytes]) -> web.Application:
    """Streams `recorded()`: the bytes of the case being sent (one request at a time)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        raw = recorded()
        for at in range(0, len(raw), 61):  # cut anywhere, as a network does
            await response.write(raw[at:at + 61])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/{path:.*}", answer)
    return app


def _expected(answer: dict[str, Any]) -> dict[str, Any]:
    """What `captures show` should show, read off the non-streamed answer by hand: each kind's
    texts, each redacted alone (as the choices and blocks they are), then joined."""
    out: dict[str, Any] = {"output": [], "reasoning": [], "refusal": [], "calls": []}
    if "choices" in answer:  # Chat and Completions, choice after choice
        for choice in answer["choices"]:
            message = choice.get("message") or {}
            out["output"].append(message.get("content") or choice.get("text") or "")
            out["reasoning"] += [message.get("reasoning_content") or "",
                                 message.get("reasoning") or ""]
            out["refusal"].append(message.get("refusal") or "")
            out["calls"] += [(c["function"]["name"], c["function"]["arguments"])
                             for c in message.get("tool_calls") or ()]
    elif "output" in answer:  # Responses, item after item
        for item in answer["output"]:
            if item["type"] == "function_call":
                out["calls"].append((item["name"], item["arguments"]))
            for part in [*item.get("summary", ()), *item.get("content", ())]:
                kind = "reasoning" if item["type"] == "reasoning" else (
                    "refusal" if part["type"] == "refusal" else "output")
                out[kind].append(part.get("text") or part.get("refusal") or "")
    else:  # Messages, block after block
        for block in answer["content"]:
            out["output"].append(block.get("text", ""))
            out["reasoning"].append(block.get("thinking", ""))
            if block["type"] == "tool_use":
                out["calls"].append((block["name"], json.dumps(block["input"])))
    for kind in ("output", "reasoning", "refusal"):
        out[kind] = "".join(_REDACT(text) for text in out[kind])
    return out


@dataclass(frozen=True, slots=True)
class Sent:
    """A case's request as the proxy answered it, and where its capture and ledger row are."""

    status: int
    body: str  # the answer's body when it is not a 200, to say why
    request_id: str
    store_url: str
    state_dir: Path  # the proxy's TOKENMETER_STATE_DIR: its ledger, which `show` reads


def _request(path: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The case's route, request body and non-streamed answer."""
    route, body, _ = _ASK[path.parent.name]
    answer = json.loads(path.with_suffix(".json").read_text())
    if len(answer.get("choices") or ()) > 1:
        body = {**body, "n": len(answer["choices"])}
    return route, {"model": answer["model"], "stream": True, **body}, answer


async def _send_all(tmp: Path) -> dict[Path, Sent]:
    playing: list[bytes] = []
    upstream = TestServer(_upstream(lambda: playing[-1]))
    await upstream.start_server()
    proxies: dict[str, TestServer] = {}
    sent: dict[Path, Sent] = {}
    try:
        for api in ("openai", "anthropic"):
            url = f"sqlite://{tmp / api / 'captures.sqlite3'}"
            (tmp / api).mkdir()
            await (await CaptureStore.open(url)).close()
            config = make_config(
                str(upstream.make_url("/v1")), api=api, users={"alice": {"keys": [CLIENT]}},
                extra={"capture": {"enabled": True, "url": url, "sample": 1.0}})
            with pytest.MonkeyPatch.context() as env:  # read as the proxy starts
                env.setenv("TOKENMETER_STATE_DIR", str(tmp / api))
                proxies[api] = TestServer(create_app(config))
                await proxies[api].start_server()
        headers = {"Authorization": f"Bearer {CLIENT}", "x-api-key": CLIENT,
                   "anthropic-version": "2023-06-01"}
        async with aiohttp.ClientSession() as session:
            for path in CASES:
                route, body, _ = _request(path)
                api = _ASK[path.parent.name][2]
                playing.append(path.read_bytes())
                async with session.post(proxies[api].make_url(route), json=body,
                                        headers=headers) as response:
                    text = (await response.read()).decode(errors="replace")
                    sent[path] = Sent(response.status, text if response.status != 200 else "",
                                      response.headers.get("x-tokenmeter-request-id", ""),
                                      f"sqlite://{tmp / api / 'captures.sqlite3'}", tmp / api)
        stores = {s.store_url: await CaptureStore.open(s.store_url) for s in sent.values()}
        try:
            async def there() -> bool:
                return all([await stores[s.store_url].get(s.request_id) is not None
                            for s in sent.values() if s.status == 200])

            # A capture still missing then fails its own case, at `captures show`.
            with contextlib.suppress(TimeoutError):
                await until(there, deadline=30)
        finally:
            for store in stores.values():
                await store.close()
    finally:
        for proxy in proxies.values():
            await proxy.close()  # its ledger shipper ships what it holds before it exits
        await upstream.close()
    return sent


@pytest.fixture(scope="module")
def sent(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Sent]:
    return asyncio.run(_send_all(tmp_path_factory.mktemp("capture-streams")))


@pytest.fixture
def show(sent: dict[Path, Sent], monkeypatch: pytest.MonkeyPatch) -> Callable[[Path, str], str]:
    """`tokenmeter captures show` of a case's request, in-process: what it prints."""

    def run(path: Path, fmt: str) -> str:
        s = sent[path]
        monkeypatch.setenv("TOKENMETER_STATE_DIR", str(s.state_dir))
        shown = tokenmeter("captures", "show", s.request_id, "--format", fmt, "--url",
                           s.store_url)
        assert shown.returncode == 0, shown.stderr
        return shown.stdout

    return run


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_captures_show_every_text_kind_of_a_stream_redacted(
    sent: dict[Path, Sent], show: Callable[[Path, str], str], path: Path
) -> None:
    assert sent[path].status == 200, sent[path].body
    _, _, answer = _request(path)
    shown = json.loads(show(path, "json"))
    expected = _expected(answer)
    assert shown["output_text"] == expected["output"]
    assert (shown.get("reasoning") or "") == expected["reasoning"]
    assert (shown.get("refusal") or "") == expected["refusal"]
    calls = [(c.get("name"), json.loads(c["arguments"])) for c in shown["tool_calls"]]
    assert calls == [(name, _redacted(json.loads(args))) for name, args in expected["calls"]]
    text = show(path, "text")
    # Every string of every event, and each tool's arguments joined across the events and
    # decoded, as a client joins and decodes them; and everything printed.
    objs = [json.loads(e["text"].partition("data: ")[2]) for e in shown["events"]
            if "data: {" in e["text"]]
    decoded = [s for obj in objs for s in _strings(obj)]
    decoded += [s for args in _arguments(objs).values() for s in _strings(args)]
    assert decoded
    for printed in (text, json.dumps(shown, ensure_ascii=False), *decoded):
        for secret in (KEY, MAIL):
            for form in _forms(secret):
                assert form not in printed


@pytest.mark.timeout(120)
def test_captures_show_in_a_process_of_its_own_prints_the_same(
    sent: dict[Path, Sent], show: Callable[[Path, str], str]
) -> None:
    # The case with the most kinds at once: reasoning, parallel tool calls, output.
    path = STREAMS / "responses" / "reasoning_and_parallel_tool_calls.sse"
    s = sent[path]
    assert s.status == 200, s.body
    printed = {fmt: subprocess.run(
        [sys.executable, "-m", "proxy", "captures", "show", s.request_id, "--format", fmt,
         "--url", s.store_url], capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "TOKENMETER_STATE_DIR": str(s.state_dir)}).stdout
        for fmt in ("json", "text")}
    assert printed == {fmt: show(path, fmt) for fmt in ("json", "text")}
    # The proxy's ledger row is shown too (the proxy shipped it as it stopped).
    assert json.loads(printed["json"])["ledger"]["output_tokens"] > 0


def _forms(secret: str) -> list[str]:
    once = json.dumps(secret)[1:-1]
    return [secret, once, json.dumps(once)[1:-1]]


def _arguments(objs: list[dict[str, Any]]) -> dict[tuple[Any, ...], str]:
    """Each tool call's arguments joined from its pieces in the events (of Chat's tool_calls
    deltas, Responses' function_call_arguments deltas, Messages' input_json_delta)."""
    joined: dict[tuple[Any, ...], str] = {}
    for obj in objs:
        for choice in obj.get("choices") or ():
            for call in (choice.get("delta") or {}).get("tool_calls") or ():
                key: tuple[Any, ...] = ("chat", choice.get("index"), call.get("index"))
                joined[key] = joined.get(key, "") + call["function"].get("arguments", "")
        if obj.get("type") == "response.function_call_arguments.delta":
            key = ("responses", obj["output_index"])
            joined[key] = joined.get(key, "") + obj["delta"]
        delta = obj.get("delta")
        if isinstance(delta, dict) and delta.get("type") == "input_json_delta":
            key = ("messages", obj["index"])
            joined[key] = joined.get(key, "") + delta["partial_json"]
    return joined


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return _REDACT(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    return [_redacted(v) for v in value] if isinstance(value, list) else value


def _strings(value: Any) -> list[str]:
    """Every string in a JSON value, and in the JSON a string spells."""
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            return [value]
        return [value, *_strings(inner)] if not isinstance(inner, str) else [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []
