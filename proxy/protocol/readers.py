"""Reading the upstream's answer, one reader per API shape: events in, usage and flags out.

A reader reads the response on the side of the relay (`on_event` per SSE event, or `on_body`
for a JSON response) and knows the request's usage: the upstream's own, else an estimate of the
output streamed (`proxy.protocol.output`) and of the prompt (counted by the request's shape). The
relay forwards the upstream's original bytes; readers only look at them.

The per-event path runs for every streamed chunk (14,000 a second on fast hardware), so after the
first content token the Chat and Completions readers classify events with substring tests
instead of parsing JSON. JSON is parsed only for the events that matter: until the first token,
events that carry `usage` or a `finish_reason`. Content events are handed raw to the output
estimate, which parses them only if an estimate is needed.
"""

from __future__ import annotations

import enum
import functools
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate, repeat
from typing import Any, ClassVar, Protocol

from proxy.errors import ErrorClass
from proxy.protocol.apis import chat, completions, embeddings, responses
from proxy.protocol.codec import Codec, loads, loads_all
from proxy.protocol.memmem import find
from proxy.protocol.output import OutputEstimate
from proxy.protocol.request import ParsedRequest
from proxy.protocol.usage import Usage, parse_usage

__all__ = ["NOTHING", "ChatReader", "CompletionsReader", "EventFlag", "OnEvent", "Reader",
           "ResponsesReader", "carries_usage", "loads", "loads_all"]


class EventFlag(enum.IntFlag):
    """What a reader learnt from one SSE event (`Reader.on_event`).

    On the per-chunk path compare these by identity (`flags is EventFlag.CONTENT`) or as plain
    ints: an IntFlag `&` or `|` runs enum code, about 0.4 us, a sixth of the whole per-chunk cost.
    """

    CONTENT = 1  # the event carries output tokens (text, reasoning, tool-call arguments)
    FINISH = 2  # a choice (or the whole response) ended
    USAGE_ONLY = 4  # a chunk with usage and no choices: ours to drop if we asked for it


NOTHING = EventFlag(0)
_CONTENT = EventFlag.CONTENT
_FINISH = EventFlag.FINISH
_USAGE_ONLY = EventFlag.USAGE_ONLY


class OnEvent(Protocol):
    """`Reader.on_event`, bound."""

    def __call__(self, data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        ...


def carries_usage(data: bytes) -> bool:
    """`data` (an event, or a chunk of the stream) may hold a usage object: the one sniff both
    the tap (to know what it may have to strip) and the Chat/Completions reader (to know
    which events to parse) use. A usage object cut between two chunks is not seen here; the
    tap handles that (see `proxy.protocol.tap`)."""
    return b'"usage":{' in data or b'"usage": {' in data


# What ends a run of plain content events (`take_content_run`): a usage object, a finish or an
# empty content, each mark as `on_event` looks for it (and so spelt both ways where it is), the
# finish first (it comes before the usage: the scans after it stop there). An event whose data
# is not a JSON object (`[DONE]`, say) ends a run too, found from the split events, not a scan.
_RUN_ENDS = (b'"finish_reason":"', b'"finish_reason": "', b'"usage":{', b'"usage": {',
             b'"content":""')


@functools.cache
def codec_texts(codec: Codec) -> Callable[[list[bytes]], Iterator[str]]:
    """The output texts in a list of `codec`'s events: what its walker finds in each."""
    texts = codec.texts

    def event_texts(events: list[bytes]) -> Iterator[str]:
        for obj in loads_all(events):
            for text in texts(obj):
                yield text.text
    return event_texts


class Reader:
    """The answer to one request, read: the base serves a JSON answer with a `usage` object in
    either OpenAI naming, and no stream (Embeddings). What texts an answer or an event holds is
    the codec's (`proxy.protocol.codec`): a reader counts what its walker finds."""

    codec: ClassVar[Codec] = embeddings.CODEC

    def __init__(self, request: ParsedRequest, model: str, *, sampled: bool) -> None:
        """`model`: the model that serves the request, whose encoding estimates count with.
        `sampled`: the upstream was asked for the stream's usage (see `OutputEstimate`)."""
        self.model = model
        # The codec's walker over events: the estimate holds no reference to its reader.
        self.output = OutputEstimate(model, codec_texts(self.codec), sampled=sampled)
        self._hold = self.output.hold
        self.reported: Usage | None = None  # the latest cumulative usage the upstream reported
        self.answer: dict[str, Any] | None = None  # a JSON answer (not streamed)
        self.seen_content = False
        self.terminated = False  # the stream's final event came: `[DONE]`, `response.completed`
        self.stream_error: ErrorClass | None = None  # the stream ended with the upstream's error
        # The model the upstream says answered (OTel's gen_ai.response.model), from the JSON the
        # reader parses anyway: the body, the first events, the final Responses event.
        self.response_model: str | None = None
        self._started = False  # an event of the API came (content or not)
        self._ended_empty = False  # the upstream ended a 200 stream without a single event

    def on_event(self, data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        """One SSE event: its data and its `event:` name. `marked`: `carries_usage(data)`, if
        the caller already knows it (the tap sniffed the chunk this event filled), else None."""
        return NOTHING

    def take_content_run(self, chunk: bytes, start: int, events: list[bytes],
                         first: int) -> tuple[int, int]:
        """`chunk[start:]` is whole one-line `data: ` events, `events[first:]` their data: the
        leading ones that are plain content `on_event` would hold without looking further,
        taken in one step. Returns how many, and where in `chunk` they end; (0, start): none,
        nothing changed, and the caller takes the next event by `on_event`. What fast
        upstreams send, many events per read, then costs a few scans of the chunk at C speed
        instead of Python per event."""
        return 0, start

    def on_body(self, body: bytes) -> None:
        self.answer = loads(body)
        self.reported = parse_usage(self.answer.get("usage"))
        self._answered_by(self.answer)

    def _answered_by(self, obj: dict[str, Any]) -> None:
        if self.response_model is None:
            model = obj.get("model")
            if isinstance(model, str) and model:
                self.response_model = model[:256]

    def answer_texts(self, answer: dict[str, Any]) -> Iterable[str]:
        """The output texts of a JSON answer."""
        return (text.text for text in self.codec.texts(answer))

    @property
    def started(self) -> bool:
        return self._started or self.seen_content or self.terminated

    @property
    def complete(self) -> bool:
        """The stream got its final event: it ended as the upstream meant it to."""
        return self.terminated

    def end_of_stream(self) -> bool:
        """The upstream closed its stream cleanly. Returns whether the stream was complete."""
        if not self.started:
            self._ended_empty = True
        return self.complete

    def counts_usage(self) -> bool:
        """`usage()` counts tokens: the upstream reported none. The count is bounded (see
        `tokenizer.PROMPT_BUDGET`) but can take a fifth of a second: off the loop, then."""
        return self.reported is None and not self._ended_empty

    def output_tokens(self) -> int:
        """The output tokens counted here: of the answer, or of the events streamed."""
        if self.answer is not None:
            return self.output.tokens(self.answer_texts(self.answer))
        return self.output.tokens()

    def usage(self, prompt: Callable[[], int]) -> Usage:
        """Latest cumulative usage the upstream reported, else a tiktoken estimate of what was
        sent so far: `prompt()` (the prompt's count) plus the output actually streamed."""
        if self.reported is not None:
            return self.reported
        if self._ended_empty:
            # llama-cpp-python answers a streamed prompt longer than its context this way:
            # nothing was produced, and nothing says that the prompt was read.
            return Usage(source="estimated")
        return Usage(input_tokens=prompt(), output_tokens=self.output_tokens(),
                     source="estimated")

    def output_tokens_so_far(self) -> int:
        """The upstream's own output figure if it reported one, else the estimate's running
        count (`OutputEstimate.so_far`)."""
        if self.reported is not None:
            return self.reported.output_tokens
        return self.output.so_far()

    def streamed_output_tokens(self) -> int:
        """The output tokens the stream showed, whatever the upstream reported: the estimate's
        running count (`OutputEstimate.so_far`)."""
        return self.output.so_far()

    def prompt_usage(self, prompt: Callable[[], int]) -> Usage:
        """The prompt alone, estimated: the charge of a request that its client abandoned
        while the upstream had it (read, but its output unknown)."""
        return Usage(input_tokens=prompt(), source="estimated")


def _choices_asked(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


class _ChoicesReader(Reader):
    """Chat Completions and legacy Completions: `choices[]` chunks, usage in its own chunk."""

    def __init__(self, request: ParsedRequest, model: str, *, sampled: bool) -> None:
        super().__init__(request, model, sampled=sampled)
        self._asked = _choices_asked(request.body)
        self._finished: set[int] = set()  # indices of the choices that have finished

    def _classify(self, data: bytes, obj: dict[str, Any]) -> EventFlag:
        self._started = True
        self._answered_by(obj)
        finish = False
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return NOTHING
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                finish = True
                index = choice.get("index", 0)
                if isinstance(index, int):
                    self._finished.add(index)
        if any(True for _ in self.codec.texts(obj)):
            self.seen_content = True
            self._hold(data)
            return _CONTENT | _FINISH if finish else _CONTENT
        return _FINISH if finish else NOTHING

    @property
    def complete(self) -> bool:
        """`[DONE]` came, or every choice asked for finished: a server that ends its stream
        without `[DONE]` after the last finish_reason has still sent the whole answer."""
        return self.terminated or len(self._finished) >= self._asked

    def on_event(self, data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        if data[:1] != b"{":
            if data == b"[DONE]":
                self.terminated = True
            return NOTHING
        if carries_usage(data) if marked is None else marked:
            obj = loads(data)
            usage = parse_usage(obj.get("usage"))
            if usage is not None:
                self.reported = usage  # latest cumulative usage wins
            if not obj.get("choices"):
                return _USAGE_ONLY
            return self._classify(data, obj)
        if (
            not self.seen_content
            or b'"finish_reason":"' in data
            or b'"finish_reason": "' in data
            or b'"content":""' in data
        ):
            return self._classify(data, loads(data))
        self._hold(data)
        return _CONTENT

    def take_content_run(self, chunk: bytes, start: int, events: list[bytes],
                         first: int) -> tuple[int, int]:
        # Exactly the events on_event takes by its last branch: after the first content, JSON
        # objects with no usage, no finish_reason, no empty content. The run ends at the event
        # holding the first of those marks (found by C-speed scans, one per mark: JSON text has
        # no raw newline, so `\n\ndata: ` is only ever an event boundary), or before the first
        # event that is not an object. Each event is b"data: " + data + b"\n\n" (the caller's
        # framing), so the events' lengths say where each ends: no counting scans. The scans
        # are the C library's memmem where there is one (`proxy.protocol.memmem`: 3x faster).
        if not self.seen_content or chunk[start + 6 : start + 7] != b"{":
            return 0, start
        stop = len(chunk)
        for mark in _RUN_ENDS:
            at = find(chunk, mark, start, stop)
            if at >= 0:
                stop = at
        run = events[first:]
        size = None  # the run's data bytes, where its end already says
        if stop < len(chunk):
            stop = chunk.rfind(b"\n\ndata: ", start, stop) + 2  # the marked event's start
            if stop < start + 2:
                return 0, start  # the first event is the marked one
            run = run[: _events_in(run, stop - start)]
            size = stop - start - 8 * len(run)  # its events fill [start, stop) exactly
        if not all(map(bytes.startswith, run, repeat(b"{"))):
            run = run[: next(i for i, data in enumerate(run) if data[:1] != b"{")]
            size = None
        if not run:
            return 0, start
        if size is None:
            size = sum(map(len, run))
        self.output.hold_run(run, size)
        return len(run), start + size + 8 * len(run)


def _events_in(events: list[bytes], length: int) -> int:
    """How many of `events` (each framed as 8 more bytes) make up the first `length` bytes,
    which end on an event boundary."""
    ends = list(accumulate(map(len, events)))
    return bisect_left(range(len(events)), length, key=lambda i: ends[i] + 8 * i + 8) + 1


class ChatReader(_ChoicesReader):
    codec = chat.CODEC


class CompletionsReader(_ChoicesReader):
    codec = completions.CODEC


_RESPONSES_DELTAS = frozenset(responses.DELTAS)
_RESPONSES_TERMINAL = responses.TERMINAL


class ResponsesReader(Reader):
    codec = responses.CODEC

    def on_event(self, data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        kind = name
        obj: dict[str, Any] | None = None
        if kind is None:  # servers that omit `event:` lines still put the type in the data
            obj = loads(data)
            kind = obj.get("type") if isinstance(obj.get("type"), str) else None
        if kind in _RESPONSES_DELTAS:
            self.seen_content = True
            self._hold(data)
            return _CONTENT
        if kind is None:
            return NOTHING
        self._started = True
        if kind in _RESPONSES_TERMINAL:
            self.terminated = True
            obj = obj if obj is not None else loads(data)
            response = obj.get("response")
            if isinstance(response, dict):
                self._answered_by(response)
                usage = parse_usage(response.get("usage"))
                if usage is not None:
                    self.reported = usage
            return _FINISH
        if kind == "error":  # the upstream told the client itself that the stream failed
            self.terminated = True
        return NOTHING
