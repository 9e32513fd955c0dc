"""One translator per API shape, created per request.

A translator validates the client's body and says what to send upstream; then it reads the
response on the side of the relay (`on_event` per SSE event, or `on_body` for a JSON response)
and knows the request's usage. The relay forwards the upstream's original bytes; translators only
look at them.

The per-event path runs for every streamed chunk (14,000 a second on fast hardware), so after the
first content token it classifies events with substring tests instead of parsing JSON. JSON is
parsed only for the events that matter: until the first token, events that carry `usage` or a
`finish_reason`, and (only if the upstream reported no usage) the content events at the end, to
count them with tiktoken.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy import tokenizer
from proxy.errors import InvalidRequest
from proxy.usage import Usage, parse_usage

CONTENT = 1  # the event carries output tokens (text, reasoning, tool-call arguments)
FINISH = 2  # a choice (or the whole response) ended
USAGE_ONLY = 4  # a chunk with usage and no choices: ours to drop if we asked for it


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


def parse_body(raw: bytes) -> ParsedRequest:
    try:
        body = json.loads(raw)
    except ValueError:
        raise InvalidRequest(
            "We could not parse the JSON body of your request. The body must be a JSON object."
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        head = _BaseBody.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if param == "model" and err["type"] == "missing":
            raise InvalidRequest("you must provide a model parameter", param="model") from None
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}", param=param) from None
    return ParsedRequest(model=head.model, stream=head.stream, body=body, raw=raw)


def _loads(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _strings(*values: Any) -> Iterable[str]:
    return (v for v in values if isinstance(v, str) and v)


class Translator:
    operation: ClassVar[str]
    path: ClassVar[str]
    streams: ClassVar[bool] = True
    named_events: ClassVar[bool] = False  # SSE `event:` names (Responses API)

    def __init__(
        self, request: ParsedRequest, ask_usage: bool = True, model: str | None = None
    ) -> None:
        """`model`: a fallback model that serves the request instead of the one asked for."""
        self.request = request
        self.model = model or request.model
        self._reported: Usage | None = None
        self._content: list[bytes] = []
        self._body: dict[str, Any] | None = None
        self.seen_content = False
        # True when the proxy, not the client, asked for stream usage: the usage-only chunk is
        # then removed so the client parses exactly what it would without the proxy.
        self.strips_usage = False
        self._changes: dict[str, Any] = {}
        if self.model != request.model:
            self._changes["model"] = self.model

    # --- request side -------------------------------------------------------------------
    # Output-cap fields in the order a client may use them; the first is set when none is.
    cap_fields: ClassVar[tuple[str, ...]] = ()
    # What the upstream does without a cap field: None = no bound (so we set one).
    implicit_cap: ClassVar[int | None] = None

    def upstream_body(self) -> bytes:
        """The client's bytes when nothing changed; else its JSON with our changes, once."""
        if not self._changes:
            return self.request.raw
        return json.dumps({**self.request.body, **self._changes}, separators=(",", ":")).encode()

    def cap_output(self, cap: int | None) -> int:
        """Enforce `cap` on the request's output: set it if the client sent no limit, clamp it
        if the client asked for more. Returns the most output tokens the request can produce
        (with no cap: what the client asked for, 0 if unbounded). None leaves the body alone."""
        if not self.cap_fields:
            return 0
        body = self.request.body
        for field in self.cap_fields:
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool):
                if cap is not None and value > cap:
                    self._changes[field] = cap
                    return cap
                return max(value, 0)
        if self.implicit_cap is not None:
            return self.implicit_cap if cap is None else min(self.implicit_cap, cap)
        if cap is None:
            return 0
        self._changes[self.cap_fields[0]] = cap
        return cap

    def estimate_prompt_tokens(self) -> int:
        raise NotImplementedError

    # --- response side ------------------------------------------------------------------
    def on_event(self, data: bytes, name: str | None) -> int:
        """One SSE event: its data and its `event:` name. Returns CONTENT/FINISH/USAGE_ONLY."""
        return 0

    def on_body(self, body: bytes) -> None:
        self._body = _loads(body)
        self._reported = parse_usage(self._body.get("usage"))

    def _output_texts(self) -> Iterable[str]:
        return ()

    def usage(self) -> Usage:
        """Latest cumulative usage the upstream reported, else a tiktoken estimate of what was
        sent so far (prompt plus the output actually streamed)."""
        if self._reported is not None:
            return self._reported
        return Usage(
            input_tokens=self.estimate_prompt_tokens(),
            output_tokens=tokenizer.count_texts(self.model, self._output_texts()),
            source="estimated",
        )


class _ChoicesTranslator(Translator):
    """Chat Completions and legacy Completions: `choices[]` chunks and `stream_options`."""

    def __init__(
        self, request: ParsedRequest, ask_usage: bool = True, model: str | None = None
    ) -> None:
        super().__init__(request, ask_usage, model)
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

    def _classify(self, data: bytes, obj: dict[str, Any]) -> int:
        flags = 0
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return 0
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                flags |= FINISH
            if not flags & CONTENT and any(True for _ in self._choice_texts(choice)):
                flags |= CONTENT
        if flags & CONTENT:
            self.seen_content = True
            self._content.append(data)
        return flags

    def on_event(self, data: bytes, name: str | None) -> int:
        if data[:1] != b"{":
            return 0  # "[DONE]"
        if b'"usage":{' in data or b'"usage": {' in data:
            obj = _loads(data)
            usage = parse_usage(obj.get("usage"))
            if usage is not None:
                self._reported = usage  # latest cumulative usage wins
            if not obj.get("choices"):
                return USAGE_ONLY
            return self._classify(data, obj)
        if (
            not self.seen_content
            or b'"finish_reason":"' in data
            or b'"finish_reason": "' in data
            or b'"content":""' in data
        ):
            return self._classify(data, _loads(data))
        self._content.append(data)
        return CONTENT

    def _output_texts(self) -> Iterable[str]:
        if self._body is not None:
            choices = self._body.get("choices")
            for choice in choices if isinstance(choices, list) else ():
                if isinstance(choice, dict):
                    yield from self._choice_texts(choice)
            return
        for data in self._content:
            for choice in _loads(data).get("choices") or ():
                if isinstance(choice, dict):
                    yield from self._choice_texts(choice)


class ChatTranslator(_ChoicesTranslator):
    operation = "chat"
    path = "/chat/completions"
    # max_tokens is deprecated (and refused by reasoning models); vLLM and others take both.
    cap_fields = ("max_completion_tokens", "max_tokens")

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
    """`prompt` / `input` as a string, a list of strings, a token array or a list of those."""
    if isinstance(value, str):
        return tokenizer.count_text(model, value)
    if isinstance(value, list):
        if all(isinstance(v, int) for v in value):
            return len(value)
        return sum(_count_prompt_input(model, v) for v in value)
    return 0


class CompletionsTranslator(_ChoicesTranslator):
    operation = "text_completion"
    path = "/completions"
    cap_fields = ("max_tokens",)
    implicit_cap = 16  # the legacy API's documented default

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

    def on_event(self, data: bytes, name: str | None) -> int:
        kind = name
        obj: dict[str, Any] | None = None
        if kind is None:  # servers that omit `event:` lines still put the type in the data
            obj = _loads(data)
            kind = obj.get("type") if isinstance(obj.get("type"), str) else None
        if kind in _RESPONSES_DELTAS:
            self.seen_content = True
            self._content.append(data)
            return CONTENT
        if kind in _RESPONSES_TERMINAL:
            obj = obj if obj is not None else _loads(data)
            response = obj.get("response")
            if isinstance(response, dict):
                usage = parse_usage(response.get("usage"))
                if usage is not None:
                    self._reported = usage
            return FINISH
        return 0

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
        for data in self._content:
            yield from _strings(_loads(data).get("delta"))

    def estimate_prompt_tokens(self) -> int:
        body = self.request.body
        value = body.get("input")
        count = 0
        if isinstance(value, str):
            count = tokenizer.count_text(self.model, value)
        elif isinstance(value, list):
            count = tokenizer.count_messages(self.model, value)
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            count += tokenizer.count_text(self.model, instructions)
        return count


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
