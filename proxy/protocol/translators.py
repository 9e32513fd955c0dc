"""One translator per API shape, created per request.

A translator validates the client's body and says what to send upstream; then it reads the
response on the side of the relay (`on_event` per SSE event, or `on_body` for a JSON response)
and knows the request's usage. The relay forwards the upstream's original bytes; translators only
look at them.

The per-event path runs for every streamed chunk (14,000 a second on fast hardware), so after the
first content token it classifies events with substring tests instead of parsing JSON. JSON is
parsed only for the events that matter: until the first token, events that carry `usage` or a
`finish_reason`. Content events are kept raw for a tiktoken estimate, in case the upstream reports
no usage; past `HOLD_BYTES` they are counted in one batch and dropped, so the memory of a stream
stays bounded however long it runs.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.errors import ErrorClass, ErrorShape, InvalidRequest
from proxy.protocol import tokenizer
from proxy.protocol.usage import Usage, parse_usage


class EventFlag(enum.IntFlag):
    """What a translator learnt from one SSE event (`Translator.on_event`).

    On the per-chunk path compare these by identity (`flags is EventFlag.CONTENT`) or as plain
    ints: an IntFlag `&` or `|` runs enum code, about 0.4 us, a sixth of the whole per-chunk cost.
    """

    CONTENT = 1  # the event carries output tokens (text, reasoning, tool-call arguments)
    FINISH = 2  # a choice (or the whole response) ended
    USAGE_ONLY = 4  # a chunk with usage and no choices: ours to drop if we asked for it


_NOTHING = EventFlag(0)
_CONTENT = EventFlag.CONTENT
_FINISH = EventFlag.FINISH
_USAGE_ONLY = EventFlag.USAGE_ONLY


def carries_usage(data: bytes) -> bool:
    """`data` (an event, or a chunk of the stream) may hold a usage object: the one sniff both
    the tap (to know what it may have to strip) and the Chat/Completions translator (to know
    which events to parse) use. A usage object cut between two chunks is not seen here; the
    tap handles that (see `proxy.protocol.tap`)."""
    return b'"usage":{' in data or b'"usage": {' in data


# What ends a run of plain content events (`take_content_run`): a usage object, a finish, an
# empty content, and any event whose data is not a JSON object (`[DONE]`, say).
_RUN_ENDS_COMPACT = (b'"usage":{', b'"finish_reason":"', b'"content":""', b"\n\ndata: [")
_RUN_ENDS = (*_RUN_ENDS_COMPACT, b'"usage": {', b'"finish_reason": "')


class _BaseBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(min_length=1, max_length=256)
    stream: bool = False


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    model: str
    stream: bool
    body: dict[str, Any]
    raw: bytes


# The deepest a request body may nest arrays and objects. Real bodies stay far below it (a chat
# message's content parts are 4 levels down, a tool's JSON schema some dozens); past it the
# readers of the body that recurse (the JSON encoder when a body is rewritten, the estimate of an
# Anthropic prompt) could run out of Python's stack and answer 500 with a traceback.
MAX_DEPTH = 128

# C0 and C1 control characters and DEL: nothing a model is named with, and what terminals, log
# lines and report rows must not be handed from a client (a NUL cannot even be stored as
# PostgreSQL text). Lone surrogates are refused by the body model itself (not a valid string).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Every JSON object of a request body: one with a key twice is refused, because readers
    disagree on what it means (Python and this proxy keep the last value, other parsers the
    first or an error), so the proxy could meter and route on one value and the upstream act
    on another."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidRequest(
                    f"The JSON body of your request has the key '{key}' twice in one object; "
                    "send each key once."
                )
            seen.add(key)
    return obj


def _constant(name: str) -> float:
    """`NaN`, `Infinity` and `-Infinity`: Python reads them, JSON does not have them."""
    raise InvalidRequest(
        f"The JSON body of your request contains {name}, which is not valid JSON; send a "
        "number or null."
    )


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: as ambiguous as Infinity (an error, inf or a decimal)
        raise InvalidRequest(
            f"The JSON body of your request has the number {text[:40]}, too large for a "
            "double; send a smaller number."
        )
    return value


_DECODER = json.JSONDecoder(object_pairs_hook=_object, parse_constant=_constant,
                            parse_float=_float)


def _nested_deeper(root: dict[str, Any], limit: int) -> bool:
    """`root` nests arrays and objects more than `limit` levels deep. Level by level, without
    recursion: each container is visited once, and the walk stops at `limit` levels."""
    level: list[Any] = [root]
    for _ in range(limit):
        below: list[Any] = []
        add = below.append
        for container in level:
            for value in container.values() if container.__class__ is dict else container:
                if value.__class__ is dict or value.__class__ is list:
                    add(value)
        if not below:
            return False
        level = below
    return True


def _too_deep() -> InvalidRequest:
    return InvalidRequest(
        f"The JSON body of your request nests arrays and objects more than {MAX_DEPTH} levels "
        "deep; this proxy accepts no deeper."
    )


def parse_body(raw: bytes) -> ParsedRequest:
    """The client's body, read once, or a 400 in the API's shape: not JSON, not an object,
    ambiguous (a key twice in one object, NaN or Infinity, a number past a double), nested
    deeper than MAX_DEPTH, or without a usable `model`. What is forwarded is the client's own
    bytes, so they must mean to the upstream exactly what they mean here."""
    try:
        # As json.loads(raw) reads bytes, with the strict decoder.
        body = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except ValueError:
        raise InvalidRequest(
            "We could not parse the JSON body of your request. The body must be a JSON object."
        ) from None
    except RecursionError:  # deeper than the parser's own limit (the stack's, about 1,000)
        raise _too_deep() from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    if _nested_deeper(body, MAX_DEPTH):
        raise _too_deep()
    try:
        head = _BaseBody.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if param == "model" and err["type"] == "missing":
            raise InvalidRequest("you must provide a model parameter", param="model") from None
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}", param=param) from None
    if _CONTROL.search(head.model):
        raise InvalidRequest(
            "Invalid value for 'model': a model name cannot contain control characters "
            "(U+0000-U+001F, U+007F-U+009F).", param="model", code="invalid_value",
        )
    return ParsedRequest(model=head.model, stream=head.stream, body=body, raw=raw)


def _loads(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _positive_int(body: dict[str, Any], field: str) -> int | None:
    """An optional integer parameter >= 1 (JSON null is the same as absent), or a 400 naming
    it, in OpenAI's words: a string, float or boolean where a count belongs is a client bug
    that would otherwise slip past the budget."""
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = {bool: "a boolean", str: "a string", float: "a decimal", list: "an array",
                dict: "an object"}.get(type(value), "another type")
        raise InvalidRequest(
            f"Invalid type for '{field}': expected an integer, but got {kind} instead.",
            param=field, code="invalid_type",
        )
    if value < 1:
        raise InvalidRequest(
            f"Invalid '{field}': integer below minimum value. Expected a value >= 1, but got "
            f"{value} instead.", param=field, code="integer_below_min_value",
        )
    return value


def _strings(*values: Any) -> Iterable[str]:
    return (v for v in values if isinstance(v, str) and v)


# Raw content events held per stream before they are counted and dropped: about 1,000 chunks of
# OpenAI's, so most answers are never parsed at all (their usage comes from the upstream), and no
# stream ever holds more than this.
HOLD_BYTES = 256 * 1024


def _loads_all(events: list[bytes]) -> list[dict[str, Any]]:
    """`_loads` of each event. One JSON array is parsed in one call, twice as fast as one call
    per event; if that is not exactly one object per event, they are parsed one by one."""
    try:
        objs = json.loads(b"[" + b",".join(events) + b"]")
    except ValueError:
        objs = None
    if not isinstance(objs, list) or len(objs) != len(events):
        return [_loads(e) for e in events]
    return [o if isinstance(o, dict) else {} for o in objs]


_SAMPLER = random.Random()  # picks the events that rate the rest (see Translator._fold)


def _choices_asked(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


class Translator:
    operation: ClassVar[str]
    path: ClassVar[str]
    streams: ClassVar[bool] = True
    named_events: ClassVar[bool] = False  # SSE `event:` names (Responses API)
    error_shape: ClassVar[ErrorShape] = ErrorShape.OPENAI  # of the proxy's own errors
    upstream_api: ClassVar[str] = "openai"  # the UpstreamApi of the upstreams that serve it

    def __init__(
        self, request: ParsedRequest, ask_usage: bool = True, model: str | None = None,
        *, write_all_caps: bool = True,
    ) -> None:
        """`model`: a fallback model that serves the request instead of the one asked for.
        `write_all_caps`: the upstream's `cap_fields` policy (see `_capped`)."""
        self.request = request
        self.write_all_caps = write_all_caps
        self.model = model or request.model
        self._reported: Usage | None = None
        self._content: list[bytes] = []
        self._body: dict[str, Any] | None = None
        self.seen_content = False
        # True when the proxy, not the client, asked for stream usage: the usage-only chunk is
        # then removed so the client parses exactly what it would without the proxy.
        self.strips_usage = False
        # Changes every attempt of this translator sends: the serving model, stream_options.
        self._changes: dict[str, Any] = {}
        if self.model != request.model:
            self._changes["model"] = self.model

    # --- request side -------------------------------------------------------------------
    # Every field of this API shape that limits output tokens per choice. Servers differ in
    # which one they honour (llama-cpp-python ignores max_completion_tokens; OpenAI's reasoning
    # models refuse max_tokens), so the cap is enforced on all of them.
    cap_fields: ClassVar[tuple[str, ...]] = ()
    # What the upstream does without a cap field: None = no bound.
    implicit_cap: ClassVar[int | None] = None
    # Fields that ask for several generations, each billed (`n`, `best_of`).
    choice_fields: ClassVar[tuple[str, ...]] = ()

    def max_output(self, cap: int | None) -> int:
        """The most output tokens the request can produce under `cap`, all choices together
        (0: unbounded): what admission asks for, without building the body (see `_capped`,
        whose 400s it raises)."""
        return self._capped(cap)[1]

    def upstream_body(self, cap: int | None) -> bytes:
        """What goes upstream for this attempt, with `cap` enforced (see `_capped`): the
        client's own bytes when nothing changes, else its JSON with the changes, serialized
        once. The body change is a return value; the translator keeps no trace of it. A cap of
        `max_output(c)` writes the same body as `c` (the same per-choice limits)."""
        changes = {**self._changes, **self._capped(cap)[0]}
        if not changes:
            return self.request.raw
        return json.dumps({**self.request.body, **changes}, separators=(",", ":")).encode()

    def choices(self) -> int:
        """How many generations the upstream runs (and bills) for this request."""
        count = 1
        for field in self.choice_fields:
            value = _positive_int(self.request.body, field)
            if value is not None:
                count = max(count, value)
        return count

    def _capped(self, cap: int | None) -> tuple[dict[str, Any], int]:
        """Enforce `cap`, the most output tokens the whole request may produce (all choices
        together). Every cap field the client sent is clamped to its share per choice; then,
        with `write_all_caps`, every cap field of the shape missing from the body is set (to
        the client's own limit if it sent one, else the share), so the limit holds whichever
        field the upstream honours; without (OpenAI, which honours each field but refuses two
        at once), only the preferred field, and only if the client sent none. Returns the body
        fields to change and the most output tokens the request can produce: the largest
        effective per-choice limit times the choices (0 if unbounded: no cap and no limit).
        `cap=None` validates and changes nothing. Refuses non-integer or non-positive limits,
        and more choices than the cap can serve, with a 400 naming the parameter."""
        changes: dict[str, Any] = {}
        if not self.cap_fields:
            return changes, 0
        body = self.request.body
        sent = {f: v for f in self.cap_fields if (v := _positive_int(body, f)) is not None}
        choices = self.choices()
        if cap is None:
            if sent:
                return changes, max(sent.values()) * choices
            return changes, (self.implicit_cap or 0) * choices
        share = cap // choices
        if share < 1:
            field = next(f for f in self.choice_fields if body.get(f) is not None)
            raise InvalidRequest(
                f"This proxy allows at most {cap} output tokens per request, so '{field}' "
                f"({choices}) asks for more generations than can fit; lower it.",
                param=field, code="invalid_value",
            )
        for field, value in sent.items():
            if value > share:
                changes[field] = share
        limits = [min(v, share) for v in sent.values()]
        # A field the client left out gets the client's own limit (or ours, if it sent none).
        if limits:
            default = max(limits)
        else:
            default = share if self.implicit_cap is None else min(self.implicit_cap, share)
        missing = [f for f in self.cap_fields if f not in sent]
        if not self.write_all_caps:
            missing = [] if sent else missing[:1]
        for field in missing:
            changes[field] = default
        return changes, max([*limits, default]) * choices

    def estimate_prompt_tokens(self) -> int:
        raise NotImplementedError

    # --- response side ------------------------------------------------------------------
    # Bytes of the content events held in `_content`; of the events dropped since (see `_fold`),
    # the tokens of those counted whole, and the events rated by a sample, the sample's events
    # and its tokens.
    _held: int = 0
    _folded: int = 0
    _rated_events: int = 0
    _sampled_events: int = 0
    _sampled_tokens: int = 0
    _SAMPLE: ClassVar[int] = 16  # one event in this many rates the rest (see `_fold`)
    terminated = False  # the stream's final event came: `[DONE]`, `response.completed`, ...
    stream_error: ErrorClass | None = None  # the stream ended with the upstream's error event
    _started = False  # an event of the API came (content or not)
    _ended_empty = False  # the upstream ended a 200 stream without sending a single event
    _finished: frozenset[int] = frozenset()  # indices of the choices that have finished

    def on_event(self, data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        """One SSE event: its data and its `event:` name. `marked`: `carries_usage(data)`, if
        the caller already knows it (the tap sniffed the chunk this event filled), else None."""
        return _NOTHING

    def take_content_run(self, chunk: bytes, start: int, events: list[bytes],
                         first: int) -> tuple[int, int]:
        """`chunk[start:]` is whole one-line `data: ` events, `events[first:]` their data: the
        leading ones that are plain content `on_event` would hold without looking further,
        taken in one step. Returns how many, and where in `chunk` they end; (0, start): none,
        nothing changed, and the caller takes the next event by `on_event`. What fast
        upstreams send, many events per read, then costs a few scans of the chunk at C speed
        instead of Python per event."""
        return 0, start

    # The model the upstream says answered (OTel's gen_ai.response.model), from the JSON the
    # translator parses anyway: the body, the first events, the final Responses event.
    response_model: str | None = None

    def _answered_by(self, obj: dict[str, Any]) -> None:
        if self.response_model is None:
            model = obj.get("model")
            if isinstance(model, str) and model:
                self.response_model = model[:256]

    def on_body(self, body: bytes) -> None:
        self._body = _loads(body)
        self._reported = parse_usage(self._body.get("usage"))
        self._answered_by(self._body)

    def _event_texts(self, events: list[bytes]) -> Iterable[str]:
        """The output texts in held content events."""
        return ()

    def _output_texts(self) -> Iterable[str]:
        return self._event_texts(self._content)

    def _hold(self, data: bytes) -> None:
        """Keep a content event for the estimate (the hot paths inline this)."""
        self._content.append(data)
        self._held += len(data)
        if self._held > HOLD_BYTES:
            self._fold()

    def _expects_usage(self) -> bool:
        """The upstream was asked to report this stream's usage."""
        return False

    def _fold(self) -> None:
        """Drop the held events, keeping what an estimate needs: their tokens, counted text by
        text as `usage` does. Counting costs about as much per event as the rest of the hot path
        does, and when the upstream was asked for usage the count is wasted unless the stream
        breaks; there a random sample of one event in `_SAMPLE` is counted instead, and the rest
        rated at the sample's tokens per event (one token or so per event, steady over a
        stream). Random, not every nth: a stream with a period of its own would skew that."""
        events = self._content
        # On the loop, in the relay: a count bounded for the loop (see tokenizer.LOOP_BUDGET).
        if self._expects_usage():
            sample = _SAMPLER.sample(events, -(-len(events) // self._SAMPLE))
            self._sampled_events += len(sample)
            self._sampled_tokens += tokenizer.count_texts(self.model, self._event_texts(sample),
                                                          tokenizer.LOOP_BUDGET)
            self._rated_events += len(events)
        else:
            self._folded += tokenizer.count_texts(self.model, self._event_texts(events),
                                                  tokenizer.LOOP_BUDGET)
        self._content = []
        self._held = 0

    def _folded_tokens(self) -> int:
        rated = 0
        if self._sampled_events:
            rated = round(self._rated_events * self._sampled_tokens / self._sampled_events)
        return self._folded + rated

    # `output_tokens_so_far`'s running count: the held list it last looked at, how far, and
    # its random sample of the events seen (events, tokens), kept across folds.
    _seen_list: list[bytes] | None = None
    _seen_at: int = 0
    _rate_events: int = 0
    _rate_tokens: int = 0

    def output_tokens_so_far(self) -> int:
        """The output tokens streamed so far: the upstream's own figure if it reported one, else
        the held events rated at the tokens per event of a random sample of one in `_SAMPLE`
        (as `_fold` rates a stream whose usage will be reported), plus what was folded. Counting
        every event would cost as much per event as the rest of the hot path; a caller may ask
        every few events (the `estimate` policy's top-ups) and pays for the new ones only."""
        if self._reported is not None:
            return self._reported.output_tokens
        events = self._content
        if events is not self._seen_list:  # folded since: those are in `_folded_tokens`
            self._seen_list, self._seen_at = events, 0
        fresh = len(events) - self._seen_at
        if fresh > 0:
            k, part = divmod(fresh, self._SAMPLE)
            if part and _SAMPLER.random() * self._SAMPLE < part:
                k += 1
            if not self._rate_events:
                k = max(k, 1)
            if k:
                sample = _SAMPLER.sample(events[self._seen_at:], k)
                self._rate_events += k
                self._rate_tokens += tokenizer.count_texts(
                    self.model, self._event_texts(sample), tokenizer.LOOP_BUDGET)
            self._seen_at = len(events)
        held = 0
        if self._rate_events:
            held = -(-len(events) * self._rate_tokens // self._rate_events)  # rounded up
        return self._folded_tokens() + held

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
        return self._reported is None and not self._ended_empty

    def usage(self) -> Usage:
        """Latest cumulative usage the upstream reported, else a tiktoken estimate of what was
        sent so far (prompt plus the output actually streamed)."""
        if self._reported is not None:
            return self._reported
        if self._ended_empty:
            # llama-cpp-python answers a streamed prompt longer than its context this way:
            # nothing was produced, and nothing says that the prompt was read.
            return Usage(source="estimated")
        return Usage(
            input_tokens=self.prompt_tokens(),
            output_tokens=self._folded_tokens()
            + tokenizer.count_texts(self.model, self._output_texts()),
            source="estimated",
        )

    # The prompt's tokens as `estimate_prompt_tokens` counted them, once (see `prompt_tokens`).
    _prompt_tokens: int | None = None

    def prompt_tokens(self) -> int:
        """The prompt's estimated tokens, counted on first use and kept: admission's reservation
        and settle's charge use one count. Bounded, but up to a fifth of a second for a large
        prompt: off the loop unless `prompt_counted` or the body is small."""
        count = self._prompt_tokens
        if count is None:
            count = self._prompt_tokens = self.estimate_prompt_tokens()
        return count

    @property
    def prompt_counted(self) -> bool:
        return self._prompt_tokens is not None

    def prompt_usage(self) -> Usage:
        """The prompt alone, estimated: the charge of a request that its client abandoned
        while the upstream had it (read, but its output unknown)."""
        return Usage(input_tokens=self.prompt_tokens(), source="estimated")


class _ChoicesTranslator(Translator):
    """Chat Completions and legacy Completions: `choices[]` chunks and `stream_options`."""

    def __init__(
        self, request: ParsedRequest, ask_usage: bool = True, model: str | None = None,
        *, write_all_caps: bool = True,
    ) -> None:
        super().__init__(request, ask_usage, model, write_all_caps=write_all_caps)
        body = request.body
        if request.stream and ask_usage:
            options = body.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage") is True):
                new_options = dict(options) if isinstance(options, dict) else {}
                new_options["include_usage"] = True
                self._changes["stream_options"] = new_options
                self.strips_usage = True

    def _choice_texts(self, choice: dict[str, Any]) -> Iterable[str]:
        raise NotImplementedError

    def _classify(self, data: bytes, obj: dict[str, Any]) -> EventFlag:
        self._started = True
        self._answered_by(obj)
        finish = content = False
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return _NOTHING
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                finish = True
                index = choice.get("index", 0)
                if isinstance(index, int) and index not in self._finished:
                    self._finished = self._finished | {index}
            if not content and any(True for _ in self._choice_texts(choice)):
                content = True
        if content:
            self.seen_content = True
            self._hold(data)
            return _CONTENT | _FINISH if finish else _CONTENT
        return _FINISH if finish else _NOTHING

    def _expects_usage(self) -> bool:
        options = self.request.body.get("stream_options")
        return self.strips_usage or (
            isinstance(options, dict) and options.get("include_usage") is True
        )

    @property
    def complete(self) -> bool:
        """`[DONE]` came, or every choice asked for finished: a server that ends its stream
        without `[DONE]` after the last finish_reason has still sent the whole answer."""
        return self.terminated or len(self._finished) >= _choices_asked(self.request.body)

    def on_event(self, data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        if data[:1] != b"{":
            if data == b"[DONE]":
                self.terminated = True
            return _NOTHING
        if carries_usage(data) if marked is None else marked:
            obj = _loads(data)
            usage = parse_usage(obj.get("usage"))
            if usage is not None:
                self._reported = usage  # latest cumulative usage wins
            if not obj.get("choices"):
                return _USAGE_ONLY
            return self._classify(data, obj)
        if (
            not self.seen_content
            or b'"finish_reason":"' in data
            or b'"finish_reason": "' in data
            or b'"content":""' in data
        ):
            return self._classify(data, _loads(data))
        self._content.append(data)
        self._held += len(data)
        if self._held > HOLD_BYTES:
            self._fold()
        return _CONTENT

    def take_content_run(self, chunk: bytes, start: int, events: list[bytes],
                         first: int) -> tuple[int, int]:
        # Exactly the events on_event takes by its last branch: after the first content, JSON
        # objects with no usage, no finish_reason, no empty content. The run ends at the event
        # holding the first of those marks (found by C-speed scans; JSON text has no raw
        # newline, so `\n\ndata: ` is only ever an event boundary).
        if not self.seen_content or chunk[start + 6 : start + 7] != b"{":
            return 0, start
        end = stop = len(chunk)
        # Each scan reads the bytes again: the marks written with a space after the colon
        # (pretty-printing servers) are looked for only where such a colon is.
        for mark in _RUN_ENDS if chunk.find(b'": ', start) >= 0 else _RUN_ENDS_COMPACT:
            at = chunk.find(mark, start, stop)
            if at >= 0:
                stop = at
        if stop < end:
            stop = chunk.rfind(b"\n\ndata: ", start, stop) + 2  # that event's start
            if stop < start + 2:
                return 0, start  # the first event is the marked one
            count = chunk.count(b"\n\n", start, stop)
        else:
            count = len(events) - first
        if chunk.count(b"\n\ndata: {", start, stop) != count - 1:
            return 0, start  # an event in it is not a JSON object: event by event
        taken = events[first : first + count]
        self._content += taken
        self._held += stop - start - 8 * count  # each event: b"data: " + data + b"\n\n"
        if self._held > HOLD_BYTES:
            self._fold()
        return count, stop

    def _event_texts(self, events: list[bytes]) -> Iterable[str]:
        for obj in _loads_all(events):
            choices = obj.get("choices")
            for choice in choices if isinstance(choices, list) else ():
                if isinstance(choice, dict):
                    yield from self._choice_texts(choice)

    def _output_texts(self) -> Iterable[str]:
        if self._body is not None:
            choices = self._body.get("choices")
            for choice in choices if isinstance(choices, list) else ():
                if isinstance(choice, dict):
                    yield from self._choice_texts(choice)
            return
        yield from self._event_texts(self._content)


class ChatTranslator(_ChoicesTranslator):
    operation = "chat"
    path = "/chat/completions"
    # max_tokens is deprecated (and refused by OpenAI's reasoning models); llama-cpp-python and
    # others honour only max_tokens. Which ones are written is the upstream's setting.
    cap_fields = ("max_completion_tokens", "max_tokens")
    choice_fields = ("n",)

    def _choice_texts(self, choice: dict[str, Any]) -> Iterable[str]:
        msg = choice.get("delta")
        if not isinstance(msg, dict):
            msg = choice.get("message")
        if not isinstance(msg, dict):
            return
        yield from _strings(
            msg.get("content"), msg.get("reasoning_content"), msg.get("reasoning"),
            msg.get("refusal"),
        )
        calls = msg.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                yield from _strings(fn.get("name"), fn.get("arguments"))

    def estimate_prompt_tokens(self) -> int:
        messages = self.request.body.get("messages")
        return tokenizer.count_messages(self.model, messages if isinstance(messages, list) else [])


def _count_prompt_input(model: str, value: Any) -> int:
    """`prompt` / `input` as a string, a list of strings, a token array or a list of those, in
    one bounded count. The type of a list is its first item's: a mixed list is refused upstream
    (and charged nothing), and checking every item of a huge token array would cost more than
    the estimate is worth."""
    if isinstance(value, str):
        return tokenizer.count_texts(model, (value,))
    if not isinstance(value, list) or not value:
        return 0
    if isinstance(value[0], int):
        return len(value)
    if isinstance(value[0], list):  # token arrays
        return sum(len(v) for v in value if isinstance(v, list))
    return tokenizer.count_texts(model, (v for v in value if isinstance(v, str)))


class CompletionsTranslator(_ChoicesTranslator):
    operation = "text_completion"
    path = "/completions"
    cap_fields = ("max_tokens",)
    implicit_cap = 16  # the legacy API's documented default
    # best_of candidates are generated (and billed) server-side, n of them returned.
    choice_fields = ("n", "best_of")

    def _choice_texts(self, choice: dict[str, Any]) -> Iterable[str]:
        return _strings(choice.get("text"))

    def estimate_prompt_tokens(self) -> int:
        return _count_prompt_input(self.model, self.request.body.get("prompt"))


_RESPONSES_DELTAS = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
        "response.output_audio_transcript.delta",
    }
)
_RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesTranslator(Translator):
    operation = "responses"
    path = "/responses"
    named_events = True
    cap_fields = ("max_output_tokens",)

    def on_event(self, data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        kind = name
        obj: dict[str, Any] | None = None
        if kind is None:  # servers that omit `event:` lines still put the type in the data
            obj = _loads(data)
            kind = obj.get("type") if isinstance(obj.get("type"), str) else None
        if kind in _RESPONSES_DELTAS:
            self.seen_content = True
            self._content.append(data)
            self._held += len(data)
            if self._held > HOLD_BYTES:
                self._fold()
            return _CONTENT
        if kind is None:
            return _NOTHING
        self._started = True
        if kind in _RESPONSES_TERMINAL:
            self.terminated = True
            obj = obj if obj is not None else _loads(data)
            response = obj.get("response")
            if isinstance(response, dict):
                self._answered_by(response)
                usage = parse_usage(response.get("usage"))
                if usage is not None:
                    self._reported = usage
            return _FINISH
        if kind == "error":  # the upstream told the client itself that the stream failed
            self.terminated = True
        return _NOTHING

    def _output_texts(self) -> Iterable[str]:
        if self._body is not None:
            output = self._body.get("output")
            for item in output if isinstance(output, list) else ():
                if not isinstance(item, dict):
                    continue
                yield from _strings(item.get("arguments"))
                content = item.get("content") or item.get("summary")
                for part in content if isinstance(content, list) else ():
                    if isinstance(part, dict):
                        yield from _strings(part.get("text"), part.get("refusal"))
            return
        yield from self._event_texts(self._content)

    def _event_texts(self, events: list[bytes]) -> Iterable[str]:
        for obj in _loads_all(events):
            yield from _strings(obj.get("delta"))

    def _expects_usage(self) -> bool:
        return True  # `response.completed` carries it

    def estimate_prompt_tokens(self) -> int:
        body = self.request.body
        value = body.get("input")
        instructions = _strings(body.get("instructions"))
        if isinstance(value, list):
            return tokenizer.count_messages(self.model, value, instructions)
        return tokenizer.count_texts(self.model, itertools.chain(_strings(value), instructions))


class EmbeddingsTranslator(Translator):
    operation = "embeddings"
    path = "/embeddings"
    streams = False

    def estimate_prompt_tokens(self) -> int:
        return _count_prompt_input(self.model, self.request.body.get("input"))


TRANSLATORS: tuple[type[Translator], ...] = (
    ChatTranslator,
    CompletionsTranslator,
    ResponsesTranslator,
    EmbeddingsTranslator,
)
