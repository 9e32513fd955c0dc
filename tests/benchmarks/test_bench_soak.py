"""benchmarks/bench_soak.py's reading of a stream as its client saw it: tokenmeter ends a clean
stream with an SSE comment after `[DONE]` (its cost), which is not an event; the soak's checks 1
and 2 failed on every run while the client took such streams for broken ones."""

from __future__ import annotations

from collections import Counter

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from proxy.server.app import create_app
from tests.bench_modules import load_bench
from tests.helpers import ServerFactory, make_config

pytestmark = pytest.mark.unit

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


cache_phase = load_bench("soak_cache")


@pytest.mark.timeout(120)
async def test_the_soaks_cache_phase_holds_in_its_quick_size(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str
) -> None:
    """The phase of benchmarks/soak_cache.py at its quick size, against the proxy on a real
    redis-server: the rate-limited user's hits stop at his rate, the stalled leader's team-mate
    is answered, every long fill is answered; what it records is what the soak's checks read."""
    config = make_config(str(upstream.make_url("/v1")), store=redis_url,
                         users=cache_phase.users(), extra={"cache": cache_phase.cache_config()})
    proxy = await aiohttp_server(create_app(config))
    records: list[tuple[str, str, int | None, tuple[int, int] | None]] = []
    phase = cache_phase.CachePhase(f"http://{proxy.host}:{proxy.port}",
                                   lambda *r: records.append(r), cache_phase.QUICK)
    async with aiohttp.ClientSession() as session:
        await phase.run(session)
    assert phase.tally.problems(cache_phase.QUICK) == []
    kinds = Counter((kind, status, usage is not None) for kind, _, status, usage in records)
    assert kinds[("dave-entry", 200, True)] == 1  # the entry's miss: its usage counted
    assert kinds[("dave-hit", 200, False)] >= 1  # hits: no upstream call, no usage
    assert kinds[("dave-hit", 429, False)] >= 1
    assert kinds[("team-mate", 200, True)] == 1 and kinds[("stalled-leader", None, False)] == 1
    assert kinds[("long-fill", 200, True)] == cache_phase.QUICK.fills
