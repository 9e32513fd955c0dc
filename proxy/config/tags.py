"""Request tags: what a request was for (`feature=faq`, `env=prod`, `customer=acme`), beside
who paid for it. The operator's rules (`tags:` in the config), the frozen `Tags` a request
carries from admission to its ledger row, and the one place a client's tags are read.

Here, in the config layer, because a tag is only ever what the rules let through: the rules
and their one application live together, and every layer above (the principal's default tags,
the record, the metrics, the ledger) can hold the value.

Sources, later ones winning per key: the user's default tags, the key's, the OpenAI body's
`metadata` (string values; forwarded to the upstream untouched), the `x-tokenmeter-tags`
header. A tag the rules do not accept is dropped and counted by reason, never an error: a
client's tags must not fail its request. Everything is bounded before it is looked at: the
header's length, and how many tags each source may bring.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pydantic import Field, model_validator

from proxy.config.policy import ConfigModel

HEADER = "x-tokenmeter-tags"
# A tag key: a word, safe as a JSON key, a JSON path step and a label value as it is.
KEY = r"^[a-z][a-z0-9_]{0,31}$"
_KEY = re.compile(KEY)
# A closed list's values: plain words (they become Prometheus label values).
VALUE = r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,63}$"
# Free values: any text but control characters (they reach terminals and CSV cells, which
# `shown_text` guards, and log lines) and lone surrogates (a header's undecodable bytes, as
# aiohttp passes them: PostgreSQL's jsonb, which the reports cast the column to, refuses their
# escapes, and one such row would fail every report).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# The header is refused whole past this many characters, before it is split.
MAX_HEADER_CHARS = 1024
# Tags one source (the header, the body's metadata) may bring; the rest are dropped.
MAX_TAGS = 16
MAX_FREE_LENGTH = 256


class TagRule(ConfigModel):
    """`tags.<key>`: a closed list of values (`values: [faq, search]`; such a key is a
    Prometheus label) or free text (`free: true`, up to `max_length` characters; the books
    only)."""

    values: list[str] | None = None
    free: bool = False
    max_length: int = Field(default=64, ge=1, le=MAX_FREE_LENGTH)

    @model_validator(mode="after")
    def _one_kind(self) -> TagRule:
        if (self.values is None) == (not self.free):
            raise ValueError("a tag key takes either `values: [...]` or `free: true`")
        for value in self.values or ():
            if not re.match(VALUE, value):
                raise ValueError(f"tag value {value!r} must match {VALUE}")
        return self


class TagDrop(enum.StrEnum):
    """Why a client's tag was dropped: `tokenmeter_tags_dropped_total`'s `reason`."""

    UNDECLARED = "undeclared"  # a key `tags:` does not declare
    NOT_LISTED = "not_listed"  # a value not in its key's closed list
    TOO_LONG = "too_long"  # a free value over its key's max_length
    MALFORMED = "malformed"  # not `key=value`, a value not a string, control characters
    TOO_MANY = "too_many"  # past MAX_TAGS in one source
    HEADER_TOO_LONG = "header_too_long"  # the whole header, past MAX_HEADER_CHARS


@dataclass(frozen=True, slots=True)
class Tag:
    key: str
    value: str
    closed: bool  # its key has a closed list: a Prometheus label


@dataclass(frozen=True, slots=True)
class Tags:
    """A request's tags, sorted by key, one value each."""

    items: tuple[Tag, ...] = ()

    def over(self, base: Tags) -> Tags:
        """These tags over `base`'s: a key in both takes this value."""
        if not base.items:
            return self
        if not self.items:
            return base
        merged = {t.key: t for t in base.items} | {t.key: t for t in self.items}
        return Tags(tuple(merged[k] for k in sorted(merged)))

    def json(self) -> str:
        """The ledger's `tags` column: a JSON object, keys sorted, no spaces."""
        if not self.items:  # most requests: no encoder call on settle's path
            return "{}"
        return json.dumps({t.key: t.value for t in self.items}, separators=(",", ":"))

    @property
    def closed(self) -> tuple[Tag, ...]:
        return tuple(t for t in self.items if t.closed)


NO_TAGS = Tags()


@dataclass(frozen=True, slots=True)
class Read:
    """A source's tags as the rules left them, and what they dropped."""

    tags: Tags
    dropped: tuple[TagDrop, ...]


class TagRules:
    """The configured rules, applied: built once per configuration version."""

    def __init__(self, rules: Mapping[str, TagRule]) -> None:
        self._rules = dict(rules)
        self._lists = {k: frozenset(r.values) for k, r in rules.items() if r.values is not None}

    @property
    def enabled(self) -> bool:
        return bool(self._rules)

    def check(self, key: str, value: object) -> Tag | TagDrop:
        rule = self._rules.get(key)
        if rule is None:
            return TagDrop.UNDECLARED
        if not isinstance(value, str) or not value or _CONTROL.search(value):
            return TagDrop.MALFORMED
        allowed = self._lists.get(key)
        if allowed is not None:
            return Tag(key, value, closed=True) if value in allowed else TagDrop.NOT_LISTED
        if len(value) > rule.max_length:
            return TagDrop.TOO_LONG
        return Tag(key, value, closed=False)

    def apply(self, pairs: Iterable[tuple[str, object]]) -> Read:
        """At most MAX_TAGS pairs are looked at; the rest count as dropped, unread."""
        kept: dict[str, Tag] = {}
        dropped: list[TagDrop] = []
        for i, (key, value) in enumerate(pairs):
            if i >= MAX_TAGS:
                dropped.append(TagDrop.TOO_MANY)
                break
            found = self.check(key, value)
            if isinstance(found, Tag):
                kept[key] = found
            else:
                dropped.append(found)
        return Read(Tags(tuple(kept[k] for k in sorted(kept))), tuple(dropped))

    def defaults(self, *levels: Mapping[str, str] | None) -> Tags:
        """A principal's default tags: later levels win per key. Checked at load
        (`Config`), so nothing here is dropped."""
        tags = NO_TAGS
        for level in levels:
            if level:
                tags = self.apply(level.items()).tags.over(tags)
        return tags

    def header(self, text: str | None) -> Read:
        """`feature=faq, env=prod`: bounded before it is split."""
        if not text or not self._rules:
            return Read(NO_TAGS, ())
        if len(text) > MAX_HEADER_CHARS:
            return Read(NO_TAGS, (TagDrop.HEADER_TOO_LONG,))
        pairs: list[tuple[str, object]] = []
        for part in text.split(",", MAX_TAGS + 1)[: MAX_TAGS + 1]:
            if part.strip():  # `a=b,` or `a=b,,c=d`: an empty item is no tag at all
                key, eq, value = part.partition("=")
                pairs.append((key.strip(), value.strip() if eq else None))
        return self.apply(pairs)

    def metadata(self, body: Mapping[str, object]) -> Read:
        """An OpenAI body's `metadata` object (string values, as the API takes them). Only
        the declared keys are read: the object is the upstream's field, which clients use for
        their own ends too, so its other keys are not tags and not counted as dropped (and it
        is looked up by the declared keys, however many keys it holds)."""
        meta = body.get("metadata")
        if not isinstance(meta, dict) or not meta or not self._rules:
            return Read(NO_TAGS, ())
        return self.apply((key, meta[key]) for key in self._rules if key in meta)


def check_defaults(rules: Mapping[str, TagRule], where: str,
                   tags: Mapping[str, str]) -> None:
    """A default tag in YAML the rules would drop is a configuration error, not a drop."""
    applied = TagRules(rules)
    for key, value in tags.items():
        found = applied.check(key, value)
        if not isinstance(found, Tag):
            raise ValueError(f"{where}.tags.{key}: {value!r} is not accepted by `tags:` "
                             f"({found.value})")


def valid_key(key: str) -> bool:
    return bool(_KEY.match(key))
