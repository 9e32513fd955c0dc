"""The recorded-stream corpus (tests/protocol/streams/<api>/): every stream there, with the
answer the same request had when not streamed, read by the API's reader and codec.

For each `<name>.sse` (the stream's bytes as the upstream wrote them) and `<name>.json` (the
non-streamed answer):
- the reader's texts (what its codec's walker finds in the events the reader held as content)
  equal the assembled answer's, by kind and place, and its usage is the answer's;
- a replay of the assembled answer, read again, gives the same texts and usage (round trip);
- the assembled answer equals the recorded one as far as a stream can say: every text by kind
  and place (a tool's input compared as JSON values), every finish reason, the usage, the
  model (ids, timestamps and a stream's own fields, such as logprobs, are not compared);
- redaction of the assembled answer (capture's default patterns) leaves no secret in any text
  kind, and every text the walker finds there was redacted where it held one.

A new shape or case is two files in the corpus, not a test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.capture.redact import Redactor
from proxy.config.capture import DEFAULT_REDACT
from proxy.protocol.anthropic import MessagesReader
from proxy.protocol.codec import Codec, Text, TextKind, joined, stream_objects
from proxy.protocol.codecs import codec_for
from proxy.protocol.readers import ChatReader, CompletionsReader, Reader, ResponsesReader
from proxy.protocol.request import parse_body
from proxy.protocol.sse import SSEDecoder

pytestmark = pytest.mark.unit

STREAMS = Path(__file__).parent / "streams"
_APIS: dict[str, tuple[str, type[Reader]]] = {
    "chat": ("chat", ChatReader),
    "completions": ("text_completion", CompletionsReader),
    "responses": ("responses", ResponsesReader),
    "messages": ("messages", MessagesReader),
}
_REDACT = Redactor.of(DEFAULT_REDACT)
# The texts a stream names outside its content deltas (an Anthropic tool_use's name comes in
# its content_block_start, a Responses function call's in output_item.added): the reader, which
# holds content deltas only, does not count them.
_NAMED_APART = {"messages", "responses"}

CASES = sorted(STREAMS.glob("*/*.sse"))


def _case_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def test_the_corpus_has_every_shape_asked_for() -> None:
    names = {_case_id(p) for p in CASES}
    assert {p.parent.name for p in CASES} == set(_APIS)
    for wanted in ("chat/reasoning_content", "chat/reasoning", "chat/refusal",
                   "chat/parallel_tool_calls", "chat/n2", "chat/crlf", "chat/empty_deltas",
                   "chat/content_usage_only_final", "chat/escaped_tool_arguments",
                   "completions/text", "completions/n2",
                   "responses/text", "responses/refusal",
                   "responses/reasoning_and_parallel_tool_calls",
                   "messages/thinking_and_tool_use", "messages/citations"):
        assert wanted in names
    assert any(b"\r\n" in p.read_bytes() for p in CASES)
    for path in CASES:
        assert path.with_suffix(".json").exists(), path


def _read(reader_type: type[Reader], raw: bytes, n: int) -> Reader:
    """The reader of a request for `n` choices, fed the stream as the tap feeds it."""
    body: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": 100}
    if n > 1:
        body["n"] = n
    request = parse_body(json.dumps(body).encode())
    reader = reader_type(request, "gpt-4o", sampled=False)
    decoder = SSEDecoder()
    # A chunk per 97 bytes: events cut anywhere, a CRLF split between two chunks too.
    for at in range(0, len(raw), 97):
        for event in decoder.feed(raw[at:at + 97]):
            reader.on_event(event.data, event.event)
    for event in decoder.flush():
        reader.on_event(event.data, event.event)
    assert reader.end_of_stream()
    return reader


def _normal(texts: dict[tuple[TextKind, tuple[Any, ...]], str]) -> dict[Any, Any]:
    """Texts to compare: a tool's arguments as the JSON value they spell."""
    out: dict[Any, Any] = {}
    for key, text in texts.items():
        if key[0] is TextKind.TOOL_ARGS:
            try:
                out[key] = json.loads(text)
                continue
            except ValueError:
                pass
        out[key] = text
    return out


def _walked(codec: Codec, objs: list[dict[str, Any]]) -> dict[Any, Any]:
    return _normal(joined(t for obj in objs for t in codec.texts(obj)))


def _held(codec: Codec, reader: Reader) -> dict[Any, Any]:
    return _walked(codec, [json.loads(e) for e in reader.output.events])


def _choices(answer: dict[str, Any]) -> int:
    return len(answer.get("choices") or ()) or 1


def _answer_texts(codec: Codec, answer: dict[str, Any], api: str) -> dict[Any, Any]:
    texts = _walked(codec, [answer])
    if api in _NAMED_APART:
        texts = {k: v for k, v in texts.items() if k[0] is not TextKind.TOOL_NAME}
    return texts


@pytest.mark.parametrize("path", CASES, ids=_case_id)
def test_the_readers_texts_are_the_assembled_answers(path: Path) -> None:
    api = path.parent.name
    operation, reader_type = _APIS[api]
    codec = codec_for(operation)
    raw = path.read_bytes()
    answer = codec.assemble_stream(raw)
    assert answer is not None
    reader = _read(reader_type, raw, _choices(answer))
    assert reader.complete
    assert _held(codec, reader) == _answer_texts(codec, answer, api)
    assert _held(codec, reader)  # every stream of the corpus says something
    # Every event's texts, the names included, are the answer's.
    events = stream_objects(raw)
    assert events is not None
    assert _walked(codec, events) == _walked(codec, [answer])
    assert reader.usage(lambda: 0) == codec.usage(answer)
    assert reader.usage(lambda: 0).source == "reported"


@pytest.mark.parametrize("path", CASES, ids=_case_id)
def test_a_replay_of_the_assembled_answer_reads_the_same(path: Path) -> None:
    api = path.parent.name
    operation, reader_type = _APIS[api]
    codec = codec_for(operation)
    raw = path.read_bytes()
    answer = codec.assemble_stream(raw)
    assert answer is not None
    first = _read(reader_type, raw, _choices(answer))
    replayed = codec.replay(answer, include_usage=True)
    again = _read(reader_type, replayed, _choices(answer))
    assert again.complete
    assert _held(codec, again) == _held(codec, first)
    assert again.usage(lambda: 0) == first.usage(lambda: 0)
    # And assembled again, the replay is the same answer, for every text and finish.
    reassembled = codec.assemble_stream(replayed)
    assert reassembled is not None
    assert _walked(codec, [reassembled]) == _walked(codec, [answer])
    assert codec.finish_reasons(reassembled) == codec.finish_reasons(answer)
    assert codec.ended(replayed, capped_ok=True) == codec.finished(answer, capped_ok=True)


@pytest.mark.parametrize("path", CASES, ids=_case_id)
def test_the_assembled_answer_is_the_non_streamed_one(path: Path) -> None:
    codec = codec_for(_APIS[path.parent.name][0])
    answer = codec.assemble_stream(path.read_bytes())
    recorded = json.loads(path.with_suffix(".json").read_text())
    assert answer is not None
    assert _walked(codec, [answer]) == _walked(codec, [recorded])
    assert codec.finish_reasons(answer) == codec.finish_reasons(recorded)
    assert codec.finish_reasons(answer)
    assert codec.usage(answer) == codec.usage(recorded)
    assert answer.get("model") == recorded.get("model")
    # What a cache stores is decided the same on either form, read or scanned.
    for capped_ok in (False, True):
        assert codec.finished(answer, capped_ok) == codec.finished(recorded, capped_ok)
        assert codec.ended(path.read_bytes(), capped_ok) == codec.finished(answer, capped_ok)


def _strings(value: Any) -> list[str]:
    """Every string in a JSON value, and in the JSON a string spells (a tool's arguments)."""
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


def _secret(text: str) -> bool:
    """`text` holds a secret, as written or once its JSON is decoded (an escape such as
    `\\u0040` for `@` hides it from a pattern, not from whoever reads it)."""
    return any(_REDACT.spans(s) for s in _strings(text))


@pytest.mark.parametrize("path", CASES, ids=_case_id)
def test_redaction_leaves_no_secret_in_any_text_kind(path: Path) -> None:
    codec = codec_for(_APIS[path.parent.name][0])
    answer = codec.assemble_stream(path.read_bytes())
    assert answer is not None
    before = list(codec.texts(answer))
    redacted = codec.redacted(answer, _REDACT)
    after = list(codec.texts(redacted))
    assert [(t.kind, t.at) for t in after] == [(t.kind, t.at) for t in before]
    for old, new in zip(before, after, strict=True):
        assert not _secret(new.text), (new.kind, new.text)
        assert (new.text == old.text) == (not _secret(old.text)), (new.kind, old.text)
    assert answer == codec.assemble_stream(path.read_bytes())  # the original is untouched


def test_the_corpus_holds_a_secret_in_every_text_kind() -> None:
    """So that the redaction test above has something to find in each kind."""
    kinds: set[TextKind] = set()
    for path in CASES:
        codec = codec_for(_APIS[path.parent.name][0])
        answer = codec.assemble_stream(path.read_bytes())
        assert answer is not None
        texts: list[Text] = list(codec.texts(answer))
        kinds |= {t.kind for t in texts if _secret(t.text)}
    assert kinds == set(TextKind) - {TextKind.TOOL_NAME}
