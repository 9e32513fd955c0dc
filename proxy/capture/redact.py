"""Redaction and bounding of captured texts (pure): every text a capture keeps goes through
`Redactor.body` (or `Redactor.text`) before it is written anywhere. See docs/capture.md."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from proxy.capture.record import Body
from proxy.config.capture import DEFAULT_REDACT

REDACTED = "[REDACTED]"

# A replacement can meet its neighbours and make a new match of another pattern (or of a user's
# pattern); substitution repeats until nothing matches, at most this many rounds, so that a
# pattern that matches its own replacement cannot loop forever.
_MAX_ROUNDS = 8

# For each default pattern (proxy.config.capture.DEFAULT_REDACT, in its order): a test no text
# it matches can fail, much cheaper than the pattern's scan.
_NEEDLES: dict[str, Callable[[str], bool]] = dict(zip(DEFAULT_REDACT, (
    lambda t: "sk-" in t,
    lambda t: "bearer" in t.lower(),
    lambda t: "AKIA" in t,
    lambda t: "@" in t,
), strict=True))


@dataclass(frozen=True, slots=True)
class Redactor:
    patterns: tuple[re.Pattern[str], ...]

    @staticmethod
    def of(patterns: Iterable[str]) -> Redactor:
        """Compiled once, at configuration, not per request."""
        return Redactor(tuple(re.compile(p) for p in patterns))

    def text(self, text: str) -> str:
        """`text` with every match of every pattern replaced by `[REDACTED]`."""
        for _ in range(_MAX_ROUNDS):
            changed = False
            for pattern in self.patterns:
                # The default patterns each need a literal a text without a secret seldom has
                # (`@`, `sk-`, ...): a `str` search skips the regex scan, most of the cost.
                needle = _NEEDLES.get(pattern.pattern)
                if needle is not None and not needle(text):
                    continue
                text, n = pattern.subn(REDACTED, text)
                changed = changed or n > 0
            if not changed:
                break
        return text

    def body(self, raw: bytes, max_kb: int) -> Body:
        """`raw` decoded (UTF-8, with replacement), redacted, then cut at `max_kb` KiB of UTF-8.
        Redacting first: a cut through a secret would leave its head, which no pattern matches
        any more. `size` is the length of `raw`, before anything."""
        limit = max_kb * 1024
        text = self.text(raw.decode("utf-8", errors="replace"))
        encoded = text.encode("utf-8")
        if len(encoded) <= limit:
            return Body(text=text, size=len(raw))
        # errors="ignore" drops a character the cut went through; the cut text is redacted
        # again for patterns with anchors or lookarounds that the cut end can satisfy.
        cut = self.text(encoded[:limit].decode("utf-8", errors="ignore"))
        return Body(text=cut, size=len(raw), truncated=True)
