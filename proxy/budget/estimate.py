"""The `estimate` admission policy's learned output estimate, and the size of its top-ups.

A stream under `estimate` reserves its prompt plus an estimate of its output instead of its
output cap, and the relay tops the reservation up while the stream runs (`proxy.pipeline.topup`).
The estimate is learned per user, key and model from the output lengths of their recent
requests that completed: the last `SAMPLES` lengths are kept in the store, in the user's slot,
so every replica sharing the store shares them (a Redis hash written as a ring; the in-process
store keeps the same ring). The estimate is their `PERCENTILE`, so one stream in ten or so needs
a top-up, bounded by the request's cap; before any history, `admission.initial_estimate`.

Only completed requests teach it: a stream cut short (by its client, an upstream failure or the
quota) says nothing about how long its answer would have been, and would drag the estimate down.

Top-ups follow the output a stream shows, so they cannot protect a stream whose upstream bills
output it never streams: a reasoning model's hidden reasoning tokens arrive only as a count in
the final usage (OpenAI's `completion_tokens_details.reasoning_tokens`), too late to top up or
end the stream for. Such a stream (`hides_output`) reserves its whole cap instead, clamped as
under `clamp`, so its bill can never pass what it holds.

What no list names is learned, per (upstream, model), in the store (`Store.flag`, so every
replica sees it; `learned_key`): a stream whose reported output exceeds what it streamed by more
than `MIN_STEP` (an unknown reasoning model), or that delivered a piece of more than `MIN_STEP`
output tokens in one event (a gateway that fake-streams a whole answer at once: tokens that
arrive in one event were generated before the proxy could act on them). Later admissions of
that (upstream, model) treat it as hiding output for `LEARNED_TTL_S` after it was last seen.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

SAMPLES = 32  # output lengths kept per (user, key, model): enough for a stable p90
PERCENTILE = 0.9
ESTIMATE_TTL_S = 14 * 86_400  # a key unused this long starts afresh
MIN_STEP = 256  # the smallest top-up asked for: fewer calls on streams far past the estimate


def estimate(samples: Sequence[int], cap: int, initial: int) -> int:
    """The output tokens to reserve for a request whose output may reach `cap` (> 0)."""
    if not samples:
        return max(1, min(cap, initial))
    ordered = sorted(samples)
    at = max(0, math.ceil(PERCENTILE * len(ordered)) - 1)
    return max(1, min(cap, ordered[at]))


def step(estimate: int, left: int) -> int:
    """The next top-up: half the estimate, at least `MIN_STEP`, never past the cap (`left`:
    the output tokens the cap allows beyond what is reserved)."""
    return max(0, min(left, max(estimate // 2, MIN_STEP)))


# Models that bill reasoning tokens they do not stream: OpenAI's o-series, GPT-5 and Codex
# families and its open-weight gpt-oss (chat completions and the Responses API stream a summary
# at most), and the reasoning models of other providers as their OpenAI-compatible APIs serve
# them: DeepSeek's R1 / `deepseek-reasoner`, Qwen's QwQ and its `-thinking` models, Mistral's
# Magistral, xAI's Grok 3 mini and Grok 4 (`-reasoning` variants too), Gemini 2.5 and 3 (which
# think by default). Matched on the name after the last `/` too, for gateways that prefix a
# provider ("openai/o3"). What this list misses is learned (`learned_key`).
HIDDEN_OUTPUT_MODELS = ("o1*", "o3*", "o4*", "gpt-5*", "codex-*", "gpt-oss*", "deepseek-r1*",
                        "deepseek-reasoner*", "qwq*", "*-thinking*", "magistral*",
                        "grok-3-mini*", "grok-4*", "*-reasoning*", "gemini-2.5*", "gemini-3*")
# How long a learned (upstream, model) is treated as hiding output after it was last seen to.
LEARNED_TTL_S = 14 * 86_400
# One regex for all of them: admission asks this of every attempt.
_HIDDEN_OUTPUT = re.compile("|".join(fnmatch.translate(g) for g in HIDDEN_OUTPUT_MODELS))


def hides_output(model: str, body: Mapping[str, Any], configured: bool | None) -> bool:
    """Whether a request for `model` with `body` can bill output tokens it does not stream.
    `configured`: its route's `hidden_output`, which decides when set. Otherwise yes for the
    models above and for a request that asks any model to reason: `reasoning_effort` (chat
    completions), `reasoning` (the Responses API, and some gateways' chat), or Anthropic's
    extended `thinking` (Claude 4 models stream a summary of the thinking they bill whole;
    redacted thinking is not streamed at all); and for chat's audio output (`audio`, or
    `audio` in `modalities`), billed as audio tokens the relay does not count as text. In
    doubt, yes: reserving the cap costs room, never the quota."""
    if configured is not None:
        return configured
    if _HIDDEN_OUTPUT.match(model.rsplit("/", 1)[-1].lower()):
        return True
    modalities = body.get("modalities")
    return (_asks(body.get("reasoning_effort"), None)
            or _asks(body.get("reasoning"), "effort")
            or _asks(body.get("thinking"), "type")
            or _asks(body.get("audio"), None)
            or (isinstance(modalities, list) and "audio" in modalities))


def hid_output(reported: int, streamed: int) -> bool:
    """A stream that reported `reported` output tokens and showed `streamed`: it billed more
    than a top-up step beyond what it showed, as a reasoning model does (see `learned_key`)."""
    return reported - streamed > MIN_STEP


def _asks(value: object, field: str | None) -> bool:
    """A request parameter that turns its feature on: present, and neither `false`, `none`
    nor `disabled` (itself, or its `field` for an object)."""
    if isinstance(value, Mapping) and field is not None:
        value = value.get(field, True)
    return value not in (None, False, "none", "disabled")


def sample_key(slot: str, user: str, key_id: str, model: str) -> str:
    """The store key of a (user, key, model)'s samples: in the user's slot (a Redis Cluster
    keeps it with their counters). The key's id is a hash prefix, never the key itself."""
    return f"{slot}:est:{user}:{key_id}:{model}"


def learned_key(prefix: str, upstream: str, model: str) -> str:
    """The store flag that says `upstream` was seen to bill `model`'s output beyond what it
    streamed, or to stream it in pieces larger than a top-up step (see the module's note). One
    key per (upstream, model), outside any user's slot: every user of the model learns it. A
    model name is the client's text, bounded here: past 128 characters, its hash."""
    if len(model) > 128:
        model = "sha256:" + hashlib.sha256(model.encode()).hexdigest()
    return f"{prefix}:hides:{upstream}:{model}"
