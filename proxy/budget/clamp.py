"""Admission under `clamp`: how many output tokens a request is granted when its worst case does
not fit the room left in its windows. Pure functions; the memory store calls them, and the Redis
store's scripts call their one Lua rendering, `grant` and `room_for_output` in
proxy/budget/lua/prelude.lua (tests/budget/test_store_conformance.py holds the two in step).

Each window counts `base + rate * output` for a request: its amount with no output (the prompt
in a TOTAL or INPUT window, 1 in a REQUESTS window, the prompt's cost in a COST window) plus a
whole number per output token (1 in TOTAL and OUTPUT windows, 0 in INPUT and REQUESTS windows,
which no output cap can make room in, and the model's output price in nano-dollars rounded up in
COST windows, so a clamped cost reservation is never below what the granted tokens can cost).
A window with limit `L` and `U` used leaves room for `floor((L - U - base) / rate)` output
tokens; the grant is the least of those and the tokens asked for. It is refused below the
minimum, at the window that allowed the fewest.

How concurrent requests share a small remainder: the grant is computed and reserved in one
atomic store step (reserve-then-clamp), so requests are served first come, first served, each
taking what is left at its turn (up to what it asked for). The remainder is never promised
twice, and a request is refused only when what is left at its turn is below its own minimum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from proxy.config.policy import Admission, AdmissionPolicy, Price

# The configuration's defaults, taken from its schema: a rule no level sets anything of.
_SCHEMA = Admission()


@dataclass(frozen=True, slots=True)
class AdmissionRule:
    """A principal's admission policy, resolved from the configuration once per key."""

    policy: AdmissionPolicy = _SCHEMA.policy
    min_output_tokens: int = _SCHEMA.min_output_tokens
    # `estimate`: what a stream reserves before any history
    initial_estimate: int = _SCHEMA.initial_estimate

    @property
    def clamps(self) -> bool:
        """Clamped when the worst case does not fit: `clamp`, and `estimate` (whose requests
        that are not topped up, the non-streamed ones, fall back to `clamp`)."""
        return self.policy is not AdmissionPolicy.WORST_CASE

    @property
    def estimates(self) -> bool:
        return self.policy is AdmissionPolicy.ESTIMATE


WORST_CASE = AdmissionRule()


def resolve(*levels: Admission | None) -> AdmissionRule:
    """Field by field, the first level (most specific first: key, user, team, defaults) that
    sets a field gives it; a field set nowhere keeps the schema's default."""
    values: dict[str, Any] = {}
    for level in levels:
        if level is None:
            continue
        for name in level.model_fields_set:
            values.setdefault(name, getattr(level, name))
    if not values:
        return WORST_CASE
    merged = Admission.model_construct(**values)  # the levels' values, validated already
    return AdmissionRule(merged.policy, merged.min_output_tokens, merged.initial_estimate)


@dataclass(frozen=True, slots=True)
class Clamp:
    """What a store needs to clamp a reservation: per entry (parallel to the entries), its
    amount with no output and its amount per output token; the output asked for and the
    fewest output tokens worth admitting (`minimum <= requested`)."""

    requested: int
    minimum: int
    bases: tuple[int, ...]
    rates: tuple[int, ...]

    def amounts(self, granted: int) -> tuple[int, ...]:
        """What a request granted `granted` output tokens reserves in each window."""
        return tuple(b + r * granted for b, r in zip(self.bases, self.rates, strict=True))


@dataclass(frozen=True, slots=True)
class Fit:
    """The output tokens that fit the windows (not `proxy.budget.admission.Grant`, what an
    attempt is granted, which this is a step of)."""

    output: int  # output tokens that fit, at most those asked (below `minimum`: refused)
    binding: int | None  # the entry that allowed the fewest, when below what was asked


def room_for_output(limit: int | None, used: int, base: int, rate: int) -> int | None:
    """The output tokens one window has room for: None when unbounded (no limit, or a window
    that output does not count in and whose base fits), -1 when not even the base fits."""
    if limit is None:
        return None
    room = limit - used - base
    if room < 0:
        return -1
    if rate == 0:
        return None
    return room // rate


def grant(clamp: Clamp, limits: Sequence[int | None], used: Sequence[int]) -> Fit:
    """The output tokens a request gets given each window's limit and use (see the module)."""
    granted, binding = clamp.requested, None
    for i, (limit, u, base, rate) in enumerate(
        zip(limits, used, clamp.bases, clamp.rates, strict=True)
    ):
        fits = room_for_output(limit, u, base, rate)
        if fits is not None and fits < granted:
            granted, binding = fits, i
    return Fit(granted, binding)


def output_rate(price: Price) -> int:
    """Nano-dollars per output token, rounded up to a whole one."""
    return math.ceil(Decimal(str(price.output)) * 1000)
