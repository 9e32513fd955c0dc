"""A captured request as one frozen value: what the pipeline hands over, what the store keeps
(compressed JSON), what `tokenmeter captures` shows and exports. docs/capture.md gives the
format; this module is its one definition."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# 2: a stream may be kept as its raw chunks (`chunks`), its events and output made when read.
FORMAT_VERSION = 2


@dataclass(frozen=True, slots=True)
class Body:
    """Bytes as they went over the wire, decoded as UTF-8 (with replacement), redacted, and cut
    at `capture.max_body_kb` (`truncated` says so; `size` is the length before the cut)."""

    text: str
    size: int
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One SSE event as the client received it (its raw text, redacted) and when: milliseconds
    after the upstream request was sent."""

    at_ms: float
    text: str


@dataclass(frozen=True, slots=True)
class Chunks:
    """A stream as the client received it, as written: its whole text (redacted) and, for each
    write, the UTF-8 byte offset where it ended and when it came (microseconds after the
    upstream request was sent: integers, which JSON encodes five times faster than floats).
    What a capture stores of a stream: cutting it into events and reassembling the output are
    done when it is read (`proxy.capture.collect.completed`), not on the proxy's CPU for every
    request captured."""

    text: str
    ends: tuple[int, ...]
    at_us: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Capture:
    request_id: str  # the ledger row's
    started_at: float  # unix seconds
    api: str  # "openai" | "anthropic"
    path: str  # the route, e.g. "/v1/chat/completions"
    operation: str  # the ledger's operation ("chat", "messages", ...)
    user: str | None
    key_name: str | None
    team: str | None
    requested_model: str
    model: str | None  # sent upstream (after routing and fallback)
    stream: bool
    status: int
    error_class: str  # ErrorClass value; "none" when it succeeded
    request: Body  # as the client sent it
    upstream_request: Body | None  # as sent upstream (the cap the proxy wrote), if it was
    response: Body | None  # a JSON answer (or the upstream's error body) as the client got it
    events: tuple[StreamEvent, ...] = ()  # a stream's events, bounded like a body
    events_truncated: bool = False
    # The reassembled output of a stream: its text, tool calls and reasoning where the API
    # exposes them.
    output_text: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    reasoning: str | None = None
    refusal: str | None = None  # a refusal the model streamed in place of an answer
    upstream_error: Body | None = None  # the upstream's error body, when it sent one
    # The request's tags (proxy.config.tags), as in its ledger row; a capture written before
    # tags existed reads as none.
    tags: dict[str, str] = field(default_factory=dict)
    version: int = field(default=FORMAT_VERSION)
    # The stream not yet cut into `events` (as written; None once read: see `Chunks`).
    chunks: Chunks | None = None
    # The upstream's own id of the request (its `x-request-id` / `request-id`, what the SDKs
    # show as `request_id`), as in the ledger row; None: none was sent, or written before.
    upstream_request_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        # By hand, not dataclasses.asdict: that deep-copies every value, some 150 us for a
        # stream of 64 events, on every capture written.
        out = {f: getattr(self, f) for f in _FIELDS}
        for name in ("request", "upstream_request", "response", "upstream_error"):
            body = out[name]
            if body is not None:
                out[name] = {"text": body.text, "size": body.size, "truncated": body.truncated}
        out["events"] = [{"at_ms": e.at_ms, "text": e.text} for e in self.events]
        out["tool_calls"] = list(self.tool_calls)
        if self.chunks is None:
            del out["chunks"]
        else:
            c = self.chunks
            out["chunks"] = {"text": c.text, "ends": c.ends, "at_us": c.at_us}
        return out

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Capture:
        def body(x: Any) -> Body | None:
            return None if x is None else Body(**x)

        def chunks(x: Any) -> Chunks | None:
            return None if x is None else Chunks(x["text"], tuple(x["ends"]), tuple(x["at_us"]))

        return Capture(**{
            **obj,
            "request": Body(**obj["request"]),
            "upstream_request": body(obj.get("upstream_request")),
            "response": body(obj.get("response")),
            "upstream_error": body(obj.get("upstream_error")),
            "events": tuple(StreamEvent(**e) for e in obj.get("events", ())),
            "tool_calls": tuple(obj.get("tool_calls", ())),
            "chunks": chunks(obj.get("chunks")),
        })


_FIELDS = tuple(f.name for f in fields(Capture))
