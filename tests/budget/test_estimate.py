"""The `estimate` admission policy's arithmetic and the in-process store's top-ups and output
history (the Redis scripts are checked against the same cases in tests/budget/test_admission_estimate.py)."""

from __future__ import annotations

import hashlib
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


def test_estimate_reserves_one_token_at_least_and_takes_the_ninetieth_percentile() -> None:
    assert est.estimate((), 32_000, 1) == 1
    assert est.estimate((), 32_000, 0) == 1
    assert est.estimate((5,), 32_000, 1024) == 5  # one sample: it is the percentile
    # Ten samples: the ninth smallest (ceil(0.9 * 10) = 9), in whatever order they came.
    assert est.estimate((10, 1, 9, 2, 8, 3, 7, 4, 6, 5), 32_000, 1024) == 9
    assert est.estimate((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11), 32_000, 1024) == 10  # ceil(9.9)


def test_a_step_is_a_whole_number_of_tokens() -> None:
    assert est.step(4_001, 30_000) == 2_000
    assert isinstance(est.step(4_001, 30_000), int)
    assert est.step(2 * est.MIN_STEP + 1, 30_000) == est.MIN_STEP
    assert est.step(4_000, 1) == 1


@pytest.mark.parametrize(("body", "hides"), [
    ({}, False),
    ({"reasoning_effort": "low"}, True),
    ({"reasoning_effort": "none"}, False),
    ({"reasoning_effort": None}, False),
    ({"reasoning": {"effort": "high"}}, True),
    ({"reasoning": {"summary": "auto"}}, True),  # an effort left to the model's default
    ({"reasoning": {"effort": "none"}}, False),
    ({"reasoning": "high"}, True),  # some gateways take the effort itself
    ({"reasoning": False}, False),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, True),
    ({"thinking": {"type": "disabled"}}, False),
    ({"audio": {"voice": "alloy", "format": "wav"}}, True),
    ({"modalities": ["text", "audio"]}, True),
    ({"modalities": ["text"]}, False),
    ({"modalities": "audio"}, False),  # not a list: no modality asked
])
def test_a_request_that_asks_to_reason_or_speak_hides_output(body: dict[str, object],
                                                              hides: bool) -> None:
    assert est.hides_output("gpt-4o", body, None) is hides
    assert est.hides_output("gpt-4o", body, True) is True  # the route decides
    assert est.hides_output("o3", body, False) is False


def test_a_model_is_matched_case_blind_on_its_name_after_the_last_slash() -> None:
    assert est.hides_output("O3-Mini", {}, None)
    assert est.hides_output("router/openai/o3", {}, None)
    assert not est.hides_output("o3/gpt-4o", {}, None)  # the provider prefix is not the model


def test_a_learned_key_keeps_a_name_of_128_characters_and_hashes_a_longer_one() -> None:
    assert est.learned_key("tm", "up", "m" * 128) == "tm:hides:up:" + "m" * 128
    name = "m" * 129
    digest = hashlib.sha256(name.encode()).hexdigest()
    assert est.learned_key("tm", "up", name) == f"tm:hides:up:sha256:{digest}"
