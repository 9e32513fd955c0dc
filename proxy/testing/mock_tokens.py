"""How the simulated upstream counts prompt tokens: a fixed rule of its own, not the proxy's
tokenizer, so that a test comparing the proxy's estimate with what "the upstream" reported
compares two independent counts (as with a real server), not one function with itself.

The rule, the same for every model:
- a text costs one token per word (a run of letters, digits or `_`, in any script) and one per
  other non-space character (punctuation, symbols); whitespace is free. "Hello, world!" is 4.
- a message (chat `messages[]`, Responses `input[]` items) costs 4, plus the tokens of every
  string value in it, at any depth (role, name, content, content parts' text...; keys are free).
  A message list costs 2 more, for the reply's priming.
- a token array (a list of ints) costs its length.
- an Anthropic Messages request costs its `messages` as above, plus its `system` and `tools`
  counted as strings (no per-message cost); thinking and other options are free.

The mock's generated output words (`mock_upstream.WORDS`) are one token each by this rule, and by
the proxy's tokenizer too, so output counts agree exactly; prompt counts in general do not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_TOKEN = re.compile(r"\w+|[^\w\s]")
PER_MESSAGE = 4
PER_REPLY = 2


def count_text(text: str) -> int:
    return len(_TOKEN.findall(text))


def count_texts(texts: Iterable[str]) -> int:
    return sum(map(count_text, texts))


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def count_messages(messages: list[Any]) -> int:
    return sum(PER_MESSAGE + count_texts(_strings(m)) for m in messages) + PER_REPLY


def count_anthropic(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    extra = count_texts(_strings(body.get("system"))) + count_texts(_strings(body.get("tools")))
    return count_messages(messages if isinstance(messages, list) else []) + extra
