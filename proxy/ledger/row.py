"""One request's ledger row: what the books keep about it. Never prompt or response text, never
a key (only its configured name, else the first 12 hex digits of its hash).

`COLUMNS` is the one list of the row's fields in storage order: the schema, the spool's JSON
lines, the COPY into PostgreSQL and the reports all follow it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from decimal import Decimal
from typing import Any


@dataclass(frozen=True, slots=True)
class LedgerRow:
    request_id: str
    started_at: float  # epoch seconds, UTC
    ended_at: float
    replica: str
    user_name: str  # "user" is a reserved word in SQL
    key_name: str | None
    team: str | None
    operation: str  # chat.completions, completions, embeddings, responses
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

    @property
    def cost_usd(self) -> Decimal | None:
        return None if self.cost_nanousd is None else Decimal(self.cost_nanousd).scaleb(-9)

    def to_json(self) -> bytes:
        """One spool line (newline included)."""
        return json.dumps(dataclasses.astuple(self), separators=(",", ":")).encode() + b"\n"

    @staticmethod
    def from_json(line: bytes | str) -> LedgerRow:
        values: list[Any] = json.loads(line)
        return LedgerRow(*values)


COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(LedgerRow))
