"""The `estimate` admission policy's arithmetic and the in-process store's top-ups and output
history (the Redis scripts are checked against the same cases in tests/budget/test_admission_estimate.py)."""

from __future__ import annotations

import json

import pytest

from proxy.budget import estimate as est
from proxy.protocol.translators import ChatTranslator, parse_body
from proxy.testing.mock_upstream import WORDS

pytestmark = pytest.mark.unit


def test_estimate_is_a_high_percentile_bounded_by_the_cap() -> None:
    assert est.estimate((), 32_000, 1024) == 1024
    assert est.estimate((), 500, 1024) == 500
    samples = tuple(range(1, 101))  # 1..100
    assert est.estimate(samples, 32_000, 1024) == 90
    assert est.estimate(samples, 50, 1024) == 50
    assert est.estimate((700,), 32_000, 1024) == 700
    assert est.estimate((0, 0), 32_000, 1024) == 1


def test_step_is_half_the_estimate_at_least_the_minimum_never_past_the_cap() -> None:
    assert est.step(4_000, 30_000) == 2_000
    assert est.step(100, 30_000) == est.MIN_STEP
    assert est.step(4_000, 700) == 700
    assert est.step(4_000, 0) == 0


def test_sample_key_is_in_the_users_slot() -> None:
    assert est.sample_key("tm:{alice}", "alice", "0123abcd4567", "gpt-x") == (
        "tm:{alice}:est:alice:0123abcd4567:gpt-x")


def test_output_tokens_so_far_counts_new_events_only_and_rates_by_a_sample() -> None:
    """One-token events (the mock's words): the sampled rate is exact, whatever the calls."""
    body = {"model": "mock-gpt", "messages": [{"role": "user", "content": "hi"}],
            "stream": True}
    translator = ChatTranslator(parse_body(json.dumps(body).encode()))
    assert translator.output_tokens_so_far() == 0
    for n in range(1, 401):
        event = {"id": "c", "object": "chat.completion.chunk", "model": "mock-gpt",
                 "choices": [{"index": 0, "delta": {"content": WORDS[n % len(WORDS)]},
                              "finish_reason": None}]}
        translator.on_event(json.dumps(event).encode(), None)
        if n % 37 == 0 or n == 400:
            assert translator.output_tokens_so_far() == n
    assert translator.usage().output_tokens == 400


def test_the_known_reasoning_models_hide_output_and_others_are_learned() -> None:
    """Issue 31, item 2: the list extended (codex, gpt-oss, DeepSeek R1, QwQ, ...); a model
    no list names is learned per (upstream, model), its store key outside any user's slot and
    bounded however long the client's model name."""
    for model in ("o3-mini", "gpt-5", "codex-mini-latest", "gpt-oss-120b", "openai/gpt-oss-20b",
                  "deepseek-r1-distill-llama-70b", "deepseek-reasoner", "qwq-32b",
                  "qwen3-235b-a22b-thinking-2507", "magistral-medium", "grok-4"):
        assert est.hides_output(model, {}, None), model
    for model in ("gpt-4o", "claude-sonnet-4", "mock-gpt", "mystery-model"):
        assert not est.hides_output(model, {}, None), model
    assert not est.hides_output("gpt-oss-120b", {}, False)  # the route decides
    assert est.learned_key("tm", "vllm", "mystery") == "tm:hides:vllm:mystery"
    long = est.learned_key("tm", "vllm", "m" * 10_000)
    assert long.startswith("tm:hides:vllm:sha256:") and len(long) < 100
    # More than a top-up step billed beyond what was streamed.
    assert est.hid_output(50 + est.MIN_STEP + 1, 50)
    assert not est.hid_output(50 + est.MIN_STEP, 50)
