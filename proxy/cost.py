"""What a request costs, from the price table. Pure functions.

Costs are whole nano-dollars (1e-9 USD): budgets count them in the store's integer counters and
the ledger sums them exactly; prices are USD per million tokens, so a token at $0.075/M is 75.
A layer of its own, below telemetry and the budget: the cost metric and the budget's windows
price usage alike (docs/architecture.md).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal

from proxy.config.policy import Price
from proxy.protocol.usage import Usage

NANOS_PER_USD = 1_000_000_000
_LATER_FIELDS = ("cache_write_5m", "cache_write_1h")


def price_for(prices: Mapping[str, Price], model: str) -> Price | None:
    """An exact name first, else the first glob that matches, in the table's order."""
    price = prices.get(model)
    if price is not None:
        return price
    for pattern, candidate in prices.items():
        if fnmatch.fnmatchcase(model, pattern):
            return candidate
    return None


@functools.lru_cache(maxsize=1024)
def _per_token(usd_per_million: float) -> Decimal:
    """Nano-dollars per token. str(): the price as written in the YAML, not its binary
    approximation. Cached: a price table has few prices, and this is on every request's path."""
    return Decimal(str(usd_per_million)) * 1000


def _nanos(tokens: int, usd_per_million: float) -> Decimal:
    return tokens * _per_token(usd_per_million)


# The prices a token can pay, by their Price field (and the cost metric's `type`).
KINDS = ("input", "cached_input", "cache_write_5m", "cache_write_1h", "output")


def _split(usage: Usage) -> tuple[int, int, int, int, int]:
    """`usage`'s tokens by the price they pay (KINDS' order), each token in exactly one.

    The prompt (`input_tokens`, the whole of it) splits into cache reads, cache writes (1-hour
    ones, the rest 5-minute) and the plain rest: a cache write is billed at its write price
    only, never also as input (LiteLLM's double-billing), and a cache read at the cached-input
    price, streamed or not. Counts that do not add up (more reads and writes than prompt) are
    capped to the prompt, reads first, so the prompt is never billed twice."""
    inp = usage.input_tokens
    reads = min(usage.cached_input_tokens, inp)
    writes = min(usage.cache_creation_input_tokens, inp - reads)
    hour = min(usage.cache_creation_1h_input_tokens, writes)
    return inp - reads - writes, reads, writes - hour, hour, usage.output_tokens


def _prices(price: Price) -> tuple[float, float, float, float, float]:
    """USD per million tokens, KINDS' order: an unset price is the input price."""
    inp = price.input
    return (inp, inp if price.cached_input is None else price.cached_input,
            inp if price.cache_write_5m is None else price.cache_write_5m,
            inp if price.cache_write_1h is None else price.cache_write_1h, price.output)


@dataclass(frozen=True, slots=True)
class CostLines:
    """What one request cost: the one value settle computes, from which the budget is charged,
    the ledger row and the cost metric are written. `lines`: nano-dollars by the price the
    tokens paid (KINDS' order), each rounded up to a whole nano-dollar (the metric's series);
    `nanousd`: the whole request rounded up once (what budgets and the books count), so the sum
    of the lines may exceed it by under a nano-dollar a line."""

    lines: tuple[int, ...]
    nanousd: int

    @classmethod
    def of(cls, price: Price, usage: Usage) -> CostLines:
        exact = [tokens * _per_token(usd_per_million) if tokens else Decimal(0)
                 for tokens, usd_per_million in zip(_split(usage), _prices(price), strict=True)]
        return cls(tuple(map(math.ceil, exact)), math.ceil(sum(exact)))

    def usd(self) -> tuple[tuple[str, float], ...]:
        """The lines that cost something, as (kind, USD): the cost metric's increments."""
        return tuple((kind, nanos / NANOS_PER_USD)
                     for kind, nanos in zip(KINDS, self.lines, strict=True) if nanos)


def worst_case_nanousd(price: Price, prompt_tokens: int, output_tokens: int) -> int:
    """The most a request of `prompt_tokens` and up to `output_tokens` can cost: every prompt
    token at the dearest price a prompt token can pay (plain input, a cache read or either cache
    write), so a reservation of it is never below the `CostLines` of what the request used."""
    dearest = max(_prices(price)[:4])
    return math.ceil(_nanos(prompt_tokens, dearest) + _nanos(output_tokens, price.output))


def price_version(prices: Mapping[str, Price]) -> str:
    """A short fingerprint of the whole price table: rows say which prices costed them."""
    # Unset cache-write prices are left out, so a table that sets none keeps the fingerprint it
    # had before they existed (rows costed by it still name the same version).
    table = {name: p.model_dump(exclude={k for k in _LATER_FIELDS if getattr(p, k) is None})
             for name, p in prices.items()}
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:12]
