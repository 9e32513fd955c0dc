"""What one request sent and received, kept while it runs for a possible capture.

Capture is decided at settle (a failed request is kept when `errors: always`), so while capture
is enabled every request keeps its bytes as they pass, each part bounded by `max_body_kb`: the
client's body, the body sent upstream, and the answer (a JSON body, or a stream's chunks with
their arrival offsets). Nothing is parsed, decoded or redacted on the request path; settle hands
the `Collector` to the capture writer (`Pending`), which turns it into a `Capture` off the loop
(`record`, a batch at a time): every text redacted and bounded, a stream kept as its chunks.
Cutting a stream into its events and reassembling its output wait until it is read
(`completed`), unless the stream's texts hold something to redact that its events split between
them (a key or an address streamed token by token, in the text, a tool call's arguments, the
reasoning...): then the events that carry its pieces are rewritten at record time, the secret's
pieces dropped and `[REDACTED]` in the first's place, so that no field of the capture holds it,
joined or not."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

from multidict import CIMultiDictProxy

from proxy.auth import KEY_HEADERS
from proxy.capture.record import Body, Capture, Chunks, StreamEvent
from proxy.capture.redact import REDACTED, Redactor
from proxy.protocol.codec import (
    Codec,
    Shown,
    TextKind,
    loads_all,
    redacted_json,
    stream_datas,
    timed_events,
)
from proxy.protocol.codecs import codec_for


class Collector:
    """One request's bytes, bounded; owned by the request (written only as its bytes pass)."""

    __slots__ = ("_chunk_bytes", "answer", "api", "chunks", "chunks_cut", "keys", "limit",
                 "path", "request", "upstream")

    def __init__(self, limit_bytes: int, api: str = "openai", path: str = "",
                 keys: tuple[str, ...] = ()) -> None:
        self.limit = limit_bytes
        self.api, self.path = api, path  # the client's API shape and route
        # The keys the client sent (`sent_keys`): removed from the capture literally, whatever
        # they look like; never written anywhere.
        self.keys = keys
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


def sent_keys(headers: CIMultiDictProxy[str]) -> tuple[str, ...]:
    """Every value of every header a client's key comes in (proxy.auth.KEY_HEADERS; a bearer
    token without its scheme), each line of a repeated header too: what a capture of the
    request removes literally, the key authentication took and any other the client sent."""
    found: list[str] = []
    for name in KEY_HEADERS:
        for line in headers.getall(name, ()):
            value = (line.partition(" ")[2] if name == "Authorization" else line).strip()
            if value:
                found.append(value)
    return tuple(found)


@functools.lru_cache(maxsize=8)
def _compiled(patterns: tuple[str, ...], keys: tuple[str, ...]) -> Redactor:
    return Redactor.of(patterns, keys)


def redactor(patterns: list[str], keys: Iterable[str | None] = ()) -> Redactor:
    """`capture.redact` (and the known `keys`, removed literally) as one redactor, called as a
    function: every match replaced by `[REDACTED]` (compiled once per pattern list and keys;
    proxy.capture.redact is the one definition of redaction)."""
    return _compiled(tuple(patterns), tuple(k for k in keys if k))


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
    upstream_request_id: str | None = None  # the upstream's id of it, as in its ledger row




def _body(kept: tuple[bytes, int] | None, limit: int, redact: Callable[[str], str]) -> Body | None:
    if kept is None:
        return None
    data, size = kept
    text = _deep(redact(data.decode("utf-8", "replace")), redact)
    cut = size > limit or len(text.encode()) > limit
    if cut:
        text = text.encode()[:limit].decode("utf-8", "ignore")
    return Body(text, size, cut)


def record(collected: Collector, meta: Meta, redact: Redactor) -> Capture:
    """The capture of a settled request (CPU work: run it off the event loop). A stream is kept
    as its chunks, redacted in one pass over its whole text; it is cut into events and its
    output reassembled when read (`completed`). Only when the redaction changed the stream's
    text (a chunk's offsets would no longer hold), it is not UTF-8, or its events split a
    secret between them (`_unsplit`) is it cut here, event by event."""
    limit = collected.limit
    codec = codec_for(meta.operation)
    redact = redact.with_keys(collected.keys)
    unsplit = _unsplit(codec, collected.chunks, redact)
    chunks = None if unsplit is not None else _chunks(collected.chunks, redact)
    events: tuple[StreamEvent, ...] = ()
    output: dict[str, Any] = {}
    if chunks is None:  # nothing streamed, or a stream that must be cut here
        framed = unsplit if unsplit is not None else (
            timed_events(collected.chunks) if collected.chunks else [])
        if framed:
            events = _redacted_events(framed, redact)
        output = _output_fields(_shown(codec, [data for _, _, data in framed]), meta.stream,
                                redact)
    response = _body(collected.answer, limit, redact)
    return Capture(
        request_id=meta.request_id, started_at=meta.started_at, api=meta.api, path=meta.path,
        operation=meta.operation, user=meta.user, key_name=meta.key_name, team=meta.team,
        requested_model=meta.requested_model, model=meta.model, stream=meta.stream,
        status=meta.status, error_class=meta.error_class, tags=dict(meta.tags),
        upstream_request_id=meta.upstream_request_id,
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


def _shown(codec: Codec, datas: list[bytes]) -> Shown:
    """What the capture shows of a stream's events (their data): the codec's view."""
    return codec.shown(loads_all([d for d in datas if d[:1] == b"{"]))


def _output_fields(output: Shown, stream: bool,
                   redact: Callable[[str], str]) -> dict[str, Any]:
    # Every text kind redacted, a tool call's arguments, name and id included.
    return {"output_text": redact(output.text) if stream else None,
            "tool_calls": tuple(redacted_json(call, redact) for call in output.tool_calls),
            "reasoning": redact(output.reasoning) if output.reasoning else None,
            "refusal": redact(output.refusal) if output.refusal else None}


def _deep(text: str, redact: Callable[[str], str]) -> str:
    """A JSON body's text whose strings, decoded, still hold something to redact (a secret
    the escaping hid from the patterns: `\\u0040` for `@`, a key inside a JSON string inside
    JSON) made again from its redacted value; any other text as it is. Only a text with an
    escape can hide anything, so only that is parsed."""
    if "\\" not in text:
        return text
    try:
        value = json.loads(text)
        redacted = redacted_json(value, redact)
    except (ValueError, RecursionError):
        return text  # not JSON, cut at the limit, or nested past what is walked
    if redacted == value:
        return text
    return redact(json.dumps(redacted, ensure_ascii=False))


def _redact_joined(codec: Codec, objs: list[dict[str, Any]], redact: Redactor) -> set[int]:
    """Each text's pieces (the codec's walker over `objs`, events' data parsed) joined across
    the events, as a client joins them, and looked at: a secret found is taken out of the
    pieces, in place (`_cut`). Returns the events changed."""
    texts: dict[tuple[TextKind, tuple[Any, ...]], list[tuple[int, Any, Any, str]]] = {}
    walk = codec.texts
    for n, obj in enumerate(objs):
        for kind, at, holder, field, text in walk(obj):
            key = (kind, at)
            pieces = texts.get(key)
            if pieces is None:
                pieces = texts[key] = []
            pieces.append((n, holder, field, text))
    changed: set[int] = set()
    for (kind, _), pieces in texts.items():
        olds = [piece for _, _, _, piece in pieces]
        whole = "".join(olds)
        spans = redact.spans(whole)
        if spans:
            news = _cut(olds, spans)
        elif kind is TextKind.TOOL_ARGS and "\\" in whole and (
                hidden := redacted_json(whole, redact)) != whole:
            # A secret its JSON escapes hid from the patterns: the arguments are written again
            # from their redacted value, whole, in the first piece.
            news = [hidden, *[""] * (len(olds) - 1)]
        else:
            continue
        for (n, holder, field, old), new in zip(pieces, news, strict=True):
            if new != old:
                holder[field] = new
                changed.add(n)
    return changed


def _datas(raw: bytes) -> list[bytes]:
    """The JSON objects' data among a whole stream's events, framed in one call."""
    return [d for d in stream_datas(raw) if d[:1] == b"{"]  # `[DONE]` would slow loads_all


def _unsplit(codec: Codec, chunks: list[tuple[float, bytes]],
             redact: Redactor) -> list[tuple[float, bytes, bytes]] | None:
    """The stream's events with every secret its texts hold removed, when some text (the
    pieces of one text joined across the events, as a client reassembles them) holds one;
    None when none does (then redacting the stream's text, as written, is enough). The look
    is one framing and one JSON parse of the whole stream; only a stream that holds a secret
    is cut into its timed events and those that carry its pieces made again."""
    if not chunks or not _redact_joined(
            codec, loads_all(_datas(b"".join([data for _, data in chunks]))), redact):
        return None
    framed = timed_events(chunks)
    objs = loads_all([data for _, _, data in framed])
    out = list(framed)
    for n in _redact_joined(codec, objs, redact):
        at, raw, _ = framed[n]
        data = json.dumps(objs[n], ensure_ascii=False, separators=(",", ":")).encode()
        kept = [line for line in raw.split(b"\n") if not line.startswith(b"data:")]
        out[n] = (at, b"\n".join([*kept, b"data: " + data]), data)
    return out


def _cut(texts: list[str], spans: list[tuple[int, int]]) -> list[str]:
    """`texts` (pieces of one text) with the parts `spans` (of the joined text) covers taken
    out: `[REDACTED]` where a span starts, nothing where it goes on into later pieces."""
    out: list[str] = []
    start = 0
    for text in texts:
        end = start + len(text)
        parts: list[str] = []
        at = start
        for a, b in spans:
            if b <= start or a >= end:
                continue
            parts.append(text[at - start : max(a, start) - start])
            if a >= start:
                parts.append(REDACTED)
            at = min(b, end)
        parts.append(text[at - start :])
        out.append("".join(parts))
        start = end
    return out


def completed(capture: Capture, redact: Callable[[str], str]) -> Capture:
    """A capture as read: a stream kept as chunks cut into its events and its output
    reassembled. The output is redacted again: a secret split across two events matched no
    pattern in the stream's text, and may once its pieces are joined."""
    kept = capture.chunks
    if kept is None:
        return capture
    raw = kept.text.encode()
    starts = (0, *kept.ends[:-1])
    framed = timed_events([(at / 1000, raw[a:b])
                           for at, a, b in zip(kept.at_us, starts, kept.ends, strict=True)])
    output = _shown(codec_for(capture.operation), [data for _, _, data in framed])
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
    redact: Redactor  # the configured patterns and upstream keys (the client's: `collected`)

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
