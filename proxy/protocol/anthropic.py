"""Reading Anthropic's Messages API answers (`/v1/messages`, `/v1/messages/count_tokens`).

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
from collections.abc import Callable, Iterable
from typing import Any

from proxy.protocol import upstream_errors
from proxy.protocol.readers import NOTHING, EventFlag, Reader, loads, loads_all
from proxy.protocol.request import ParsedRequest, strings
from proxy.protocol.usage import Usage, usage_int

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


class MessagesReader(Reader):
    def __init__(self, request: ParsedRequest, model: str, *, sampled: bool) -> None:
        super().__init__(request, model, sampled=sampled)
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
            self.reported = anthropic_usage(self._fields)

    def usage(self, prompt: Callable[[], int]) -> Usage:
        """A stream cut before its message_delta: the prompt as message_start reported it, the
        output counted here, the whole labelled estimated."""
        if self.reported is not None or not self._fields:
            return super().usage(prompt)
        start = anthropic_usage(self._fields)
        assert start is not None  # a dict
        return dataclasses.replace(start, output_tokens=self.output_tokens(), source="estimated")

    def on_event(self, data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        if name is None:  # a server that omits `event:` lines: the type is in the data
            kind = loads(data).get("type")
            name = kind if isinstance(kind, str) else None
        if name == "content_block_delta":
            self._started = True
            if any(mark in data for mark in _CONTENT_MARKS):
                self.seen_content = True
                self._hold(data)
                return _CONTENT
            return NOTHING
        if name == "message_start":
            self._started = True
            message = loads(data).get("message")
            if isinstance(message, dict):
                self._answered_by(message)
                self._merge_usage(message.get("usage"), final=False)
            return NOTHING
        if name == "message_delta":
            obj = loads(data)
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
            return NOTHING
        if name is not None and name != "ping":
            self._started = True
        return NOTHING

    def on_body(self, body: bytes) -> None:
        self.answer = loads(body)
        self.reported = anthropic_usage(self.answer.get("usage"))
        self._answered_by(self.answer)

    @staticmethod
    def event_texts(events: list[bytes]) -> Iterable[str]:
        for obj in loads_all(events):
            delta = obj.get("delta")
            if isinstance(delta, dict):
                yield from strings(delta.get("text"), delta.get("thinking"),
                                   delta.get("partial_json"))

    def answer_texts(self, answer: dict[str, Any]) -> Iterable[str]:
        content = answer.get("content")
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict):
                yield from strings(block.get("text"), block.get("thinking"))
                if block.get("type") == "tool_use":
                    yield from strings(str(block.get("input")))


class CountTokensReader(MessagesReader):
    """`count_tokens`: authenticated and counted as a request, but it generates nothing, so it
    reserves and charges no tokens (its answer has no `usage`)."""

    def on_body(self, body: bytes) -> None:
        self.answer = loads(body)
        self.reported = Usage()
        self._answered_by(self.answer)

    def usage(self, prompt: Callable[[], int]) -> Usage:
        return Usage()

    def counts_usage(self) -> bool:
        return False

    def prompt_usage(self, prompt: Callable[[], int]) -> Usage:
        return Usage()
