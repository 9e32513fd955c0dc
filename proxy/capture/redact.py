"""Redaction and bounding of captured texts (pure): every text a capture keeps goes through
`Redactor.body` (or `Redactor.text`) before it is written anywhere. See docs/capture.md."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from proxy.capture.record import Body

REDACTED = "[REDACTED]"

# A replacement can meet its neighbours and make a new match of another pattern (or of a user's
# pattern); substitution repeats until nothing matches, at most this many rounds, so that a
# pattern that matches its own replacement cannot loop forever.
_MAX_ROUNDS = 8


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
