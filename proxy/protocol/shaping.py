"""Request shaping, one class per API shape: what goes upstream for an attempt, as a return
value. From the client's parsed body (`proxy.protocol.request`), a shape says the most output
tokens the request can produce under a granted cap (`max_output`), the body that enforces that
cap (`upstream_body`: the client's own bytes when nothing changes), how many generations the
upstream bills (`choices`), whether the proxy asked for stream usage the client did not
(`strips_usage`), and the prompt's estimated tokens (`count_prompt`). A shape keeps no trace of
what it returned: every attempt asks again with its own cap.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from proxy.errors import InvalidRequest
from proxy.protocol import tokenizer
from proxy.protocol.apis import chat, completions, messages, responses
from proxy.protocol.request import ParsedRequest, positive_int, strings


@dataclass(frozen=True, slots=True)
class Shape:
    """`model`: the model that serves the request (a fallback's, if not the one asked for).
    `ask_usage`: the upstream's `stream_usage` setting. `write_all_caps`: its `cap_fields`
    policy (see `_capped`)."""

    request: ParsedRequest
    model: str
    ask_usage: bool = True
    write_all_caps: bool = True

    # Every field of this API shape that limits output tokens per choice. Servers differ in
    # which one they honour (llama-cpp-python ignores max_completion_tokens; OpenAI's reasoning
    # models refuse max_tokens), so the cap is enforced on all of them.
    cap_fields: ClassVar[tuple[str, ...]] = ()
    # What the upstream does without a cap field: None = no bound.
    implicit_cap: ClassVar[int | None] = None
    # Fields that ask for several generations, each billed (`n`, `best_of`).
    choice_fields: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        """The shape's own checks of the body, beyond `parse_body`'s (none here)."""

    @property
    def strips_usage(self) -> bool:
        """The proxy, not the client, asked for stream usage: the usage-only chunk is then
        removed so the client parses exactly what it would without the proxy."""
        return False

    @property
    def expects_usage(self) -> bool:
        """The upstream was asked to report the usage of this stream."""
        return False

    def _changes(self) -> dict[str, Any]:
        """The changes every attempt sends, whatever its cap: the serving model, if another."""
        return {"model": self.model} if self.model != self.request.model else {}

    def max_output(self, cap: int | None) -> int:
        """The most output tokens the request can produce under `cap`, all choices together
        (0: unbounded): what admission asks for, without building the body (see `_capped`,
        whose 400s it raises)."""
        return self._capped(cap)[1]

    def upstream_body(self, cap: int | None) -> bytes:
        """What goes upstream for this attempt, with `cap` enforced (see `_capped`): the
        client's own bytes when nothing changes, else its JSON with the changes, serialized
        once. A cap of `max_output(c)` writes the same body as `c` (the same per-choice
        limits)."""
        changes = {**self._changes(), **self._capped(cap)[0]}
        if not changes:
            return self.request.raw
        return json.dumps({**self.request.body, **changes}, separators=(",", ":")).encode()

    def choices(self) -> int:
        """How many generations the upstream runs (and bills) for this request."""
        count = 1
        for field in self.choice_fields:
            value = positive_int(self.request.body, field)
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
        sent = {f: v for f in self.cap_fields if (v := positive_int(body, f)) is not None}
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

    def count_prompt(self) -> int:
        """The prompt's estimated tokens: bounded (see `tokenizer.PROMPT_BUDGET`), but up to a
        fifth of a second for a large prompt."""
        raise NotImplementedError


class _ChoicesShape(Shape):
    """Chat Completions and legacy Completions: `stream_options` asks for stream usage."""

    def _client_asked_usage(self) -> bool:
        options = self.request.body.get("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True

    @property
    def strips_usage(self) -> bool:
        return self.request.stream and self.ask_usage and not self._client_asked_usage()

    @property
    def expects_usage(self) -> bool:
        return self.strips_usage or self._client_asked_usage()

    def _changes(self) -> dict[str, Any]:
        changes = Shape._changes(self)
        if self.strips_usage:
            options = self.request.body.get("stream_options")
            new_options = dict(options) if isinstance(options, dict) else {}
            new_options["include_usage"] = True
            changes["stream_options"] = new_options
        return changes


class ChatShape(_ChoicesShape):
    # max_tokens is deprecated (and refused by OpenAI's reasoning models); llama-cpp-python and
    # others honour only max_tokens. Which ones are written is the upstream's setting.
    cap_fields = chat.CAP_FIELDS
    choice_fields = ("n",)

    def count_prompt(self) -> int:
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



class CompletionsShape(_ChoicesShape):
    cap_fields = completions.CAP_FIELDS
    implicit_cap = 16  # the legacy API's documented default
    # best_of candidates are generated (and billed) server-side, n of them returned.
    choice_fields = ("n", "best_of")

    def count_prompt(self) -> int:
        return _count_prompt_input(self.model, self.request.body.get("prompt"))


class ResponsesShape(Shape):
    cap_fields = responses.CAP_FIELDS

    @property
    def expects_usage(self) -> bool:
        return True  # `response.completed` carries it

    def count_prompt(self) -> int:
        body = self.request.body
        value = body.get("input")
        instructions = strings(body.get("instructions"))
        if isinstance(value, list):
            return tokenizer.count_messages(self.model, value, instructions)
        return tokenizer.count_texts(self.model, itertools.chain(strings(value), instructions))


class EmbeddingsShape(Shape):
    def count_prompt(self) -> int:
        return _count_prompt_input(self.model, self.request.body.get("input"))


class MessagesShape(Shape):
    """Anthropic's Messages API."""

    cap_fields: ClassVar[tuple[str, ...]] = messages.CAP_FIELDS

    def __post_init__(self) -> None:
        if self.cap_fields and self.request.body.get("max_tokens") is None:
            # Required by the API: refused here rather than capped, as the upstream would.
            raise InvalidRequest("max_tokens: Field required", param="max_tokens")

    @property
    def expects_usage(self) -> bool:
        return True  # message_start and message_delta carry it

    def count_prompt(self) -> int:
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


class CountTokensShape(MessagesShape):
    """Anthropic's `count_tokens`: it generates nothing, so it has no cap and no prompt to
    reserve for (see `proxy.protocol.anthropic.CountTokensReader`)."""

    cap_fields = ()

    def count_prompt(self) -> int:
        return 0
