"""What a request costs (proxy.cost), to the nano-dollar: cache reads and writes each at
their own price, each prompt token billed once, and a worst case no real usage can pass."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from proxy.budget.limits import reserve_cost
from proxy.config.policy import Price
from proxy.cost import CostLines, price_for, price_version, worst_case_nanousd
from proxy.protocol.usage import Usage

pytestmark = pytest.mark.unit

# Claude Sonnet 4's list prices (USD per million tokens).
SONNET = Price(input=3.0, output=15.0, cached_input=0.30, cache_write_5m=3.75,
               cache_write_1h=6.0)
# 1,000 fresh prompt tokens, 2,000 written to the cache (500 of them to the 1-hour one),
# 10,000 read from it; 700 out. input_tokens is the whole prompt (see proxy.protocol.anthropic).
CACHED = Usage(input_tokens=13_000, output_tokens=700, cached_input_tokens=10_000,
               cache_creation_input_tokens=2_000, cache_read_input_tokens=10_000,
               cache_creation_1h_input_tokens=500)


def usage_cost(price: Price, usage: Usage) -> int:
    return CostLines.of(price, usage).nanousd


def test_each_prompt_token_at_its_own_price() -> None:
    cost = CostLines.of(SONNET, CACHED)
    # 1,000 input at $3/M, 10,000 cache reads at $0.30/M, 1,500 5-minute writes at $3.75/M,
    # 500 1-hour writes at $6/M, 700 output at $15/M: 25.125 USD per million.
    assert cost.lines == (3_000_000, 3_000_000, 5_625_000, 3_000_000, 10_500_000)
    assert cost.nanousd == sum(cost.lines) == 25_125_000
    assert cost.usd() == (("input", 0.003), ("cached_input", 0.003),
                          ("cache_write_5m", 0.005625), ("cache_write_1h", 0.003),
                          ("output", 0.0105))


def test_the_metric_lines_skip_what_cost_nothing() -> None:
    free_cache = Price(input=3.0, output=15.0, cached_input=0.0)
    assert CostLines.of(free_cache, CACHED).usd() == (
        ("input", 0.003), ("cache_write_5m", 0.0045), ("cache_write_1h", 0.0015),
        ("output", 0.0105))
    assert CostLines.of(SONNET, Usage()).usd() == ()


def test_cache_writes_are_not_also_billed_as_input() -> None:
    """LiteLLM's bug: the writes billed at the write price and again as input. Here the
    input line is what is left of the prompt once reads and writes are taken out."""
    writes_only = Usage(input_tokens=2_010, output_tokens=0, cache_creation_input_tokens=2_000)
    assert usage_cost(SONNET, writes_only) == 10 * 3_000 + 2_000 * 3_750 == 7_530_000
    # The same prompt without the cache: every token at the input price.
    assert usage_cost(SONNET, Usage(input_tokens=2_010)) == 6_030_000


def test_writes_without_a_lifetime_are_five_minute_ones() -> None:
    unsplit = Usage(input_tokens=2_000, cache_creation_input_tokens=2_000)
    assert usage_cost(SONNET, unsplit) == 2_000 * 3_750


def test_unset_prices_are_the_input_price() -> None:
    """No multiplier of the table's own: what the operator did not price costs as input."""
    plain = Price(input=3.0, output=15.0)
    assert usage_cost(plain, CACHED) == 13_000 * 3_000 + 700 * 15_000 == 49_500_000
    only_reads = Price(input=3.0, output=15.0, cached_input=0.30)
    assert usage_cost(only_reads, CACHED) == (3_000 * 3_000 + 10_000 * 300 + 700 * 15_000)


def test_inconsistent_counts_never_bill_a_token_twice() -> None:
    """Reads and writes beyond the prompt are capped to it, reads first."""
    odd = Usage(input_tokens=100, output_tokens=0, cached_input_tokens=80,
                cache_creation_input_tokens=50, cache_creation_1h_input_tokens=40)
    # 80 reads at 300 nano-dollars, 20 1-hour writes at 6,000: 100 tokens, none twice.
    assert CostLines.of(SONNET, odd).lines == (0, 80 * 300, 0, 20 * 6_000, 0)


def test_rounded_up_once_per_request() -> None:
    # Each line is a third of a nano-dollar; the request costs one, not five.
    third = Price(input=1 / 3000, output=1 / 3000, cached_input=1 / 3000,
                  cache_write_5m=1 / 3000, cache_write_1h=1 / 3000)
    one_each = Usage(input_tokens=4, output_tokens=1, cached_input_tokens=1,
                     cache_creation_input_tokens=2, cache_creation_1h_input_tokens=1)
    cost = CostLines.of(third, one_each)
    assert cost.nanousd == 2  # 5/3 rounded up
    assert cost.lines == (1, 1, 1, 1, 1)  # each line rounded up for the metric
    assert usage_cost(third, Usage()) == 0


def test_the_worst_case_covers_every_split() -> None:
    """A cost window reserves worst_case_nanousd (limits.reserve_cost): whatever the upstream
    then reports for that prompt and output (reads, writes of either lifetime), it costs no
    more, whichever price is the dearest."""
    rng = random.Random(15)
    choices = [None, 0.0, 0.03, 0.3, 3.0, 3.75, 6.0, 12.5]
    for _ in range(2_000):
        price = Price(input=rng.choice([0.0, 0.8, 3.0, 15.0]), output=rng.choice([0.0, 4.0, 75.0]),
                      cached_input=rng.choice(choices), cache_write_5m=rng.choice(choices),
                      cache_write_1h=rng.choice(choices))
        prompt, out = rng.randint(0, 200_000), rng.randint(0, 64_000)
        worst = worst_case_nanousd(price, prompt, out)
        assert reserve_cost(price, prompt, out) == worst
        reads = rng.randint(0, prompt)
        writes = rng.randint(0, prompt - reads)
        usage = Usage(input_tokens=prompt, output_tokens=rng.randint(0, out),
                      cached_input_tokens=reads, cache_creation_input_tokens=writes,
                      cache_creation_1h_input_tokens=rng.randint(0, writes))
        assert usage_cost(price, usage) <= worst
        # Every prompt token a 1-hour write, the whole output: the worst case, when dearest.
        all_hour = Usage(input_tokens=prompt, output_tokens=out, cache_creation_input_tokens=prompt,
                         cache_creation_1h_input_tokens=prompt)
        assert usage_cost(price, all_hour) <= worst


def test_worst_case_is_the_dearest_prompt_price() -> None:
    # 1-hour writes at 2x input are the dearest: 1,000 prompt tokens at $6/M, 100 out at $15/M.
    assert worst_case_nanousd(SONNET, 1_000, 100) == 6_000_000 + 1_500_000
    assert worst_case_nanousd(Price(input=3.0, output=15.0), 1_000, 100) == 4_500_000


def test_price_version_unchanged_for_tables_without_write_prices() -> None:
    """Rows name the price table's fingerprint: a table that sets no cache-write price keeps
    the one it had before those prices existed."""
    table = {"gpt-4o*": Price(input=2.5, output=10.0, cached_input=1.25),
             "mini": Price(input=0.15, output=0.6)}
    before = {"gpt-4o*": {"input": 2.5, "output": 10.0, "cached_input": 1.25},
              "mini": {"input": 0.15, "output": 0.6, "cached_input": None}}
    want = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:12]
    assert price_version(table) == want
    assert price_version({**table, "claude-*": SONNET}) != price_version(table)
    priced_writes = {"mini": Price(input=0.15, output=0.6, cache_write_5m=0.15)}
    assert price_version(priced_writes) != price_version({"mini": table["mini"]})


def test_prices_as_written_not_their_binary_approximations() -> None:
    """0.1 as a float is 0.1000000000000000055...: priced from it, one token at $0.1/M would
    cost 100.0000000000000055 nano-dollars, rounded up to 101. Priced as written: 100."""
    tenth = Price(input=0.1, output=0.1, cached_input=0.1, cache_write_5m=0.1,
                  cache_write_1h=0.1)
    for usage in (Usage(input_tokens=1), Usage(output_tokens=1),
                  Usage(input_tokens=1, cached_input_tokens=1),
                  Usage(input_tokens=1, cache_creation_input_tokens=1),
                  Usage(input_tokens=1, cache_creation_input_tokens=1,
                        cache_creation_1h_input_tokens=1)):
        assert usage_cost(tenth, usage) == 100, usage
    assert usage_cost(Price(input=0.3, output=0.7), Usage(input_tokens=3, output_tokens=3)) == 3_000
    assert usage_cost(tenth, Usage(input_tokens=7, output_tokens=3)) == 1_000
    assert worst_case_nanousd(tenth, 1, 1) == 200
    assert worst_case_nanousd(Price(input=0.1, output=0.3), 3, 1) == 600


def test_price_for_an_exact_name_first_then_the_first_glob_that_matches() -> None:
    table = {"gpt-4o*": Price(input=2.5, output=10.0), "*": Price(input=9.0, output=9.0),
             "gpt-4o-mini": Price(input=0.15, output=0.6)}
    assert price_for(table, "gpt-4o-mini") is table["gpt-4o-mini"]  # exact, though listed last
    assert price_for(table, "gpt-4o-2024") is table["gpt-4o*"]  # the first glob, in order
    assert price_for(table, "claude") is table["*"]
    assert price_for({"gpt-4o*": table["gpt-4o*"]}, "o1") is None
    assert price_for({}, "gpt-4o") is None
    assert price_for({"GPT-4O*": table["gpt-4o*"]}, "gpt-4o") is None  # case counts


def test_cost_lines_of_another_shape_are_a_bug_not_a_shorter_bill() -> None:
    """One line per kind of price, always: lines that do not pair up with the kinds are a
    bug to raise, not a metric to write short."""
    assert CostLines((0, 1, 0, 0, 2), 3).usd() == (("cached_input", 1e-9), ("output", 2e-9))
    with pytest.raises(ValueError, match="zip"):
        CostLines((1, 2, 3), 6).usd()
