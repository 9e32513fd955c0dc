"""One translator per API shape, created per request: the one object the pipeline, the budget
and the tap hold, a thin facade over the three jobs of a shape.

- `proxy.protocol.request`: the client's body, parsed once (`parse_body`).
- `proxy.protocol.shaping`: what goes upstream (`max_output(cap)`, `upstream_body(cap)`, the
  prompt's count), as return values.
- `proxy.protocol.readers` (and `anthropic`): the upstream's answer, read on the side of the
  relay (`on_event` per SSE event, `on_body` for a JSON response): flags, usage.
- `proxy.protocol.output`: the estimate of the output streamed, one for every shape.
- `proxy.protocol.codec` (`codec`): what the shape's answers mean, for the readers and the
  wings (the texts by kind, a stream assembled, an answer replayed, the cap fields).

The translator keeps the one thing two jobs share: the prompt's count, made once, for
admission's reservation and settle's charge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

from proxy.errors import ErrorClass, ErrorShape
from proxy.protocol.anthropic import CountTokensReader, MessagesReader
from proxy.protocol.codec import Codec
from proxy.protocol.output import HOLD_BYTES
from proxy.protocol.readers import (
    ChatReader,
    CompletionsReader,
    EventFlag,
    OnEvent,
    Reader,
    ResponsesReader,
    carries_usage,
)
from proxy.protocol.request import MAX_DEPTH, ParsedRequest, parse_body
from proxy.protocol.shaping import (
    ChatShape,
    CompletionsShape,
    CountTokensShape,
    EmbeddingsShape,
    MessagesShape,
    ResponsesShape,
    Shape,
)
from proxy.protocol.usage import Usage

__all__ = ["HOLD_BYTES", "MAX_DEPTH", "TRANSLATORS", "EventFlag", "ParsedRequest", "Translator",
           "carries_usage", "parse_body"]


# The most of an upstream's request id kept (theirs are some 30 characters).
REQUEST_ID_CHARS = 200


class Translator:
    operation: ClassVar[str]
    path: ClassVar[str]
    streams: ClassVar[bool] = True
    named_events: ClassVar[bool] = False  # SSE `event:` names (Responses API)
    error_shape: ClassVar[ErrorShape] = ErrorShape.OPENAI  # of the proxy's own errors
    upstream_api: ClassVar[str] = "openai"  # the UpstreamApi of the upstreams that serve it
    shape_type: ClassVar[type[Shape]]
    reader_type: ClassVar[type[Reader]] = Reader
    # The lines that start a stream's final event, as the upstream sends them: the relay keeps
    # that event from the client until the request's ledger row is spooled
    # (proxy.pipeline.ending), so a client that has it is in the books.
    final_events: ClassVar[tuple[bytes, ...]] = (b"data: [DONE]",)
    # The response headers that carry the upstream's own id of the request (the SDKs show it
    # as `request_id`), its API's first: OpenAI's `x-request-id`, Anthropic's `request-id`.
    request_id_headers: ClassVar[tuple[str, ...]] = ("x-request-id", "request-id")

    def __init__(
        self, request: ParsedRequest, ask_usage: bool = True, model: str | None = None,
        *, write_all_caps: bool = True,
    ) -> None:
        """`model`: a fallback model that serves the request instead of the one asked for.
        `ask_usage`, `write_all_caps`: the upstream's settings (see `Shape`)."""
        self.request = request
        self.model = model or request.model
        self.shape = self.shape_type(request, self.model, ask_usage, write_all_caps)
        self.reader = self.reader_type(request, self.model, sampled=self.shape.expects_usage)
        # True when the proxy, not the client, asked for stream usage: the tap then removes
        # the usage-only chunk.
        self.strips_usage = self.shape.strips_usage
        # The prompt's tokens as `estimate_prompt_tokens` counted them, once.
        self._prompt_tokens: int | None = None

    # --- request side: the shape ----------------------------------------------------------

    def max_output(self, cap: int | None) -> int:
        return self.shape.max_output(cap)

    def upstream_body(self, cap: int | None) -> bytes:
        return self.shape.upstream_body(cap)

    def choices(self) -> int:
        return self.shape.choices()

    def estimate_prompt_tokens(self) -> int:
        return self.shape.count_prompt()

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

    @property
    def codec(self) -> Codec:
        """The API shape's codec (proxy.protocol.codec): what its answers mean."""
        return self.reader_type.codec

    # --- response side: the reader ---------------------------------------------------------

    # The per-event path: the reader's own bound methods, so the tap calls the reader with no
    # call in between (a call per event is some 3% of the per-chunk cost). A subclass may
    # still override either with a method that calls `super()`'s.
    @property
    def on_event(self) -> OnEvent:
        """`Reader.on_event`: one SSE event (data, `event:` name, `carries_usage(data)` if the
        caller already knows it) -> what it carried."""
        return self.reader.on_event

    @property
    def take_content_run(self) -> Callable[[bytes, int, list[bytes], int], tuple[int, int]]:
        """`Reader.take_content_run`: a run of plain content events taken in one step."""
        return self.reader.take_content_run

    def on_body(self, body: bytes) -> None:
        self.reader.on_body(body)

    @property
    def seen_content(self) -> bool:
        return self.reader.seen_content

    @property
    def stream_error(self) -> ErrorClass | None:
        return self.reader.stream_error

    @property
    def response_model(self) -> str | None:
        return self.reader.response_model

    @property
    def terminated(self) -> bool:
        return self.reader.terminated

    @property
    def started(self) -> bool:
        return self.reader.started

    @property
    def complete(self) -> bool:
        return self.reader.complete

    def end_of_stream(self) -> bool:
        return self.reader.end_of_stream()

    def counts_usage(self) -> bool:
        return self.reader.counts_usage()

    def usage(self) -> Usage:
        return self.reader.usage(self.prompt_tokens)

    def output_tokens_so_far(self) -> int:
        return self.reader.output_tokens_so_far()

    def streamed_output_tokens(self) -> int:
        return self.reader.streamed_output_tokens()

    def prompt_usage(self) -> Usage:
        return self.reader.prompt_usage(self.prompt_tokens)

    @classmethod
    def upstream_request_id(cls, headers: Mapping[str, str]) -> str | None:
        """The upstream's id of the request, from its response's headers (None: it sent
        none). Bounded: it is booked and captured as text, and the header is the upstream's."""
        for name in cls.request_id_headers:
            value = headers.get(name)
            if value:
                return value[:REQUEST_ID_CHARS]
        return None


class ChatTranslator(Translator):
    operation = "chat"
    path = "/chat/completions"
    shape_type = ChatShape
    reader_type = ChatReader


class CompletionsTranslator(Translator):
    operation = "text_completion"
    path = "/completions"
    shape_type = CompletionsShape
    reader_type = CompletionsReader


class ResponsesTranslator(Translator):
    operation = "responses"
    path = "/responses"
    named_events = True
    final_events = (b"event: response.completed", b"event: response.incomplete",
                    b"event: response.failed", b"data: [DONE]")
    shape_type = ResponsesShape
    reader_type = ResponsesReader


class EmbeddingsTranslator(Translator):
    operation = "embeddings"
    path = "/embeddings"
    streams = False
    shape_type = EmbeddingsShape


class MessagesTranslator(Translator):
    """Anthropic's Messages API."""

    operation = "messages"
    path = "/messages"
    named_events = True
    error_shape = ErrorShape.ANTHROPIC
    upstream_api = "anthropic"
    final_events = (b"event: message_stop",)
    request_id_headers = ("request-id", "x-request-id")
    shape_type = MessagesShape
    reader_type = MessagesReader


class CountTokensTranslator(MessagesTranslator):
    """`count_tokens`: authenticated and counted as a request, but it generates nothing, so it
    reserves and charges no tokens (its answer has no `usage`)."""

    operation = "count_tokens"
    path = "/messages/count_tokens"
    streams = False
    shape_type = CountTokensShape
    reader_type = CountTokensReader


TRANSLATORS: tuple[type[Translator], ...] = (
    ChatTranslator,
    CompletionsTranslator,
    ResponsesTranslator,
    EmbeddingsTranslator,
)
