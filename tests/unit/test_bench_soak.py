"""benchmarks/bench_soak.py's reading of a stream as its client saw it: tokenmeter ends a clean
stream with an SSE comment after `[DONE]` (its cost), which is not an event; the soak's checks 1
and 2 failed on every run while the client took such streams for broken ones."""

from __future__ import annotations

import pytest

from tests.unit.bench_modules import load_bench

soak = load_bench("bench_soak")
CHAT = soak.Kind("chat-stream-usage", "chat", 1, True, True)
EVENTS = (b'data: {"choices":[{"index":0,"delta":{"content":" hi"}}]}\n\n'
          b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}\n\n'
          b"data: [DONE]\n\n")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("after", [b"", b": tokenmeter cost_usd=0.000001 input_tokens=9\n\n"])
def test_a_clean_stream_shows_its_usage_whatever_comment_follows_done(after: bytes) -> None:
    assert soak.stream_usage(CHAT, EVENTS + after) == ((9, 1), 1)


@pytest.mark.timeout(30)
def test_a_stream_cut_before_done_is_broken() -> None:
    assert soak.stream_usage(CHAT, EVENTS[:-len(b"data: [DONE]\n\n")])[0] is None
    assert soak.stream_usage(CHAT, EVENTS + b'data: {"late":1}\n\n')[0] is None
