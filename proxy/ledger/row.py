"""One request's ledger row: what the books keep about it. Never prompt or response text, never
a key (only its configured name, else the first 12 hex digits of its hash).

`COLUMNS` is the one list of the row's fields in storage order: the schema, the spool's JSON
lines, the COPY into PostgreSQL and the reports all follow it.

A NamedTuple rather than a frozen dataclass: one is made per request on settle's path, and a
30-field frozen dataclass costs about 9 us to build (a `object.__setattr__` per field) where a
tuple costs 1, and a tuple is already the JSON array the spool writes.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, get_args, get_type_hints

if TYPE_CHECKING:
    from proxy.record import RequestRecord


class LedgerRow(NamedTuple):
    request_id: str
    started_at: float  # epoch seconds, UTC
    ended_at: float
    replica: str
    user_name: str  # "user" is a reserved word in SQL
    key_name: str | None
    team: str | None
    # The API shape's `Translator.operation`: chat, text_completion, responses, embeddings,
    # messages, count_tokens.
    operation: str
    requested_model: str
    model: str | None  # sent upstream (a fallback's when one served)
    response_model: str | None  # what the upstream's answer named
    upstream: str | None
    fallback_from: str | None
    attempts: int
    status: int
    error_class: str  # ErrorClass value; "none" when it succeeded
    stream: bool
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    reasoning_tokens: int
    token_source: str  # "reported" (the upstream's usage) or "estimated" (counted here)
    ttft_ms: float | None
    upstream_ttft_ms: float | None
    overhead_ms: float | None
    duration_ms: float
    output_tokens_per_s: float | None
    cost_nanousd: int | None  # from the price table; None: the model has no price
    price_version: str | None
    windows: str  # budget windows charged, space-separated `scope:window:stamp`
    # Schema v2: prompt tokens written to the prompt cache (Anthropic), part of input_tokens.
    # Last and defaulted, so spool lines written before it still load.
    cache_creation_input_tokens: int = 0
    # Schema v3: the response cache. What it did (a CacheResult value: none, hit, miss,
    # bypass); on a hit the token columns above are 0 and these hold what the stored answer
    # used, and its cost at the price of the day of the hit (None: no price). Defaulted, so
    # spool lines written before them still load.
    cache: str = "none"
    saved_input_tokens: int = 0
    saved_output_tokens: int = 0
    saved_cached_input_tokens: int = 0
    saved_reasoning_tokens: int = 0
    saved_cache_creation_input_tokens: int = 0
    saved_cost_nanousd: int | None = None
    # Schema v4 (proxy.config.tags): the request's tags, a JSON object with its keys sorted
    # (`{}`: none). Last and defaulted, as above.
    tags: str = "{}"
    # Schema v7: the upstream's own id of the request (its `x-request-id` / `request-id`,
    # what the SDKs show as `request_id`); None: no upstream answered, or it sent none.
    upstream_request_id: str | None = None

    @staticmethod
    def of(rec: RequestRecord, replica: str) -> LedgerRow:
        """The books' part of a request's record (settle makes the record once)."""
        usage, figures, saved = rec.usage, rec.figures, rec.saved_usage
        return LedgerRow(
            request_id=rec.request_id,
            started_at=rec.started_at,
            ended_at=rec.ended_at,
            replica=replica,
            user_name=rec.user,
            key_name=rec.key,
            team=rec.team,
            operation=rec.operation,
            requested_model=rec.requested_model,
            model=rec.sent_model,
            response_model=rec.response_model,
            upstream=rec.upstream,
            fallback_from=rec.fallback_from,
            attempts=rec.attempts,
            status=rec.status,
            error_class=rec.error_class.value,
            stream=rec.stream,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_input_tokens=usage.cached_input_tokens,
            reasoning_tokens=usage.reasoning_tokens,
            token_source=usage.source,
            ttft_ms=_ms(figures.ttft),
            upstream_ttft_ms=_ms(figures.upstream_ttft),
            overhead_ms=_ms(figures.overhead),
            duration_ms=figures.duration * 1000,
            output_tokens_per_s=figures.output_tokens_per_second,
            cost_nanousd=None if rec.cost is None else rec.cost.nanousd,
            price_version=rec.price_version,
            windows=rec.windows,
            cache_creation_input_tokens=usage.cache_creation_input_tokens,
            cache=rec.cache.value,
            saved_input_tokens=saved.input_tokens,
            saved_output_tokens=saved.output_tokens,
            saved_cached_input_tokens=saved.cached_input_tokens,
            saved_reasoning_tokens=saved.reasoning_tokens,
            saved_cache_creation_input_tokens=saved.cache_creation_input_tokens,
            saved_cost_nanousd=None if rec.saved_cost is None else rec.saved_cost.nanousd,
            tags=rec.tags.json(),
            upstream_request_id=rec.upstream_request_id,
        )

    @property
    def cost_usd(self) -> Decimal | None:
        return None if self.cost_nanousd is None else Decimal(self.cost_nanousd).scaleb(-9)

    def to_json(self) -> bytes:
        """One spool line (newline included)."""
        return json.dumps(self, separators=(",", ":")).encode() + b"\n"

    @staticmethod
    def from_json(line: bytes | str) -> LedgerRow:
        values: list[Any] = json.loads(line)
        return LedgerRow(*values)


COLUMNS: tuple[str, ...] = LedgerRow._fields
# Columns added by later schema versions come last, with defaults: a spool line written by an
# older tokenmeter has fewer values and takes these for the ones it lacks.
_LATER = tuple(LedgerRow._field_defaults.values())


def complete(values: list[Any]) -> bool:
    """A spool line's values made a whole row in place: a line of an older schema version
    gets the defaults of the columns added since. False: not a ledger row's width."""
    missing = len(COLUMNS) - len(values)
    if missing == 0:
        return True
    if not 0 < missing <= len(_LATER):
        return False
    values.extend(_LATER[len(_LATER) - missing:])
    return True


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000

# Text a ledger database cannot keep as it is: NUL (PostgreSQL's text cannot hold it; SQLite
# keeps it, but its own functions end the string there) and lone surrogates (no UTF-8 form:
# neither driver can send them). JSON carries both, so an upstream's echo of a model name can (the
# proxy refuses control characters in the model a client sends, not in what upstreams answer).
# A row must never be lost for such a value: each is stored as U+FFFD, which says where it was.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_TEXT = tuple(i for i, hint in enumerate(get_type_hints(LedgerRow).values())
              if hint is str or str in get_args(hint))
_texts = itemgetter(*_TEXT)


def storable(values: list[Any]) -> list[Any]:
    """A spool line's values with every text column made storable (see `_UNSTORABLE`), in
    place: what each sink's `prepare` starts with. The usual row (ASCII, no NUL) is told apart
    in one pass over its joined text (about 1 us, a sixth of what parsing its line costs)."""
    try:
        joined = "".join(filter(None, _texts(values)))
    except TypeError:  # a text column holding another type: looked at one by one below
        joined = "\x00"
    if "\x00" not in joined and joined.isascii():
        return values
    for i in _TEXT:
        value = values[i]
        if value.__class__ is str and _UNSTORABLE.search(value):
            values[i] = _UNSTORABLE.sub("\ufffd", value)
    return values
