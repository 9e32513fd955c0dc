"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), sans-I/O.

A stream names its events: `message_start` carries the input usage (and an output count of 1),
`content_block_delta` the content, `message_delta` the cumulative usage so far (the latest one
wins, field by field), `message_stop` the end. Anthropic's `input_tokens` counts only the prompt
tokens that were neither written to nor read from the prompt cache; here `Usage.input_tokens` is
the whole prompt, as in the OpenAI shapes, with the cache reads in `cached_input_tokens` and the
cache writes in `cache_creation_input_tokens`, so budgets count every prompt token once and the
existing cost of cached input applies to the reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

from proxy.errors import ErrorShape, InvalidRequest
from proxy.protocol import tokenizer, upstream_errors
from proxy.protocol.translators import (
    HOLD_BYTES,
    EventFlag,
    Translator,
    _loads,
    _loads_all,
    _strings,
)
from proxy.protocol.usage import Usage, usage_int

_NOTHING = EventFlag(0)
_CONTENT = EventFlag.CONTENT
_FINISH = EventFlag.FINISH
# The deltas that carry output tokens (signature and citation deltas do not).
_CONTENT_MARKS = (b'"text_delta"', b'"thinking_delta"', b'"input_json_delta"')
# `cache_creation` (the writes by cache lifetime) is an object: kept whole, the latest wins.
_USAGE_FIELDS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
                 "output_tokens", "cache_creation")


def anthropic_usage(obj: Any) -> Usage | None:
    """An Anthropic `usage` object as a `Usage` (see the module's note on input tokens).

    `cache_creation: {ephemeral_5m_input_tokens, ephemeral_1h_input_tokens}`, where the usage
    has it, says which cache the writes went to: the 1-hour ones are kept apart (priced apart),
    the rest of `cache_creation_input_tokens` are 5-minute writes."""
    if not isinstance(obj, dict):
        return None
    fresh = usage_int(obj.get("input_tokens"))
    split = obj.get("cache_creation")
    split = split if isinstance(split, dict) else {}
    hour = usage_int(split.get("ephemeral_1h_input_tokens"))
    if "cache_creation_input_tokens" in obj:
        writes = usage_int(obj.get("cache_creation_input_tokens"))
    else:  # only the split: its sum
        writes = usage_int(split.get("ephemeral_5m_input_tokens")) + hour
    reads = usage_int(obj.get("cache_read_input_tokens"))
    return Usage(
        input_tokens=fresh + writes + reads,
        output_tokens=usage_int(obj.get("output_tokens")),
        cached_input_tokens=reads,
        cache_creation_input_tokens=writes,
        cache_read_input_tokens=reads,
        cache_creation_1h_input_tokens=min(hour, writes),
    )


class MessagesTranslator(Translator):
    operation = "messages"
    path = "/messages"
    named_events = True
    error_shape = ErrorShape.ANTHROPIC
    upstream_api: ClassVar[str] = "anthropic"
    cap_fields: ClassVar[tuple[str, ...]] = ("max_tokens",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.cap_fields and self.request.body.get("max_tokens") is None:
            # Required by the API: refused here rather than capped, as the upstream would.
            raise InvalidRequest("max_tokens: Field required", param="max_tokens")
        self._fields: dict[str, Any] = {}  # the latest cumulative usage, field by field

    def _merge_usage(self, obj: Any, *, final: bool) -> None:
        """`final`: a message_delta, whose output count is the answer's so far. message_start's
        output count is a placeholder (1): until a message_delta comes, the usage is not
        reported but estimated (see `usage`)."""
        if not isinstance(obj, dict):
            return
        for field in _USAGE_FIELDS:
            if field in obj:
                value = obj[field]
                if isinstance(value, dict):
                    self._fields[field] = value
                elif field != "cache_creation":  # a null split says nothing: keep the last
                    self._fields[field] = usage_int(value)
        if final:
            self._reported = anthropic_usage(self._fields)

    def usage(self) -> Usage:
        """A stream cut before its message_delta: the prompt as message_start reported it, the
        output counted here, the whole labelled estimated."""
        if self._reported is not None or not self._fields:
            return super().usage()
        start = anthropic_usage(self._fields)
        assert start is not None  # a dict
        output = self._folded_tokens() + tokenizer.count_texts(self.model, self._output_texts())
        return dataclasses.replace(start, output_tokens=output, source="estimated")

    def on_event(self, data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        if name is None:  # a server that omits `event:` lines: the type is in the data
            kind = _loads(data).get("type")
            name = kind if isinstance(kind, str) else None
        if name == "content_block_delta":
            self._started = True
            if any(mark in data for mark in _CONTENT_MARKS):
                self.seen_content = True
                self._content.append(data)
                self._held += len(data)
                if self._held > HOLD_BYTES:
                    self._fold()
                return _CONTENT
            return _NOTHING
        if name == "message_start":
            self._started = True
            message = _loads(data).get("message")
            if isinstance(message, dict):
                self._answered_by(message)
                self._merge_usage(message.get("usage"), final=False)
            return _NOTHING
        if name == "message_delta":
            obj = _loads(data)
            self._merge_usage(obj.get("usage"), final=True)
            return _FINISH
        if name == "message_stop":
            self.terminated = True
            return _FINISH
        if name == "error":
            # The upstream ended the stream with an error (forwarded: it told the client
            # itself). The request failed, whatever the stream's 200 said: booked as the class
            # of that error (`overloaded_error`: upstream_5xx, as its 529 would have been).
            self.terminated = True
            self.stream_error = upstream_errors.stream_error(data)
            return _NOTHING
        if name is not None and name != "ping":
            self._started = True
        return _NOTHING

    def on_body(self, body: bytes) -> None:
        self._body = _loads(body)
        self._reported = anthropic_usage(self._body.get("usage"))
        self._answered_by(self._body)

    def _event_texts(self, events: list[bytes]) -> Iterable[str]:
        for obj in _loads_all(events):
            delta = obj.get("delta")
            if isinstance(delta, dict):
                yield from _strings(delta.get("text"), delta.get("thinking"),
                                    delta.get("partial_json"))

    def _output_texts(self) -> Iterable[str]:
        if self._body is not None:
            content = self._body.get("content")
            for block in content if isinstance(content, list) else ():
                if isinstance(block, dict):
                    yield from _strings(block.get("text"), block.get("thinking"))
                    if block.get("type") == "tool_use":
                        yield from _strings(str(block.get("input")))
            return
        yield from self._event_texts(self._content)

    def _expects_usage(self) -> bool:
        return True  # message_start and message_delta carry it

    def estimate_prompt_tokens(self) -> int:
        body = self.request.body
        messages = body.get("messages")
        return tokenizer.count_messages(self.model, messages if isinstance(messages, list) else [],
                                        _all_strings(body.get("system"), body.get("tools")))


def _all_strings(*values: Any) -> Iterable[str]:
    for value in values:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            yield from _all_strings(*value.values())
        elif isinstance(value, list):
            yield from _all_strings(*value)


class CountTokensTranslator(MessagesTranslator):
    """`count_tokens`: authenticated and counted as a request, but it generates nothing, so it
    reserves and charges no tokens (its answer has no `usage`)."""

    operation = "count_tokens"
    path = "/messages/count_tokens"
    streams = False
    cap_fields = ()

    def on_body(self, body: bytes) -> None:
        self._body = _loads(body)
        self._reported = Usage()
        self._answered_by(self._body)

    def usage(self) -> Usage:
        return Usage()

    def counts_usage(self) -> bool:
        return False

    def prompt_usage(self) -> Usage:
        return Usage()

    def estimate_prompt_tokens(self) -> int:
        return 0
