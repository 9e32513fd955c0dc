#!/usr/bin/env python3
"""Screenshots of the `tokenmeter bench --plot FILE.html` page, from two real runs.

    .venv/bin/python benchmarks/bench_page_screens.py [--out docs/images] [--keep DIR]

1. A sweep: the open loop at 4, 8 and 16 requests/s against two simulated upstreams (the
   "gateway" one 25 ms slower to its first token than "direct"), compared, with an SLO and a
   secret header (which the page must not show).
2. A replay: a capture export of 12 recorded requests (8 streamed) replayed against two replay
   upstreams (`mock-upstream --replay`'s app), B's recording half of the time giving another
   answer and played twice as fast, priced by a price table.

Each run is the CLI in a subprocess over loopback; headless Chromium renders the page to
OUT/bench-sweep.png and OUT/bench-replay.png (the .html pages are kept with --keep DIR).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.testing.mock_upstream import MockSettings, create_mock_app
from proxy.testing.replay import create_replay_app, load_recordings

ROUTE = "/v1/chat/completions"
WIDTH = 1400
HEIGHTS = {"bench-sweep": 2650, "bench-replay": 3000}  # the pages' own lengths, about


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1"


async def bench(*args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "bench", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    print(out.decode())
    if proc.returncode != 0:
        raise SystemExit(f"bench failed ({proc.returncode}): {err.decode()}")


def screenshot(page: Path, png: Path, profile: Path, height: int) -> None:
    import subprocess

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is needed for the screenshots")
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", f"--user-data-dir={profile}",
                    f"--window-size={WIDTH},{height}", f"--screenshot={png}",
                    page.resolve().as_uri()], check=True, capture_output=True, timeout=120)
    print(f"wrote {png}")


def export_line(i: int, answer: str, pace_ms: float) -> dict[str, Any]:
    """One recorded chat-completions request and its answer, as `captures export` writes."""
    messages = [{"role": "user", "content": f"question {i}: summarise the ticket"}]
    stream = i % 3 != 0
    words = len(answer.split())
    usage = {"prompt_tokens": 40 + i, "completion_tokens": words, "total_tokens": 40 + i + words}
    request = {"model": "recorded-model", "messages": messages, "max_tokens": 64,
               **({"stream": True} if stream else {})}
    head, _, tail = answer.partition(" ")
    if stream:
        def data(obj: Any) -> str:
            return "data: " + json.dumps(obj)
        events = [{"at_ms": pace_ms / 4, "text": data({"choices": [{"delta": {"content": head}}]})},
                  {"at_ms": pace_ms, "text": data({"choices": [
                      {"delta": {"content": " " + tail}, "finish_reason": "stop"}]})},
                  {"at_ms": pace_ms, "text": data({"choices": [], "usage": usage})},
                  {"at_ms": pace_ms, "text": "data: [DONE]"}]
        response: dict[str, Any] = {"status": 200, "body": None, "events": events}
    else:
        body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                             "finish_reason": "stop"}], "usage": usage}
        response = {"status": 200, "body": body, "events": []}
    return {"request_id": f"r{i}", "api": "openai", "path": ROUTE, "model": "recorded-model",
            "messages": messages, "max_tokens": 64, "stream": stream, "request": request,
            "response": response}


async def sweep(work: Path) -> Path:
    gw, url_gw = await serve(create_mock_app(MockSettings(ttft_ms=45, tokens_per_second=1500,
                                                          output_tokens=48)))
    direct, url_direct = await serve(create_mock_app(MockSettings(
        ttft_ms=20, tokens_per_second=1500, output_tokens=48)))
    page = work / "bench-sweep.html"
    try:
        await bench("--base-url", url_gw, "--label", "gateway", "--compare", url_direct,
                    "--compare-label", "direct", "--model", "mock-gpt", "--rate", "4,8,16",
                    "--requests", "24", "--prompt-tokens", "64", "--max-tokens", "48",
                    "--slo", "ttft=60ms", "--header", "Authorization: Bearer sk-secret",
                    "--plot", str(page))
    finally:
        await gw.cleanup()
        await direct.cleanup()
    return page


async def replay(work: Path) -> Path:
    answers_a = [f"answer {i} the ticket is about billing" for i in range(1, 13)]
    answers_b = [a if i % 2 else f"reply {i + 1} the ticket is about a refund, twice"
                 for i, a in enumerate(answers_a)]
    file_a, file_b = work / "a.jsonl", work / "b.jsonl"
    for path, answers in ((file_a, answers_a), (file_b, answers_b)):
        path.write_text("".join(json.dumps(export_line(i, a, 200 + 40 * i)) + "\n"
                                for i, a in enumerate(answers, 1)))
    prices = work / "prices.yaml"
    prices.write_text("prices:\n  recorded-model: {input: 2.5, output: 10.0}\n")
    run_a, url_a = await serve(create_replay_app(load_recordings(file_a), speed=1))
    run_b, url_b = await serve(create_replay_app(load_recordings(file_b), speed=2))
    page = work / "bench-replay.html"
    try:
        await bench("--base-url", url_a, "--label", "gpt-recorded", "--compare", url_b,
                    "--compare-label", "candidate", "--replay", str(file_a),
                    "--prices", str(prices), "--concurrency", "4", "--plot", str(page))
    finally:
        await run_a.cleanup()
        await run_b.cleanup()
    return page


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--keep", type=Path, help="keep the .html pages in this directory")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name, make in (("bench-sweep", sweep), ("bench-replay", replay)):
            page = await make(work)
            screenshot(page, args.out / f"{name}.png", Path(tmp) / f"profile-{name}",
                       HEIGHTS[name])


if __name__ == "__main__":
    asyncio.run(main())
