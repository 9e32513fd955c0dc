"""The `clamp` admission policy's arithmetic, its configuration and the in-process store's use
of it (the Redis script is checked against the same store in tests/budget/test_admission_clamp.py)."""

from __future__ import annotations

import random

import pydantic
import pytest

from proxy.auth import UserIndex
from proxy.budget.clamp import (
    WORST_CASE,
    AdmissionRule,
    Clamp,
    Fit,
    grant,
    output_rate,
    resolve,
    room_for_output,
)
from proxy.budget.limits import reserve_cost
from proxy.config.policy import Admission, AdmissionPolicy, Policy, Price
from proxy.cost import CostLines
from proxy.identity import key_hash
from proxy.protocol.usage import Usage

pytestmark = pytest.mark.unit

CLAMP = AdmissionPolicy.CLAMP


def test_room_for_output_per_window() -> None:
    assert room_for_output(None, 10**9, 5, 1) is None  # no limit
    assert room_for_output(1000, 200, 100, 1) == 700  # tokens: limit - used - prompt
    assert room_for_output(1000, 200, 100, 0) is None  # input or requests: output is free
    assert room_for_output(1000, 950, 100, 0) == -1  # ... but the prompt itself does not fit
    assert room_for_output(1000, 950, 100, 1) == -1
    assert room_for_output(10_000, 0, 1000, 3) == 3000  # cost: whole tokens at 3 nanos each
    assert room_for_output(10_000, 0, 1000, 7) == 1285  # rounded down, never over


def test_grant_takes_the_least_room_and_names_its_window() -> None:
    # TOTAL (prompt 100), INPUT, OUTPUT, REQUESTS, COST (base 500, 4 per token)
    clamp = Clamp(32_000, 256, (100, 100, 0, 1, 500), (1, 0, 1, 0, 4))
    assert grant(clamp, (None,) * 5, (0,) * 5) == Fit(32_000, None)
    assert grant(clamp, (20_000, None, None, None, None), (0,) * 5) == Fit(19_900, 0)
    assert grant(clamp, (20_000, None, 5_000, None, None), (0, 0, 1_000, 0, 0)) == Fit(4_000, 2)
    assert grant(clamp, (20_000, None, None, None, 40_500), (0,) * 5) == Fit(10_000, 4)
    # The input window has room for the prompt: output is not limited by it.
    assert grant(clamp, (None, 150, None, None, None), (0, 50, 0, 0, 0)) == Fit(32_000, None)
    # ... and has not: refused there (below any minimum), whatever the other windows hold.
    assert grant(clamp, (None, 150, None, 3, None), (0, 51, 0, 0, 0)).output == -1
    assert grant(clamp, (None, None, None, 3, None), (0, 0, 0, 3, 0)) == Fit(-1, 3)
    # Enough room for all of it: nothing is clamped.
    assert grant(clamp, (40_000, None, None, None, None), (8_000,) + (0,) * 4) == (
        Fit(31_900, 0))
    assert grant(clamp, (40_000, None, None, None, None), (7_900,) + (0,) * 4) == (
        Fit(32_000, None))


def test_amounts_are_the_prompt_plus_the_granted_output() -> None:
    clamp = Clamp(32_000, 256, (100, 100, 0, 1, 500), (1, 0, 1, 0, 4))
    assert clamp.amounts(1_000) == (1_100, 100, 1_000, 1, 4_500)


def test_clamped_cost_never_below_the_real_cost() -> None:
    """A cost window's clamped amount covers whatever the granted tokens can cost."""
    rng = random.Random(3)
    for _ in range(500):
        price = Price(input=rng.choice([0.0, 0.15, 1.0, 2.5, 0.0375]),
                      output=rng.choice([0.0, 0.075, 0.6, 10.0, 0.0375, 1.23456789]),
                      cached_input=rng.choice([None, 0.05, 5.0]))
        prompt, out = rng.randint(0, 50_000), rng.randint(0, 50_000)
        clamped = reserve_cost(price, prompt, 0) + output_rate(price) * out
        for cached in (0, prompt):
            for used in (0, out // 2, out):
                usage = Usage(input_tokens=prompt, output_tokens=used,
                              cached_input_tokens=cached)
                assert clamped >= CostLines.of(price, usage).nanousd


def test_output_rate_is_whole_nanos_rounded_up() -> None:
    assert output_rate(Price(input=1, output=0.075)) == 75
    assert output_rate(Price(input=1, output=0.0375)) == 38
    assert output_rate(Price(input=1, output=10.0)) == 10_000
    assert output_rate(Price(input=1, output=0.0)) == 0


def test_resolve_field_by_field_most_specific_first() -> None:
    assert resolve() == WORST_CASE
    assert resolve(None, None) == WORST_CASE
    key = Admission(min_output_tokens=1024)
    user = Admission(policy=CLAMP)
    team = Admission(policy=AdmissionPolicy.WORST_CASE, min_output_tokens=64)
    assert resolve(key, user, team, None) == AdmissionRule(CLAMP, 1024)
    assert resolve(None, None, team, Admission(policy=CLAMP)) == AdmissionRule(
        AdmissionPolicy.WORST_CASE, 64)
    assert resolve(None, user, None, None) == AdmissionRule(CLAMP, 256)


ALICE, CI, BOB = "sk-alice-0123456789", "sk-alice-ci-0123456789", "sk-bob-0123456789"


def test_principals_carry_their_resolved_rule() -> None:
    policy = Policy.model_validate({
        "defaults": {"admission": {"policy": "clamp", "min_output_tokens": 128}},
        "teams": {"platform": {"admission": {"min_output_tokens": 512}}},
        "users": {
            "alice": {"team": "platform", "keys": [
                ALICE, {"key": CI, "name": "ci", "admission": {"policy": "worst_case"}},
            ]},
            "bob": {"keys": [BOB], "admission": {"min_output_tokens": 2048}},
        },
    })
    index = UserIndex(policy)
    by_hash = index._by_hash
    assert by_hash[key_hash(ALICE)].admission == AdmissionRule(CLAMP, 512)
    ci = by_hash[key_hash(CI)]
    assert ci.admission == AdmissionRule(AdmissionPolicy.WORST_CASE, 512)
    # An admission setting alone does not give a key counters of its own.
    assert ci.limits.key_scope is None
    assert by_hash[key_hash(BOB)].admission == AdmissionRule(CLAMP, 2048)
    assert UserIndex(Policy())._open.admission == WORST_CASE


@pytest.mark.parametrize("admission", [
    {"policy": "guess"}, {"policy": "CLAMP"}, {"min_output_tokens": 0},
    {"min_output_tokens": True}, {"polic": "clamp"},
])
def test_bad_admission_is_refused(admission: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        Policy.model_validate({"defaults": {"admission": admission}})


def test_estimate_is_accepted_from_the_file() -> None:
    policy = Policy.model_validate({"defaults": {"admission": {
        "policy": "estimate", "initial_estimate": 512}}})
    assert policy.defaults.admission is not None
    assert policy.defaults.admission.policy is AdmissionPolicy.ESTIMATE
    assert policy.defaults.admission.initial_estimate == 512


def test_model_groups_take_no_admission() -> None:
    with pytest.raises(pydantic.ValidationError):
        Policy.model_validate({"users": {"a": {"model_limits": {
            "o1*": {"admission": {"policy": "clamp"}}}}}})


def test_resolve_keeps_the_defaults_of_fields_set_nowhere() -> None:
    assert resolve(Admission(min_output_tokens=5)) == AdmissionRule(
        AdmissionPolicy.WORST_CASE, 5, 1024)
    assert resolve(None, Admission(initial_estimate=77), Admission(initial_estimate=9)) == (
        AdmissionRule(AdmissionPolicy.WORST_CASE, 256, 77))
    rule = resolve(Admission(policy=AdmissionPolicy.ESTIMATE, initial_estimate=300))
    assert rule == AdmissionRule(AdmissionPolicy.ESTIMATE, 256, 300)
    assert rule.estimates and rule.clamps
    assert not WORST_CASE.clamps and not WORST_CASE.estimates
    assert AdmissionRule(CLAMP).clamps and not AdmissionRule(CLAMP).estimates


def test_a_clamp_and_its_windows_must_pair_up() -> None:
    """One base and one rate per window: a list one short is a bug, not a shorter clamp."""
    clamp = Clamp(100, 10, (1, 2), (1, 1))
    with pytest.raises(ValueError, match="zip"):
        Clamp(100, 10, (1, 2), (1,)).amounts(5)
    with pytest.raises(ValueError, match="zip"):
        grant(clamp, (None,), (0,))
    with pytest.raises(ValueError, match="zip"):
        grant(clamp, (None, None), (0, 0, 0))
