"""What an API shape's wire format means, one `Codec` per shape (`proxy.protocol.apis`), found
by the request's operation in `proxy.protocol.codecs`.

A codec owns every fact of its answers that a wing needs: the one walker over the texts an
answer or a stream's event carries, typed by kind (`texts`), a stream's events assembled into
the answer a non-streamed request would have had (`assemble`), an answer replayed as the API's
stream (`replay`), whether an answer ended by itself (`finished`, `ended`), the request's
output-cap fields, and what a capture shows of a stream (`shown`). The readers count what the
walker yields, the cache fills with `assemble` and answers hits with `replay`, capture shows
`shown` and redacts every text the walker finds. A new text in an API (a new delta field) is
one edit, in its codec's walker.

A codec is stateless and pure: its work is bounded by the bytes it is given, so a wing can bound
it by what it keeps, and calls it off the event loop for a large body.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, overload

from proxy.protocol.sse import stream_datas, timed_events
from proxy.protocol.usage import Usage, parse_usage

__all__ = ["Codec", "Shown", "Text", "TextKind", "loads", "loads_all", "redacted_json",
           "stream_datas", "stream_objects", "timed_events"]


class TextKind(enum.Enum):
    """Every kind of text an answer can carry (what the model wrote, and is billed for)."""

    OUTPUT = "output"
    REASONING = "reasoning"
    REFUSAL = "refusal"
    TOOL_NAME = "tool_name"
    TOOL_ARGS = "tool_args"


class Text(NamedTuple):
    """One text of an answer, or one piece of it in a stream's event.

    `at` says which text of the answer it is (a choice's content, a tool call of a choice, a
    content block, an output item's part): the pieces of one text across a stream's events share
    it, and joined in order they are the assembled answer's text with the same `at`. `holder`
    and `field` are where it lies (`holder[field]`), for a caller that rewrites it (redaction).
    The value there is `text` itself, except for a tool's input given as a JSON value (an
    Anthropic answer's `tool_use.input`): then `text` is its JSON."""

    kind: TextKind
    at: tuple[Any, ...]
    holder: Any
    field: Any
    text: str


@dataclass(frozen=True, slots=True)
class Shown:
    """What a capture shows of a stream: its texts joined by kind, its tool calls by call."""

    text: str
    reasoning: str
    refusal: str
    tool_calls: tuple[dict[str, Any], ...]


def loads(data: bytes | str) -> dict[str, Any]:
    """A JSON object, or {} for anything else: an answer is read, never refused."""
    try:
        obj = json.loads(data)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def loads_all(events: list[bytes]) -> list[dict[str, Any]]:
    """`loads` of each event. One JSON array is parsed in one call, twice as fast as one call
    per event; if that is not exactly one object per event, they are parsed one by one."""
    try:
        objs = json.loads(b"[" + b",".join(events) + b"]")
    except ValueError:
        objs = None
    if not isinstance(objs, list) or len(objs) != len(events):
        return [loads(e) for e in events]
    return [o if isinstance(o, dict) else {} for o in objs]


def stream_objects(raw: bytes) -> list[dict[str, Any]] | None:
    """A whole stream's events parsed, `[DONE]` left out; None if any other event is not a JSON
    object (a stream this codec cannot read whole)."""
    datas = [d for d in stream_datas(raw) if d != b"[DONE]"]
    try:
        objs = json.loads(b"[" + b",".join(datas) + b"]")
    except ValueError:
        return None
    if not isinstance(objs, list) or len(objs) != len(datas):
        return None
    return objs if all(isinstance(o, dict) for o in objs) else None


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def data_event(obj: Any) -> bytes:
    """One unnamed SSE event (OpenAI's Chat and Completions streams)."""
    return b"data: " + dumps(obj) + b"\n\n"


def named_event(name: str, obj: Any) -> bytes:
    """One named SSE event (Anthropic's Messages and OpenAI's Responses streams)."""
    return b"event: " + name.encode() + b"\ndata: " + dumps(obj) + b"\n\n"


# A text delta per this many characters in a replay: a stream of a long answer is several
# events, as the SDKs expect, without one event per token.
PIECE = 512


def pieces(text: str) -> list[str]:
    return [text[i:i + PIECE] for i in range(0, len(text), PIECE)] or [""]


def joined(texts: Iterable[Text]) -> dict[tuple[TextKind, tuple[Any, ...]], str]:
    """Each text's pieces joined, by kind and place, in the order they came."""
    out: dict[tuple[TextKind, tuple[Any, ...]], list[str]] = {}
    for t in texts:
        out.setdefault((t.kind, t.at), []).append(t.text)
    return {key: "".join(parts) for key, parts in out.items()}


@overload
def redacted_json(value: str, sub: Callable[[str], str]) -> str: ...


@overload
def redacted_json(value: Any, sub: Callable[[str], str]) -> Any: ...


def redacted_json(value: Any, sub: Callable[[str], str]) -> Any:
    """`value` (decoded JSON, or a text) with `sub` applied to every string in it. A string
    that is itself JSON with an escape in it (a tool's arguments, JSON inside a JSON string)
    is decoded and redacted the same way, since an escape can hide something from `sub`
    (`\\u0040` for `@`): when that changes anything, it is written again from its redacted
    value."""
    if isinstance(value, str):
        if value[:1] in ("{", "[") and "\\" in value:
            try:
                inner = json.loads(value)
            except (ValueError, RecursionError):
                return sub(value)
            redacted = redacted_json(inner, sub)
            if redacted != inner:
                return sub(json.dumps(redacted, ensure_ascii=False))
        return sub(value)
    if isinstance(value, dict):
        return {k: redacted_json(v, sub) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted_json(v, sub) for v in value]
    return value


class Codec:
    """The base: an API shape whose answers carry no text and do not stream (Embeddings)."""

    operation: ClassVar[str]
    streams: ClassVar[bool] = False
    # Every request field that limits output tokens per choice, the preferred first.
    cap_fields: ClassVar[tuple[str, ...]] = ()
    # The finish reasons of an answer that ended by itself, and the one its cap ended it with.
    natural: ClassVar[frozenset[str]] = frozenset()
    capped: ClassVar[str | None] = None
    # A finish reason as the upstream writes it, in an answer's body or a stream's events.
    # Inside a JSON string its quotes would be escaped: text the model wrote never matches.
    finish_mark: ClassVar[re.Pattern[bytes] | None] = None

    def texts(self, obj: dict[str, Any]) -> Iterable[Text]:
        """The one walker: the non-empty texts of an answer, or the pieces a stream's event
        carries, typed by kind, in the order a client reads them."""
        return ()

    def assemble(self, events: list[dict[str, Any]]) -> dict[str, Any] | None:
        """A stream's events (parsed, `[DONE]` left out) made into the answer a non-streamed
        request would have had; None for a stream that is not a whole answer (cut, failed)
        or of a shape this codec does not know."""
        return None

    def replay(self, answer: dict[str, Any], *, include_usage: bool) -> bytes:
        """An answer as this API's stream (`include_usage`: the client asked for the usage in
        the stream, where the API makes that optional)."""
        raise ValueError(f"{self.operation} answers do not stream")

    def finish_reasons(self, answer: dict[str, Any]) -> list[Any]:
        """Why each generation of an answer ended, as the API says it."""
        return []

    def usage(self, answer: dict[str, Any]) -> Usage | None:
        """The usage an answer reports."""
        return parse_usage(answer.get("usage"))

    def finished(self, answer: dict[str, Any], capped_ok: bool) -> bool:
        """Every generation of the answer ended by itself (or by the client's own cap, when
        `capped_ok`)."""
        natural = self._natural(capped_ok)
        reasons = self.finish_reasons(answer)
        return bool(reasons) and all(r in natural for r in reasons)

    def ended(self, raw: bytes, capped_ok: bool) -> bool:
        """`finished` read off an answer's bytes (its JSON body or its stream) without parsing
        them: some finish reason was given and every one is natural (or the client's cap)."""
        if self.finish_mark is None:
            answer = self.answer_of(raw) or self.assemble_stream(raw)
            return answer is not None and self.finished(answer, capped_ok)
        natural = self._natural(capped_ok)
        reasons = self.finish_mark.findall(raw)
        return bool(reasons) and all(r.decode() in natural for r in reasons)

    def _natural(self, capped_ok: bool) -> frozenset[str]:
        if capped_ok and self.capped is not None:
            return self.natural | {self.capped}
        return self.natural

    def body(self, answer: dict[str, Any]) -> bytes:
        """An answer as its JSON body."""
        return dumps(answer)

    def answer_of(self, body: bytes) -> dict[str, Any] | None:
        """A JSON answer's body parsed; None if it is not a JSON object."""
        try:
            answer = json.loads(body)
        except ValueError:
            return None
        return answer if isinstance(answer, dict) else None

    def assemble_stream(self, raw: bytes) -> dict[str, Any] | None:
        """`assemble` of a whole stream's bytes, framed once."""
        events = stream_objects(raw)
        if events is None:
            return None
        try:
            return self.assemble(events)
        except (TypeError, KeyError, ValueError, AttributeError, IndexError):
            return None  # a shape this assembly does not know: no answer

    def asked_caps(self, body: dict[str, Any]) -> list[Any]:
        """The output caps a request's body sets itself, as it sets them."""
        return [body[f] for f in self.cap_fields if body.get(f) is not None]

    def redacted(self, answer: dict[str, Any], sub: Callable[[str], str]) -> dict[str, Any]:
        """A copy of `answer` with `sub` applied to every text the walker finds in it (each
        string of a tool's input given as a JSON value); ids, roles, finish reasons and usage
        are left as they are."""
        copy = json.loads(dumps(answer))
        for t in list(self.texts(copy)):
            value = t.holder[t.field]
            if t.kind is TextKind.TOOL_ARGS or not isinstance(value, str):
                t.holder[t.field] = redacted_json(value, sub)
            else:
                t.holder[t.field] = sub(value)
        assert isinstance(copy, dict)
        return copy

    def shown(self, events: Iterable[dict[str, Any]]) -> Shown:
        """What a capture shows of a stream (its events parsed, cut or whole): every text kind
        joined, tool calls by call with their name and arguments."""
        # Each text's pieces, by kind and place: the texts of several choices or blocks are
        # shown one after the other, not interleaved as their pieces came.
        texts: dict[TextKind, dict[tuple[Any, ...], list[str]]] = {
            TextKind.OUTPUT: {}, TextKind.REASONING: {}, TextKind.REFUSAL: {}}
        calls: dict[tuple[Any, ...], dict[str, Any]] = {}
        for event in events:
            for t in self.texts(event):
                if t.kind in texts:
                    texts[t.kind].setdefault(t.at, []).append(t.text)
                    continue
                call = calls.setdefault(t.at, {})
                call_id = self.call_id(event, t)
                if call_id is not None:
                    call["id"] = call_id
                if t.kind is TextKind.TOOL_NAME:
                    call["name"] = call.get("name", "") + t.text
                else:
                    call["arguments"] = call.get("arguments", "") + t.text
        text, reasoning, refusal = (
            "".join("".join(parts) for parts in texts[kind].values())
            for kind in (TextKind.OUTPUT, TextKind.REASONING, TextKind.REFUSAL))
        return Shown(text, reasoning, refusal, tuple(calls.values()))

    def call_id(self, event: dict[str, Any], text: Text) -> str | None:
        """The id of the tool call a text of `event` belongs to, where the event gives it."""
        return None
