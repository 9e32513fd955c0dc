"""Per-chunk cost of the metering tap (decoder + translator + meter), sans I/O.

    .venv/bin/python benchmarks/bench_tap.py

Feeds a realistic chat stream through `StreamTap.feed` + `look`, as the relay does, and prints
microseconds per chunk, best of several repeats: first one SSE event per chunk (as upstreams send
them at speed: the fast path), then four events per chunk (what a relay that fell behind reads at
once: the general decoder). This is the part of the hot path that is tokenmeter's own code; the
rest is aiohttp's read and write.
"""

from __future__ import annotations

import json
import time

from proxy.protocol.tap import StreamTap
from proxy.protocol.translators import ChatTranslator, parse_body
from proxy.telemetry.meter import RequestMeter

BASE = {"id": "chatcmpl-AbCdEf1234567890", "object": "chat.completion.chunk",
        "created": 1733000000, "model": "gpt-4o-mini-2024-07-18",
        "system_fingerprint": "fp_0ba0d124f1"}


def _event(delta: dict[str, object], finish: str | None = None) -> bytes:
    obj = {**BASE, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                "finish_reason": finish}], "usage": None}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chunks(n: int) -> list[bytes]:
    out = [_event({"role": "assistant", "content": ""})]
    out += [_event({"content": f" tok{i}"}) for i in range(n)]
    out.append(_event({}, "stop"))
    usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": n + 10}
    out.append(b"data: " + json.dumps({**BASE, "choices": [], "usage": usage}).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def run(stream: list[bytes]) -> float:
    body = json.dumps({"model": "gpt-4o-mini", "messages": [], "stream": True}).encode()
    tap = StreamTap(ChatTranslator(parse_body(body)), RequestMeter())
    perf = time.perf_counter
    start = perf()
    feed, look = tap.feed, tap.look
    for chunk in stream:
        feed(chunk, perf())  # the relay writes what this returns here
        look()
    tap.close()
    return perf() - start


def coalesced(stream: list[bytes], per: int) -> list[bytes]:
    return [b"".join(stream[i : i + per]) for i in range(0, len(stream), per)]


def main() -> None:
    stream = chunks(256)
    for label, parts in (("tap", stream), ("tap, 4 events per chunk", coalesced(stream, 4))):
        run(parts)
        best = min(run(parts) for _ in range(200))
        print(f"{label}: {best / len(parts) * 1e6:.2f} us per chunk, "
              f"{best * 1e3:.3f} ms per 256-token stream (best of 200)")


if __name__ == "__main__":
    main()
