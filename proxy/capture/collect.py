"""What one request sent and received, kept while it runs for a possible capture.

Capture is decided at settle (a failed request is kept when `errors: always`), so while capture
is enabled every request keeps its bytes as they pass, each part bounded by `max_body_kb`: the
client's body, the body sent upstream, and the answer (a JSON body, or a stream's chunks with
their arrival offsets). Nothing is parsed, decoded or redacted on the request path; settle hands
the `Collector` to the capture writer (`Pending`), which turns it into a `Capture` off the loop
(`record`, a batch at a time): every text redacted and bounded, a stream kept as its chunks.
Cutting a stream into its events and reassembling its output wait until it is read
(`completed`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

from proxy.capture.record import Body, Capture, Chunks, StreamEvent
from proxy.capture.redact import Redactor
from proxy.protocol.sse import SSEDecoder


class Collector:
    """One request's bytes, bounded; owned by the request (written only as its bytes pass)."""

    __slots__ = ("_chunk_bytes", "answer", "api", "chunks", "chunks_cut", "limit", "path",
                 "request", "upstream")

    def __init__(self, limit_bytes: int, api: str = "openai", path: str = "") -> None:
        self.limit = limit_bytes
        self.api, self.path = api, path  # the client's API shape and route
        self.request: tuple[bytes, int] | None = None  # (kept bytes, size as sent)
        self.upstream: tuple[bytes, int] | None = None
        self.answer: tuple[bytes, int] | None = None
        self.chunks: list[tuple[float, bytes]] = []  # (ms after the upstream call, bytes)
        self.chunks_cut = False
        self._chunk_bytes = 0

    def _kept(self, data: bytes) -> tuple[bytes, int]:
        # One slice past the limit: the redaction at record time then sees a secret that the
        # cut would split, before the text is cut to the limit.
        return data[: self.limit + 256], len(data)

    def sent(self, raw: bytes) -> None:
        self.request = self._kept(raw)

    def forwarded(self, body: bytes) -> None:
        self.upstream = self._kept(body)

    def answered(self, body: bytes) -> None:
        self.answer = self._kept(body)

    def streamed(self, chunk: bytes, at_ms: float) -> None:
        if self._chunk_bytes >= self.limit:
            self.chunks_cut = True
            return
        self.chunks.append((at_ms, chunk))
        self._chunk_bytes += len(chunk)


@functools.lru_cache(maxsize=8)
def _compiled(patterns: tuple[str, ...]) -> Redactor:
    return Redactor.of(patterns)


def redactor(patterns: list[str]) -> Callable[[str], str]:
    """`capture.redact` as one function: every match replaced by `[REDACTED]` (compiled once
    per pattern list; proxy.capture.redact is the one definition of redaction)."""
    return _compiled(tuple(patterns)).text


@dataclass(frozen=True, slots=True)
class Meta:
    """What a capture says of its request besides its bytes: from the settlement."""

    request_id: str
    started_at: float
    api: str
    path: str
    operation: str
    user: str | None
    key_name: str | None
    team: str | None
    requested_model: str
    model: str | None
    stream: bool
    status: int
    error_class: str
    tags: tuple[tuple[str, str], ...] = ()  # the request's tags, as in its ledger row




def _body(kept: tuple[bytes, int] | None, limit: int, redact: Callable[[str], str]) -> Body | None:
    if kept is None:
        return None
    data, size = kept
    text = redact(data.decode("utf-8", "replace"))
    cut = size > limit or len(text.encode()) > limit
    if cut:
        text = text.encode()[:limit].decode("utf-8", "ignore")
    return Body(text, size, cut)


def events_of(chunks: list[tuple[float, bytes]]) -> list[tuple[float, bytes, bytes]]:
    """The stream's events as (arrival ms of the chunk that completed it, raw bytes, data)."""
    decoder = SSEDecoder()
    out: list[tuple[float, bytes, bytes]] = []
    pending = b""
    for at_ms, chunk in chunks:
        buf = pending + chunk
        start = 0
        shift = len(pending)
        for event in decoder.feed(chunk):
            end = shift + event.end
            out.append((at_ms, buf[start:end].strip(b"\r\n"), event.data))
            start = end
        pending = buf[start:]
    return out


def record(collected: Collector, meta: Meta, redact: Callable[[str], str]) -> Capture:
    """The capture of a settled request (CPU work: run it off the event loop). A stream is kept
    as its chunks, redacted in one pass over its whole text; it is cut into events and its
    output reassembled when read (`completed`). Only when the redaction changed the stream's
    text (a chunk's offsets would no longer hold) or it is not UTF-8 is it cut here, event by
    event."""
    limit = collected.limit
    chunks = _chunks(collected.chunks, redact)
    events: tuple[StreamEvent, ...] = ()
    output: dict[str, Any] = {}
    if chunks is None:  # nothing streamed, or a stream that must be cut here
        framed = events_of(collected.chunks) if collected.chunks else []
        if framed:
            events = _redacted_events(framed, redact)
        output = _output_fields(reassemble([data for _, _, data in framed]), meta.stream, redact)
    response = _body(collected.answer, limit, redact)
    return Capture(
        request_id=meta.request_id, started_at=meta.started_at, api=meta.api, path=meta.path,
        operation=meta.operation, user=meta.user, key_name=meta.key_name, team=meta.team,
        requested_model=meta.requested_model, model=meta.model, stream=meta.stream,
        status=meta.status, error_class=meta.error_class, tags=dict(meta.tags),
        request=_body(collected.request, limit, redact) or Body("", 0),
        upstream_request=_body(collected.upstream, limit, redact),
        response=response,
        events=events,
        events_truncated=collected.chunks_cut,
        upstream_error=response if meta.status >= 400 else None,
        chunks=chunks,
        **output,
    )


def _chunks(kept: list[tuple[float, bytes]], redact: Callable[[str], str]) -> Chunks | None:
    """The stream as written, when redaction leaves its text as it was (the usual case: then
    the chunks' offsets hold); None otherwise."""
    if not kept:
        return None
    raw = b"".join([data for _, data in kept])
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return None
    if redact(text) != text:
        return None
    return Chunks(text, tuple(accumulate([len(data) for _, data in kept])),
                  tuple([int(at_ms * 1000) for at_ms, _ in kept]))


def _output_fields(output: Output, stream: bool,
                   redact: Callable[[str], str]) -> dict[str, Any]:
    return {"output_text": redact(output.text) if stream else None,
            "tool_calls": output.tool_calls,
            "reasoning": redact(output.reasoning) if output.reasoning else None}


def completed(capture: Capture, redact: Callable[[str], str]) -> Capture:
    """A capture as read: a stream kept as chunks cut into its events and its output
    reassembled. The output is redacted again: a secret split across two events matched no
    pattern in the stream's text, and may once its pieces are joined."""
    kept = capture.chunks
    if kept is None:
        return capture
    raw = kept.text.encode()
    starts = (0, *kept.ends[:-1])
    framed = events_of([(at / 1000, raw[a:b])
                        for at, a, b in zip(kept.at_us, starts, kept.ends, strict=True)])
    output = reassemble([data for _, _, data in framed])
    return replace(capture, chunks=None,
                   events=tuple(StreamEvent(at, text.decode("utf-8", "replace"))
                                for at, text, _ in framed),
                   **_output_fields(output, capture.stream, redact))


@dataclass(frozen=True, slots=True)
class Pending:
    """A capture to be made: what settle hands the writer, which makes a batch of them in one
    trip to a thread (`record` is CPU work; one hop a request cost more than the work)."""

    collected: Collector
    meta: Meta
    redact: Callable[[str], str]

    def capture(self) -> Capture:
        return record(self.collected, self.meta, self.redact)


def _redacted_events(events: list[tuple[float, bytes, bytes]],
                     redact: Callable[[str], str]) -> tuple[StreamEvent, ...]:
    """The events' texts, redacted in one pass over the whole stream (a pass per event cost
    four times as much), unless a redaction ran across two events: then event by event."""
    texts = [raw.decode("utf-8", "replace") for _, raw, _ in events]
    joined = redact(_SEP.join(texts)).split(_SEP)
    if len(joined) != len(texts):
        joined = [redact(t) for t in texts]
    return tuple(StreamEvent(at, text) for (at, _, _), text in zip(events, joined, strict=True))


_SEP = "\n\n"  # what ends an event, so never inside one's text (its newlines are stripped)


@dataclass(frozen=True, slots=True)
class Output:
    text: str
    tool_calls: tuple[dict[str, Any], ...]
    reasoning: str


def reassemble(datas: list[bytes]) -> Output:
    """A stream's output from its events' data: OpenAI's chat (`choices[].delta`: content,
    tool_calls by index, reasoning_content) and Anthropic's Messages (`content_block_delta`:
    text_delta, input_json_delta, thinking_delta)."""
    text: list[str] = []
    reasoning: list[str] = []
    tools: dict[int, dict[str, Any]] = {}
    for data in datas:
        try:
            obj = json.loads(data)
        except ValueError:
            continue  # [DONE], pings
        if isinstance(obj, dict):
            _openai_delta(obj, text, reasoning, tools)
            _anthropic_delta(obj, text, reasoning, tools)
    calls = tuple(tools[i] for i in sorted(tools))
    return Output("".join(text), calls, "".join(reasoning))


def _openai_delta(obj: dict[str, Any], text: list[str], reasoning: list[str],
                  tools: dict[int, dict[str, Any]]) -> None:
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            continue
        if isinstance(delta.get("content"), str):
            text.append(delta["content"])
        if isinstance(delta.get("reasoning_content"), str):
            reasoning.append(delta["reasoning_content"])
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict) and isinstance(call.get("index"), int):
                _merge_call(tools.setdefault(call["index"], {}), call)


def _merge_call(into: dict[str, Any], part: dict[str, Any]) -> None:
    if part.get("id"):
        into["id"] = part["id"]
    fn = part.get("function")
    if isinstance(fn, dict):
        if fn.get("name"):
            into["name"] = fn["name"]
        if isinstance(fn.get("arguments"), str):
            into["arguments"] = into.get("arguments", "") + fn["arguments"]


def _anthropic_delta(obj: dict[str, Any], text: list[str], reasoning: list[str],
                     tools: dict[int, dict[str, Any]]) -> None:
    kind, index = obj.get("type"), obj.get("index")
    if kind == "content_block_start" and isinstance(index, int):
        block = obj.get("content_block")
        if isinstance(block, dict) and block.get("type") == "tool_use":
            tools[index] = {"id": block.get("id"), "name": block.get("name"), "arguments": ""}
        return
    delta = obj.get("delta")
    if kind != "content_block_delta" or not isinstance(delta, dict):
        return
    if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
        text.append(delta["text"])
    elif delta.get("type") == "thinking_delta" and isinstance(delta.get("thinking"), str):
        reasoning.append(delta["thinking"])
    elif (delta.get("type") == "input_json_delta" and isinstance(index, int)
          and isinstance(delta.get("partial_json"), str)):
        call = tools.setdefault(index, {"arguments": ""})
        call["arguments"] = call.get("arguments", "") + delta["partial_json"]
