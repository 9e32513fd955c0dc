"""The codecs' assembly and replay (proxy/protocol/apis): an answer stored from a stream and
replayed as one (and the other way round) is the same answer, each the other's inverse on what
the SDKs read; `ended` reads off the bytes what `finished` reads off the answer; redaction reaches
the texts only. The corpus (test_stream_corpus.py) checks the same on recorded streams."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.cache.cache import redaction
from proxy.protocol.codec import redacted_json
from proxy.protocol.codecs import CODECS, codec_for
from proxy.protocol.sse import SSEDecoder
from proxy.protocol.translators import (
    TRANSLATORS,
    CountTokensTranslator,
    MessagesTranslator,
    Translator,
)

pytestmark = pytest.mark.unit

CHAT: dict[str, Any] = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Paris " * 200},
         "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]},
         "logprobs": None, "finish_reason": "tool_calls"},
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
}
MESSAGE: dict[str, Any] = {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
    "content": [
        {"type": "thinking", "thinking": "hmm " * 300, "signature": "sig"},
        {"type": "text", "text": "Hello " * 300},
        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": ["a", 1]}},
    ],
    "stop_reason": "tool_use", "stop_sequence": None,
    "usage": {"input_tokens": 9, "output_tokens": 30, "cache_read_input_tokens": 0},
}


def _events(raw: bytes) -> list[dict[str, Any]]:
    decoder = SSEDecoder()
    return [json.loads(e.data) for e in [*decoder.feed(raw), *decoder.flush()]
            if e.data != b"[DONE]"]


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_round_trip(include_usage: bool) -> None:
    raw = codec_for("chat").replay(CHAT, include_usage=include_usage)
    assert raw.endswith(b"data: [DONE]\n\n")
    usage_chunks = [e for e in _events(raw) if e.get("usage")]
    assert len(usage_chunks) == (1 if include_usage else 0)
    again = codec_for("chat").assemble_stream(raw)
    expected = CHAT if include_usage else {k: v for k, v in CHAT.items() if k != "usage"}
    assert again == expected
    assert codec_for("chat").finished(CHAT, capped_ok=False)


def test_text_completion_round_trip() -> None:
    answer = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "text": "abc " * 400, "logprobs": None,
                           "finish_reason": "length"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
    assert codec_for("text_completion").assemble_stream(codec_for("text_completion").replay(answer, include_usage=True)) == answer
    assert not codec_for("text_completion").finished(answer, capped_ok=False)
    assert codec_for("text_completion").finished(answer, capped_ok=True)


def test_messages_round_trip() -> None:
    raw = codec_for("messages").replay(MESSAGE, include_usage=False)
    names = [e["type"] for e in _events(raw)]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert codec_for("messages").assemble_stream(raw) == MESSAGE
    assert codec_for("messages").finished(MESSAGE, capped_ok=False)
    assert not codec_for("messages").finished({**MESSAGE, "stop_reason": "max_tokens"},
                                 capped_ok=False)


def test_cut_or_failed_streams_are_not_answers() -> None:
    raw = codec_for("messages").replay(MESSAGE, include_usage=False)
    assert codec_for("messages").assemble_stream(raw[: raw.index(b"event: message_stop")]) is None
    error = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error"}}\n\n'
    assert codec_for("messages").assemble_stream(raw[:200] + error) is None
    chat = codec_for("chat").replay(CHAT, include_usage=False)
    cut = chat[: chat.index(b'"finish_reason":"stop"')]
    cut = cut[: cut.rindex(b"data: ")]
    answer = codec_for("chat").assemble_stream(cut)
    assert answer is not None and not codec_for("chat").finished(answer, capped_ok=True)
    assert codec_for("chat").assemble_stream(b"data: {not json\n\n") is None
    assert codec_for("chat").answer_of(b"[1, 2]") is None


def test_redaction_reaches_the_texts_only() -> None:
    pattern = redaction(("[A-Za-z]+",))
    message = codec_for("messages").redacted(MESSAGE, pattern)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["content"][1]["text"].strip().split() == ["[REDACTED]"] * 300
    assert message["content"][2]["input"] == {"q": ["[REDACTED]", 1]}
    assert message["stop_reason"] == "tool_use" and message["id"] == "msg_1"
    chat = codec_for("chat").redacted(CHAT, pattern)
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert "Paris" not in chat["choices"][0]["message"]["content"]
    call = chat["choices"][1]["message"]["tool_calls"][0]
    assert call["id"] == "call_1" and call["type"] == "function"
    # A tool's name and arguments are texts the model wrote, redacted like the rest.
    assert call["function"] == {"name": "[REDACTED]", "arguments": '{"[REDACTED]": "[REDACTED]"}'}
    assert CHAT["choices"][1]["message"]["tool_calls"][0]["function"]["name"] == "lookup"


def test_streams_framed_otherwise_are_read_by_the_sse_decoder() -> None:
    raw = codec_for("chat").replay(CHAT, include_usage=True)
    assert codec_for("chat").assemble_stream(raw.replace(b"\n", b"\r\n")) == CHAT
    # An event whose JSON is split over two data lines (SSE joins them with a newline).
    first = raw.index(b"data: ") + len(b"data: ")
    comma = raw.index(b",", first)
    split = raw[:comma + 1] + b"\ndata: " + raw[comma + 1:]
    assert codec_for("chat").assemble_stream(split) == CHAT


def test_ended_reads_the_finish_reasons_off_the_bytes_as_finished_does() -> None:
    for operation, answer in (("chat", CHAT), ("messages", MESSAGE)):
        for capped_ok in (False, True):
            for raw in (codec_for("chat").body(answer), codec_for(operation).replay(answer, include_usage=True),
                        json.dumps(answer, indent=2).encode()):  # spaced as some upstreams do
                assert codec_for(operation).ended(raw, capped_ok) == codec_for(operation).finished(answer, capped_ok)
    capped = {**MESSAGE, "stop_reason": "max_tokens"}
    assert not codec_for("messages").ended(codec_for("chat").body(capped), capped_ok=False)
    assert codec_for("messages").ended(codec_for("chat").body(capped), capped_ok=True)
    chat = codec_for("chat").replay(CHAT, include_usage=False)
    assert not codec_for("chat").ended(chat[: chat.index(b'"finish_reason":"stop"')], True)
    # Text the model wrote that looks like a finish reason is escaped inside its string.
    said = {**CHAT, "choices": [{**CHAT["choices"][0], "message": {
        "role": "assistant", "content": '"finish_reason":"length"'}}]}
    assert codec_for("chat").ended(codec_for("chat").body(said), capped_ok=False)


def test_each_api_shape_has_one_codec_for_its_reader_shape_and_wings() -> None:
    """The translator's codec (its reader's) is the one the cache and capture find by the
    operation, and the shape caps exactly the codec's cap fields."""
    translators: tuple[type[Translator], ...] = (*TRANSLATORS, MessagesTranslator,
                                                  CountTokensTranslator)
    assert {t.operation for t in translators} == set(CODECS)
    for translator in translators:
        codec = codec_for(translator.operation)
        assert translator.reader_type.codec is codec
        assert translator.shape_type.cap_fields == codec.cap_fields
        assert codec.streams == translator.streams


def test_redacted_json_finds_a_secret_escaped_inside_json_inside_json() -> None:
    """Tool arguments whose JSON holds a string that is JSON again, with the secret escaped
    there (`\\u0065` for `e`): decoded level by level, redacted, and written again."""
    def sub(text: str) -> str:
        return text.replace("secret", "[gone]")

    inner = '{"key": "s\\u0065cret"}'  # JSON text with the escape in it
    assert "secret" not in inner and json.loads(inner) == {"key": "secret"}
    args = json.dumps({"note": inner})
    assert "secret" not in sub(args)  # the patterns alone cannot see it
    out = redacted_json(args, sub)
    assert "secret" not in out and "s\\u0065cret" not in out
    assert json.loads(json.loads(out)["note"]) == {"key": "[gone]"}
    assert redacted_json({"a": [args, 3]}, sub)["a"][1] == 3
