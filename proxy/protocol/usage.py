"""Token usage of one request, and reading it out of the OpenAI and Anthropic answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Source = Literal["reported", "estimated"]


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0
    # "reported": the upstream's own `usage`; "estimated": counted here with tiktoken because the
    # upstream sent none or the stream was cut before it could.
    source: Source = "reported"
    # Anthropic's prompt-cache figures as it reports them: tokens written to the cache, and read
    # from it. Both are part of input_tokens; the reads are cached_input_tokens too (what the
    # cached-input price applies to, whatever the API).
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    # Of the cache writes, those to the 1-hour cache (Anthropic's
    # cache_creation.ephemeral_1h_input_tokens), priced apart; the rest are 5-minute writes.
    cache_creation_1h_input_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


ZERO = Usage()


def usage_int(value: Any) -> int:
    # bool is an int subclass; a usage field of `true` is garbage, not 1 token.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, float) and value >= 0 and value.is_integer():
        return int(value)
    return 0


def _detail(obj: dict[str, Any], key: str, field: str) -> int:
    details = obj.get(key)
    return usage_int(details.get(field)) if isinstance(details, dict) else 0


def parse_usage(obj: Any) -> Usage | None:
    """Read a `usage` object in either naming: Chat/Completions/Embeddings (`prompt_tokens`,
    `completion_tokens`) or Responses (`input_tokens`, `output_tokens`)."""
    if not isinstance(obj, dict):
        return None
    if "input_tokens" in obj or "output_tokens" in obj:
        return Usage(
            input_tokens=usage_int(obj.get("input_tokens")),
            output_tokens=usage_int(obj.get("output_tokens")),
            cached_input_tokens=_detail(obj, "input_tokens_details", "cached_tokens"),
            reasoning_tokens=_detail(obj, "output_tokens_details", "reasoning_tokens"),
        )
    if "prompt_tokens" in obj or "completion_tokens" in obj:
        return Usage(
            input_tokens=usage_int(obj.get("prompt_tokens")),
            output_tokens=usage_int(obj.get("completion_tokens")),
            cached_input_tokens=_detail(obj, "prompt_tokens_details", "cached_tokens"),
            reasoning_tokens=_detail(obj, "completion_tokens_details", "reasoning_tokens"),
        )
    return None


# `cache_creation` (the writes by cache lifetime) is an object: kept whole, the latest wins.
ANTHROPIC_FIELDS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
                    "output_tokens", "cache_creation")


def anthropic_usage(obj: Any) -> Usage | None:
    """An Anthropic `usage` object as a `Usage`. Anthropic's `input_tokens` counts only the
    prompt tokens neither written to nor read from the prompt cache; here `input_tokens` is the
    whole prompt, as in the OpenAI shapes (see proxy.protocol.anthropic).

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
