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
from collections.abc import Callable
from typing import Any, ClassVar

from proxy.protocol import upstream_errors
from proxy.protocol.apis import count_tokens, messages
from proxy.protocol.codec import Codec
from proxy.protocol.readers import NOTHING, EventFlag, Reader, loads
from proxy.protocol.request import ParsedRequest
from proxy.protocol.usage import ANTHROPIC_FIELDS as _USAGE_FIELDS
from proxy.protocol.usage import Usage, anthropic_usage, usage_int

__all__ = ["CountTokensReader", "MessagesReader", "anthropic_usage"]

_CONTENT = EventFlag.CONTENT
_FINISH = EventFlag.FINISH
# The deltas that carry output tokens (signature and citation deltas do not).
_CONTENT_MARKS = (b'"text_delta"', b'"thinking_delta"', b'"input_json_delta"')
class MessagesReader(Reader):
    codec: ClassVar[Codec] = messages.CODEC

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


class CountTokensReader(MessagesReader):
    """`count_tokens`: authenticated and counted as a request, but it generates nothing, so it
    reserves and charges no tokens (its answer has no `usage`)."""

    codec = count_tokens.CODEC

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
