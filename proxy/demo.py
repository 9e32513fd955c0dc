"""`tokenmeter demo`: one metered streaming request through the proxy, made with the openai SDK."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator

import aiohttp

from proxy.telemetry.accesslog import held

# The SDK's HTTP client logs each request at INFO (as `httpx`, or `httpx2` where that fork
# stands in for it): the proxy's own line says more, and the client's would cut the answer.
_CLIENT_LOGGERS = ("httpx", "httpx2")


async def run_demo(base_url: str, metrics_url: str,
                   settled: Callable[[], Awaitable[object]]) -> None:
    """The request, then three parts one after the other: the streamed answer (stdout), the
    request's access-log line (stderr, in the log's format), and an excerpt of the metrics
    (stdout). The proxy settles a stream before its end reaches the client, so its line would
    come in the middle of the answer: it is held until the answer is out and the requests
    still settling (`settled`) are settled."""
    try:
        from openai import AsyncOpenAI
    except ImportError:
        print("the demo needs the openai SDK: pip install openai", file=sys.stderr)
        return
    client = AsyncOpenAI(base_url=base_url, api_key="not-needed-in-open-mode", max_retries=0)
    print(f"\n$ openai chat.completions.create(model='mock-gpt', stream=True) via {base_url}")
    _heading("the streamed answer")
    with held(), _quiet(*_CLIENT_LOGGERS):
        stream = await client.chat.completions.create(
            model="mock-gpt",
            messages=[{"role": "user", "content": "Say something metered."}],
            stream=True,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print()
        await client.close()
        await settled()
        _heading("its access-log line (stderr)")
    async with aiohttp.ClientSession() as session, session.get(metrics_url) as resp:
        text = await resp.text()
    wanted = ("tokenmeter_tokens_total{", "gen_ai_server_time_to_first_token_seconds_count",
              "tokenmeter_requests_total{")
    _heading(f"metrics: curl {metrics_url} (excerpt)")
    for line in text.splitlines():
        if line.startswith(wanted):
            print("  " + line)
    print(f"\nThe proxy keeps serving: point any OpenAI SDK at base_url={base_url}\n",
          flush=True)


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """These loggers at WARNING meanwhile."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _heading(title: str) -> None:
    print(f"\n--- {title} ---", flush=True)
