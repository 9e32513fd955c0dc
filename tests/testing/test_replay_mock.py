"""The replay upstream (`mock-upstream --replay`) with the real SDKs as clients: in process,
as the real `python -m proxy` subprocess, and behind the real proxy."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletionMessageParam

from proxy.cli import main
from proxy.server.app import create_app
from proxy.testing.replay import create_replay_app, load_recordings
from tests.helpers import make_config, sample, scrape, sdk, settled
from tests.servers import free_port, wait_until_listening

ServerFactory = Callable[..., Coroutine[Any, Any, TestServer]]

ASK_JSON: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is replay?"}]
ASK_STREAM: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count to three."}]
ASK_LIMITED: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Too many?"}]
ASK_CLAUDE: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Say hi."}]
ANSWER = "Replay answers with what was recorded."
PIECES = ("One", ", two", ", three", ".")
CLAUDE_PIECES = ("Hi", " there", "!")
SPAN_MS = 300.0  # the recorded streams' last event, after the request was sent


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: Any = None) -> str:
    chunk = {"id": "chatcmpl-rec2", "object": "chat.completion.chunk", "created": 1700000000,
             "model": "gpt-4o-mini", "choices": [] if usage else [
                 {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
             "usage": usage}
    return "data: " + json.dumps(chunk, separators=(",", ":"))


def _claude(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: " + json.dumps({"type": kind, **payload})


CHAT_EVENTS = (
    [_chunk({"role": "assistant", "content": ""})]
    + [_chunk({"content": piece}) for piece in PIECES]
    + [_chunk({}, "stop"),
       _chunk({}, usage={"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}),
       "data: [DONE]"]
)
CLAUDE_EVENTS = [
    _claude("message_start", {"message": {
        "id": "msg_rec3", "type": "message", "role": "assistant", "model": "claude-3-5-haiku",
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 9, "output_tokens": 1}}}),
    _claude("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    *(_claude("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": p}})
      for p in CLAUDE_PIECES),
    _claude("content_block_stop", {"index": 0}),
    _claude("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                              "usage": {"output_tokens": 3}}),
    _claude("message_stop", {}),
]


def _timed(texts: list[str]) -> list[dict[str, Any]]:
    """The events spread evenly over SPAN_MS, the first one at 0."""
    step = SPAN_MS / (len(texts) - 1)
    return [{"at_ms": i * step, "text": text} for i, text in enumerate(texts)]


def _line(path: str, messages: Any, stream: bool, response: dict[str, Any]) -> str:
    return json.dumps({
        "request_id": f"rec-{path}-{stream}", "api": "anthropic" if "messages" in path[4:]
        else "openai", "path": path, "model": "gpt-4o-mini", "messages": messages,
        "max_tokens": 64, "stream": stream, "request": {"messages": messages},
        "response": response})


JSON_BODY = {
    "id": "chatcmpl-rec1", "object": "chat.completion", "created": 1700000000,
    "model": "gpt-4o-mini", "choices": [{"index": 0, "message": {"role": "assistant",
                                                                 "content": ANSWER},
                                         "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
}
LIMITED = {"error": {"message": "Rate limit reached (recorded).", "type": "requests",
                     "param": None, "code": "rate_limit_exceeded"}}
LINES = [
    _line("/v1/chat/completions", ASK_JSON, False,
          {"status": 200, "body": JSON_BODY, "events": [], "output_text": ANSWER}),
    _line("/v1/chat/completions", ASK_STREAM, True,
          {"status": 200, "body": None, "events": _timed(CHAT_EVENTS),
           "output_text": "".join(PIECES)}),
    _line("/v1/chat/completions", ASK_LIMITED, False, {"status": 429, "body": LIMITED, "events": []}),
    _line("/v1/messages", ASK_CLAUDE, True,
          {"status": 200, "body": None, "events": _timed(CLAUDE_EVENTS),
           "output_text": "".join(CLAUDE_PIECES)}),
]


@pytest.fixture
def replay_file(tmp_path: Path) -> Path:
    path = tmp_path / "captures.jsonl"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return path


@pytest.fixture
async def replay(aiohttp_server: ServerFactory, replay_file: Path) -> TestServer:
    return await aiohttp_server(create_replay_app(load_recordings(replay_file), speed=0))


def openai_client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


def anthropic_client(base: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)


def base_of(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


async def streamed_text(client: openai.AsyncOpenAI, messages: Any) -> str:
    stream = await client.chat.completions.create(model="any-model", messages=messages,
                                                  stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def test_a_recorded_json_answer_is_replayed_whatever_the_model(replay: TestServer) -> None:
    async with openai_client(base_of(replay)) as client:
        reply = await client.chat.completions.create(model="another-model", messages=ASK_JSON)
    assert reply.choices[0].message.content == ANSWER
    assert reply.model_dump(exclude_unset=True) == JSON_BODY


async def test_a_recorded_error_is_replayed_with_its_status(replay: TestServer) -> None:
    async with openai_client(base_of(replay)) as client:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model="m", messages=ASK_LIMITED)
    assert caught.value.status_code == 429
    assert caught.value.body == LIMITED["error"]


async def test_a_recorded_stream_arrives_byte_for_byte(replay: TestServer) -> None:
    async with openai_client(base_of(replay)) as client:
        assert await streamed_text(client, ASK_STREAM) == "".join(PIECES)
    body = {"model": "m", "messages": ASK_STREAM, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(
            replay.make_url("/v1/chat/completions"), json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert await resp.read() == "".join(f"{e}\n\n" for e in CHAT_EVENTS).encode()


async def test_a_recorded_messages_stream_reaches_the_anthropic_sdk(replay: TestServer) -> None:
    async with anthropic_client(base_of(replay)) as client, client.messages.stream(
            model="claude-any", max_tokens=64, messages=ASK_CLAUDE) as stream:
        message = await stream.get_final_message()
    assert [block.text for block in message.content if block.type == "text"] == [
        "".join(CLAUDE_PIECES)]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (9, 3)


async def test_a_request_matching_no_recording_gets_a_404(replay: TestServer) -> None:
    async with openai_client(base_of(replay)) as client:
        with pytest.raises(openai.NotFoundError, match="No recorded request matches"):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "never recorded"}])
    async with anthropic_client(base_of(replay)) as claude:
        # The recorded chat request's messages, on the other route: not a match either.
        with pytest.raises(anthropic.NotFoundError, match="No recorded request matches") as e:
            await claude.messages.create(model="m", max_tokens=8, messages=[
                {"role": "user", "content": "What is replay?"}])
    assert isinstance(e.value.body, dict)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error"


async def test_a_paced_stream_takes_at_least_the_recorded_span(
        aiohttp_server: ServerFactory, replay_file: Path) -> None:
    server = await aiohttp_server(create_replay_app(load_recordings(replay_file), speed=2))
    async with openai_client(base_of(server)) as client:
        started = time.monotonic()
        assert await streamed_text(client, ASK_STREAM) == "".join(PIECES)
        assert time.monotonic() - started >= SPAN_MS / 2 / 1000


async def test_the_proxy_meters_a_replayed_answer(
        aiohttp_server: ServerFactory, replay: TestServer) -> None:
    proxy = await aiohttp_server(create_app(make_config(str(replay.make_url("/v1")))))
    async with sdk(proxy) as client:
        reply = await client.chat.completions.create(model="gpt-4o-mini", messages=ASK_JSON)
        assert reply.choices[0].message.content == ANSWER
        assert await streamed_text(client, ASK_STREAM) == "".join(PIECES)
    await settled(proxy.app, 2)
    m = await scrape(proxy)
    # The recorded usage, as the replay sent it: 12 + 11 prompt, 7 + 4 completion tokens.
    assert sample(m, "tokenmeter_tokens_total", type="input", source="reported") == 23
    assert sample(m, "tokenmeter_tokens_total", type="output", source="reported") == 11


@pytest.fixture
def served_replay(replay_file: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "mock-upstream", "--replay", str(replay_file),
         "--port", str(port), "--speed", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until_listening(proc, port)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()


async def test_the_replay_subcommand_serves_the_file(served_replay: str) -> None:
    async with openai_client(served_replay) as client:
        reply = await client.chat.completions.create(model="m", messages=ASK_JSON)
        assert reply.choices[0].message.content == ANSWER
        started = time.monotonic()
        assert await streamed_text(client, ASK_STREAM) == "".join(PIECES)
        assert time.monotonic() - started >= SPAN_MS / 1000  # --speed 1: as recorded
        with pytest.raises(openai.NotFoundError, match="No recorded request matches"):
            await client.chat.completions.create(model="m", messages=ASK_CLAUDE)  # type: ignore[arg-type]


@pytest.mark.parametrize("speed", ["-1", "nan", "fast"])
def test_the_replay_speed_is_a_number_not_below_zero(speed: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["mock-upstream", "--replay", "any.jsonl", "--speed", speed])
    assert caught.value.code == 2
    assert "not a speed" in capsys.readouterr().err


def test_the_replay_subcommand_names_a_bad_line_and_refuses_a_file_of_none(
        tmp_path: Path) -> None:
    # A bad line is skipped with a warning naming it (one bad capture never refuses the file);
    # a file with no line to replay is refused.
    path = tmp_path / "bad.jsonl"
    path.write_text("\n" + json.dumps({"path": "/v1/messages"}) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "proxy", "mock-upstream", "--replay", str(path),
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    warning, refusal = proc.stderr.splitlines()
    assert json.loads(warning)["message"] == f"{path}: line 2: messages must be a list (skipped)"
    assert refusal == f"{path}: it holds no recorded request"
