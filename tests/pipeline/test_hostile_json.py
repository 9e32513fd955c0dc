"""Request bodies that mean different things to different readers, or that no reader should be
made to walk: refused with a clean 400 in the API's own error shape, before anything goes
upstream, never a 500 with a traceback (issue 20, items 7, 9 and 18).

Real HTTP to a real proxy in front of the simulated upstream; open mode, so no key is needed,
as in the red-team run.
"""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest

from proxy.protocol.request import MAX_DEPTH
from tests.helpers import Stack, sample

CHAT = "/chat/completions"
MESSAGES = "/messages"
HEAD = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5'
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}


async def _post(stack: Stack, path: str, raw: bytes) -> tuple[int, dict[str, object]]:
    headers = {"Content-Type": "application/json", **ANTHROPIC_HEADERS}
    async with aiohttp.ClientSession() as s, s.post(stack.base_url + path, data=raw,
                                                    headers=headers) as r:
        return r.status, await r.json()


def _message(path: str, body: dict[str, object]) -> str:
    """The error's message, checking the shape of the API `path` belongs to."""
    if path == MESSAGES:
        assert body["type"] == "error"
        err = body["error"]
        assert isinstance(err, dict) and err["type"] == "invalid_request_error"
    else:
        err = body["error"]
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"
    message = err["message"]
    assert isinstance(message, str)
    return message


def _no_traceback(stack: Stack) -> None:
    assert [r for r in stack.caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []


AMBIGUOUS = [
    pytest.param(b'{"model": "mock-gpt", "model": "other", ' + HEAD[1:].encode() + b"}",
                 "'model' twice", id="model-twice"),
    pytest.param(b'{"model": "mock-gpt", ' + HEAD[1:].encode() + b', "max_tokens": 9000}',
                 "'max_tokens' twice", id="max_tokens-twice"),
    pytest.param(b'{"model": "mock-gpt", "messages": [{"role": "user", "content": "a", '
                 b'"content": "b"}], "max_tokens": 5}', "'content' twice", id="nested-twice"),
    pytest.param(b'{"model": "mock-gpt", ' + HEAD[1:].encode() + b', "temperature": NaN}',
                 "NaN", id="nan"),
    pytest.param(b'{"model": "mock-gpt", ' + HEAD[1:].encode() + b', "top_p": Infinity}',
                 "Infinity", id="infinity"),
    pytest.param(b'{"model": "mock-gpt", ' + HEAD[1:].encode() + b', "top_p": -Infinity}',
                 "-Infinity", id="minus-infinity"),
    pytest.param(b'{"model": "mock-gpt", ' + HEAD[1:].encode() + b', "top_p": 1e400}',
                 "1e400", id="past-a-double"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize(("raw", "says"), AMBIGUOUS)
async def test_ambiguous_json_is_refused(stack: Stack, path: str, raw: bytes, says: str
                                         ) -> None:
    status, body = await _post(stack, path, raw)
    assert status == 400, body
    assert says in _message(path, body)
    assert stack.mock.requests == []  # nothing went upstream with two meanings
    await stack.settled(1)
    m = await stack.metrics()
    assert sample(m, "tokenmeter_requests_total", status="400", error_class="invalid_request") == 1
    _no_traceback(stack)


def _nested(depth: int) -> bytes:
    """A chat body whose deepest value sits `depth` levels down (the body itself is level 1)."""
    arrays = depth - 1
    return (b'{"model": "mock-gpt", ' + HEAD[1:].encode() + b', "metadata_x": '
            + b"[" * arrays + b"]" * arrays + b"}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900, 100_000])
async def test_deep_nesting_is_a_clean_400(stack: Stack, path: str, depth: int) -> None:
    # 100,000 deep raised RecursionError in the parser: a 500 with a traceback, without a key.
    status, body = await _post(stack, path, _nested(depth))
    assert status == 400, body
    assert f"more than {MAX_DEPTH} levels" in _message(path, body)
    assert stack.mock.requests == []
    _no_traceback(stack)


@pytest.mark.timeout(60)
async def test_nesting_up_to_the_bound_is_forwarded(stack: Stack) -> None:
    status, body = await _post(stack, CHAT, _nested(MAX_DEPTH))
    assert status == 200, body
    assert len(stack.mock.requests) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize("model", ["gpt-4o\u0000x", "gpt\u001b[2J", "a\r\nb", "gpt\u007f",
                                   "gpt\u0085"])
async def test_control_characters_in_the_model_are_refused(stack: Stack, path: str,
                                                           model: str) -> None:
    raw = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 5}).encode()
    status, body = await _post(stack, path, raw)
    assert status == 400, body
    assert "control characters" in _message(path, body)
    if path == CHAT:
        err = body["error"]
        assert isinstance(err, dict)
        assert (err["param"], err["code"]) == ("model", "invalid_value")
    assert stack.mock.requests == []
    _no_traceback(stack)


@pytest.mark.timeout(60)
async def test_plain_bodies_still_pass(stack: Stack) -> None:
    # Unicode that is not a control character, numbers of every JSON form, nesting as tools do.
    raw = json.dumps({
        "model": "mock-gpt-é✓", "max_tokens": 5, "temperature": 0.7, "top_p": 1e-3,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hé \u2028"}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "array", "items": {
                "type": "object", "properties": {"b": {"type": "integer"}}}}}}}}],
    }, ensure_ascii=False).encode()
    status, body = await _post(stack, CHAT, raw)
    assert status == 200, body
    assert stack.mock.requests[0].body is not None
