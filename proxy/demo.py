"""`tokenmeter demo`: one metered streaming request through the proxy, made with the openai SDK."""

from __future__ import annotations

import sys

import aiohttp


async def run_demo(base_url: str, metrics_url: str) -> None:
    try:
        from openai import AsyncOpenAI
    except ImportError:
        print("the demo needs the openai SDK: pip install openai", file=sys.stderr)
        return
    client = AsyncOpenAI(base_url=base_url, api_key="not-needed-in-open-mode", max_retries=0)
    print(f"\n$ openai chat.completions.create(model='mock-gpt', stream=True) via {base_url}")
    stream = await client.chat.completions.create(
        model="mock-gpt",
        messages=[{"role": "user", "content": "Say something metered."}],
        stream=True,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print("\n")
    await client.close()
    async with aiohttp.ClientSession() as session, session.get(metrics_url) as resp:
        text = await resp.text()
    wanted = ("tokenmeter_tokens_total{", "gen_ai_server_time_to_first_token_seconds_count",
              "tokenmeter_requests_total{")
    print(f"$ curl {metrics_url}  (excerpt)")
    for line in text.splitlines():
        if line.startswith(wanted):
            print("  " + line)
    print(f"\nThe proxy keeps serving: point any OpenAI SDK at base_url={base_url}\n")
