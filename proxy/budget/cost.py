"""What a request costs, from the price table. Pure functions.

Costs are whole nano-dollars (1e-9 USD): budgets count them in the store's integer counters and
the ledger sums them exactly; prices are USD per million tokens, so a token at $0.075/M is 75.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
from collections.abc import Mapping
from decimal import Decimal

from proxy.config.policy import Price
from proxy.protocol.usage import Usage

NANOS_PER_USD = 1_000_000_000


def price_for(prices: Mapping[str, Price], model: str) -> Price | None:
    """An exact name first, else the first glob that matches, in the table's order."""
    price = prices.get(model)
    if price is not None:
        return price
    for pattern, candidate in prices.items():
        if fnmatch.fnmatchcase(model, pattern):
            return candidate
    return None


def _nanos(tokens: int, usd_per_million: float) -> Decimal:
    # str(): the price as written in the YAML, not its binary approximation.
    return Decimal(tokens) * Decimal(str(usd_per_million)) * 1000


def cost_nanousd(price: Price, input_tokens: int, cached_input_tokens: int,
                 output_tokens: int) -> int:
    """Cached input is billed at `cached_input` when set, else at the input price. Rounded up
    to a whole nano-dollar, so a reservation of the worst case is never below the real cost."""
    cached = min(cached_input_tokens, input_tokens)
    cached_price = price.input if price.cached_input is None else price.cached_input
    total = (_nanos(input_tokens - cached, price.input) + _nanos(cached, cached_price)
             + _nanos(output_tokens, price.output))
    return math.ceil(total)


def usage_cost(price: Price, usage: Usage) -> int:
    """What `usage` costs at `price`: the one place settle and the books price a request."""
    return cost_nanousd(price, usage.input_tokens, usage.cached_input_tokens,
                        usage.output_tokens)


def price_version(prices: Mapping[str, Price]) -> str:
    """A short fingerprint of the whole price table: rows say which prices costed them."""
    table = {name: p.model_dump() for name, p in prices.items()}
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:12]
