"""The stream tap, sans I/O: what reaches the client and what gets metered, for every chunking."""

from __future__ import annotations

import json

import pytest

from proxy.meter import RequestMeter
from proxy.tap import StreamTap
from proxy.translators import ChatTranslator, parse_body


def _chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    obj = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


USAGE_EVENT = (
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
    b'"usage":{"prompt_tokens":11,"completion_tokens":3,"total_tokens":14}}\n\n'
)
HEAD = (
    _chunk({"role": "assistant", "content": ""})
    + _chunk({"content": "a"}) + _chunk({"content": "b"}) + _chunk({"content": "c"})
    + _chunk({}, "stop")
)
STREAM = HEAD + USAGE_EVENT + b"data: [DONE]\n\n"
STRIPPED = HEAD + b"data: [DONE]\n\n"


def _run(parts: list[bytes], client_asked: bool = False) -> tuple[bytes, ChatTranslator, int]:
    body: dict[str, object] = {"model": "m", "messages": [], "stream": True}
    if client_asked:
        body["stream_options"] = {"include_usage": True}
    tr = ChatTranslator(parse_body(json.dumps(body).encode()))
    meter = RequestMeter()
    tap = StreamTap(tr, meter)
    out = b""
    for i, part in enumerate(parts):
        if tap.passthrough(part):
            out += part
            tap.observe(part, float(i))
        else:
            out += tap.filter(part, float(i))
    out += tap.close()
    return out, tr, meter.chunks


def test_event_per_chunk_strips_usage_and_meters() -> None:
    parts = [e + b"\n\n" for e in STREAM.split(b"\n\n") if e]
    out, tr, chunks = _run(parts)
    assert out == STRIPPED
    assert chunks == 3
    u = tr.usage()
    assert (u.input_tokens, u.output_tokens, u.source) == (11, 3, "reported")


def test_client_asked_for_usage_gets_it() -> None:
    out, _, _ = _run([STREAM])
    out_asked, _, _ = _run([STREAM], client_asked=True)
    assert out == STRIPPED and out_asked == STREAM


def test_every_split_offset_never_corrupts_and_always_meters() -> None:
    usage_at = STREAM.index(USAGE_EVENT)
    marker_at = STREAM.index(b'"usage":{')
    for i in range(len(STREAM) + 1):
        out, tr, chunks = _run([STREAM[:i], STREAM[i:]])
        assert tr.usage().output_tokens == 3 and tr.usage().source == "reported", i
        assert chunks == 3, i
        if usage_at < i < marker_at + len(b"\"usage\":{"):
            # The usage event's first bytes went out before anything could know what it was;
            # it is then forwarded whole rather than cut.
            assert out in (STREAM, STRIPPED), i
        else:
            assert out == STRIPPED, i


def test_byte_by_byte() -> None:
    out, tr, chunks = _run([STREAM[i : i + 1] for i in range(len(STREAM))])
    assert out == STRIPPED and chunks == 3 and tr.usage().output_tokens == 3


def test_a_metering_bug_never_costs_the_client_its_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(ChatTranslator):
        calls = 0

        def on_event(self, data: bytes, name: str | None) -> int:
            Broken.calls += 1
            if Broken.calls == 3:
                raise RuntimeError("bug")
            return super().on_event(data, name)

    body = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
    errors: list[int] = []
    tap = StreamTap(Broken(parse_body(body)), RequestMeter(), on_error=lambda: errors.append(1))
    out = b""
    for part in [e + b"\n\n" for e in STREAM.split(b"\n\n") if e]:
        if tap.passthrough(part):
            out += part
            tap.observe(part, 0.0)
        else:
            out += tap.filter(part, 0.0)
    out += tap.close()
    # Every byte still reaches the client (the usage chunk too: stripping stops with metering).
    assert out == STREAM
    assert errors == [1]
    assert "metering failed mid-stream" in caplog.text
