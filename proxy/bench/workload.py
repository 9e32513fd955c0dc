"""What to send: generated prompts of an exact token length, a JSONL prompts file, and the
arrival times of an open-loop (Poisson) load."""

from __future__ import annotations

import enum
import functools
import json
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.protocol.tokenizer import count_text, encoding_name_for_model, get_encoding

# Common English words; each, with its leading space, is one pre-token of the tokenizer's regex,
# so a text made of them has exactly as many tokens as words once the multi-token ones are
# dropped (checked per encoding below, and the result counted again).
_WORDS = (  # noqa: SIM905
    "the of and to in is that it for on with as was at by be this are from or have an they "
    "which one you were her all she there would their we him been has when who will more no "
    "if out so said what up its about into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three"
).split()


class Api(enum.StrEnum):
    """The wire format spoken: OpenAI's chat completions, or Anthropic's Messages API
    (`POST .../messages`, key as `x-api-key`, `max_tokens` required, named stream events)."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class PromptsFileError(ValueError):
    """A prompts file that cannot be used; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Prompt:
    messages: tuple[dict[str, Any], ...]
    # Tokens of the messages' text as the tokenizer counts them (generated: exactly as asked).
    tokens: int
    max_tokens: int | None = None  # a prompts-file line may set its own
    # A replayed request (`bench --replay`): its recorded body, sent as it is but for the
    # model, its own `stream`, and its line in the file (what its answers are paired by).
    body: Mapping[str, Any] | None = None
    stream: bool | None = None
    line: int = 0
    # A replayed request is sent in its recorded route's API; None: the run's --api.
    api: Api | None = None


@functools.cache
def _vocabulary(encoding: str) -> tuple[str, ...]:
    enc = get_encoding(encoding)
    return tuple(w for w in (" " + word for word in _WORDS) if len(enc.encode(w)) == 1)


def generate_prompt(tokens: int, model: str, rng: random.Random) -> Prompt:
    """A user message of exactly `tokens` tokens (for `model`'s encoding) of random words: each
    prompt differs from the first token on, so no server-side prefix cache can serve it."""
    if tokens < 1:
        raise ValueError("prompt tokens must be at least 1")
    vocab = _vocabulary(encoding_name_for_model(model))
    text = "".join(rng.choices(vocab, k=tokens))
    counted = count_text(model, text)
    if counted != tokens:  # cannot happen with single-token words; guard the invariant anyway
        raise AssertionError(f"generated {counted} tokens, wanted {tokens}")
    return Prompt(({"role": "user", "content": text},), tokens)


def generate_prompts(tokens: int, model: str, count: int, seed: int) -> list[Prompt]:
    rng = random.Random(f"{seed}:{tokens}")
    return [generate_prompt(tokens, model, rng) for _ in range(count)]


def message_text(messages: list[Any]) -> str:
    parts: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(p["text"] for p in content if isinstance(p, dict)
                         and isinstance(p.get("text"), str))
    return "\n".join(parts)


def load_prompts(path: str | Path, model: str) -> list[Prompt]:
    """One chat request per line: `{"messages": [...], "max_tokens": N?}` or a bare messages
    list. Blank lines are skipped; anything else is an error naming the line."""
    p = Path(path)
    try:
        # Split on "\n" alone: a text may hold U+2028 and the like, which splitlines breaks at.
        lines = p.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptsFileError(f"{p}: cannot read: {exc}") from None
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{number}"
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise PromptsFileError(f"{where}: not JSON: {exc}") from None
        max_tokens = None
        if isinstance(item, dict):
            max_tokens = item.get("max_tokens")
            if max_tokens is not None and (
                isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
            ):
                raise PromptsFileError(f"{where}: max_tokens must be a positive integer")
            item = item.get("messages")
        if not isinstance(item, list) or not item:
            raise PromptsFileError(
                f"{where}: expected {{\"messages\": [...]}} or a non-empty list of messages")
        for m in item:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise PromptsFileError(f"{where}: every message needs a 'role' and a 'content'")
        prompts.append(Prompt(tuple(item), count_text(model, message_text(item)), max_tokens))
    if not prompts:
        raise PromptsFileError(f"{p}: no prompts in the file")
    return prompts


def poisson_arrivals(rate: float, rng: random.Random) -> Iterator[float]:
    """Offsets in seconds from the start of an open-loop run: exponential gaps of mean 1/rate."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)
