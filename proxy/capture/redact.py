"""Redaction and bounding of captured texts (pure): every text a capture keeps goes through
`Redactor.body` (or `Redactor.text`) before it is written anywhere. See docs/capture.md.

Besides its patterns, a Redactor removes the keys the proxy knows (the configured upstream
keys, the request's own client key) literally, whatever they look like, in each form a key
takes in the texts a capture keeps: as is, JSON-escaped (`"`, `\\`, `/` as `\\/`, non-ASCII or
every character as `\\uXXXX`), and JSON-escaped twice (a key inside a JSON string inside JSON,
as tool arguments are)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from proxy.capture.record import Body
from proxy.config.capture import DEFAULT_REDACT
from proxy.protocol.secrets import key_forms

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


# A key shorter than this is not removed literally: "abc" would take every "abc" out of every
# text. Keys the proxy issues or is given are far longer; a shorter one is a test's or a typo.
MIN_KEY = 8


@dataclass(frozen=True, slots=True)
class Redactor:
    patterns: tuple[re.Pattern[str], ...]
    # The known keys' forms (`key_forms`), longest first; kept out of the repr: keys are never
    # logged, even by a traceback's or a debugger's look at a capture waiting to be made.
    literals: tuple[str, ...] = field(default=(), repr=False)

    @staticmethod
    def of(patterns: Iterable[str], keys: Iterable[str | None] = ()) -> Redactor:
        """Compiled once, at configuration, not per request; `keys` removed literally."""
        return Redactor(tuple(re.compile(p) for p in patterns)).with_keys(keys)

    def with_keys(self, keys: Iterable[str | None]) -> Redactor:
        """This redactor, also removing `keys` (each in every form of `key_forms`). Cheap: a
        request's own key is added per request."""
        forms = {f for k in keys if k is not None and len(k) >= MIN_KEY for f in key_forms(k)}
        if not forms - set(self.literals):
            return self
        merged = sorted(forms | set(self.literals), key=len, reverse=True)
        return replace(self, literals=tuple(merged))

    def __call__(self, text: str) -> str:
        return self.text(text)

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Where in `text` something would be redacted (every literal's and every pattern's
        matches, overlapping ones merged), in order. What a stream's redaction uses to find a
        secret its events split between them."""
        found: list[tuple[int, int]] = []
        for literal in self.literals:
            at = text.find(literal)
            while at >= 0:
                found.append((at, at + len(literal)))
                at = text.find(literal, at + len(literal))
        for pattern in self.patterns:
            needle = _NEEDLES.get(pattern.pattern)
            if needle is not None and not needle(text):
                continue
            found += [m.span() for m in pattern.finditer(text) if m.end() > m.start()]
        merged: list[tuple[int, int]] = []
        for start, end in sorted(found):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    def text(self, text: str) -> str:
        """`text` with every known key (in each of its forms) and every match of every pattern
        replaced by `[REDACTED]`."""
        for literal in self.literals:  # before the patterns, which could take a key's head
            if literal in text:
                text = text.replace(literal, REDACTED)
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
