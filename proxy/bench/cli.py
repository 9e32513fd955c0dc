"""`tokenmeter bench`: the command line of the load generator."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import re
import shlex
import sqlite3
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from proxy.bench.client import ERROR_CLASSES, Api, Endpoint, RequestSpec
from proxy.bench.page import RunInfo, write_plot
from proxy.bench.plot import PlotFormatError
from proxy.bench.replay import (
    Loaded,
    ReplayError,
    ReplayReport,
    compare_answers,
    load_captures,
    load_prices,
    load_replay,
    request_outcomes,
    target_costs,
)
from proxy.bench.report import ProgressBar, render, to_csv, to_json, write_text
from proxy.bench.runner import BenchConfig, BenchResult, run_bench
from proxy.bench.stats import parse_slo
from proxy.bench.workload import Prompt, PromptsFileError, load_prompts
from proxy.capture.cli import add_filters, filters_of, store_url
from proxy.capture.collect import redactor
from proxy.config.capture import DEFAULT_REDACT
from proxy.config.load import ConfigError, load_config
from proxy.config.policy import Price
from proxy.storage.urls import shown_url

EPILOG = f"""\
metrics (per request):
  TTFT    time from sending the request to the first chunk with non-empty content
          (without streaming: TTFT = end-to-end latency)
  ITL     inter-token latency: every gap between consecutive content chunks
  TPOT    time per output token: (latency - TTFT) / (output tokens - 1)
          (streaming only, and only with at least 2 output tokens)
  E2E     end-to-end latency: sending the request to the end of the response
  output tokens
          from the server's usage (stream_options.include_usage is requested); also counted
          locally with tiktoken from the received text, and the difference (local - usage,
          tokens and %) reported per level

metrics (per level = endpoint x load x prompt size):
  req/s        successful requests / time the endpoint was under load at this level
  out tok/s    output tokens of all successful requests / that time (all streams together)
  tok/s/stream per stream: 1 / TPOT (the decode speed one client sees)
  p50/p90/p95/p99 of TTFT, TPOT, ITL, E2E (linear interpolation between closest ranks)
  errors       counted by HTTP status and by class: {", ".join(ERROR_CLASSES)}
  goodput      with --slo: requests/s that succeeded and met every SLO, and their fraction
  lag          the load generator's own event-loop lag (p99, max); above --lag-warn-ms the
               TTFT and ITL figures are flagged as unreliable

--api anthropic speaks Anthropic's Messages API instead: POST <base-url>/messages with
max_tokens (required), the key as x-api-key (from ANTHROPIC_API_KEY unless --api-key-env says),
TTFT on the first content delta (text, thinking or a tool's input), output tokens from the
usage of message_delta, prompt tokens the input plus cache writes and reads.

--compare URL2 runs the same load against both endpoints, interleaved in blocks (A B B A ...)
within each level, and reports base/compare ratios and base - compare latency differences.
--replay FILE.jsonl sends a capture export's recorded requests (docs/capture.md) with their own
bodies, the model replaced by --model when given, each once per endpoint and each in its own
route's API: /v1/chat/completions lines as OpenAI (key from OPENAI_API_KEY), /v1/messages lines
as Anthropic (key from ANTHROPIC_API_KEY); --api-key-env NAME sends that one key to both, and
--api X keeps only X's lines (the others counted as skipped "not --api X"). Lines of other
routes (embeddings, the Responses API...) are skipped, counted by route: the report says
"replayed N of M lines; skipped K: ..." (all skipped: a usage error saying why). Per request it
sets the recorded outcome (status and error class, the recorded error body classified as bench
classifies an answer) beside each endpoint's: "same outcome as recorded: x/y" per endpoint, the
requests that differ (the first 20), every row in --json's replay.outcomes.per_request. It reports
the cost per endpoint (--prices FILE.yaml or --config's prices) and, with --compare, the answers:
exact-match rate, length ratio B/A (characters), every pair in --json, a sample on the --plot
.html page.
ITL per token, as AIPerf reports "inter token latency": (E2E - TTFT) / (output tokens - 1) per
request, which is TPOT above (`itl_per_token` in --json and --csv, the same figures as `tpot`);
ITL here is the chunk gaps.
--plot FILE.html: one self-contained page (no script, nothing fetched): the run's date,
tokenmeter version, command (secret header values and URL passwords redacted) and settings,
headline cards (with --replay: cost per endpoint, exact-match rate, length ratio), the latency
difference with --compare, CDFs of TTFT and E2E, latency over time with --rate, A-vs-B per
request with --replay --compare, and the charts per load level, every chart with a legend.
--progress: the level's place in the sweep (level k/N) and, with --duration, the seconds the
level has run of its total (--duration x endpoints).
Exit status: 0 when the run completed and at least one request succeeded (errors of the
endpoints are counted, not fatal), 1 when no measured request succeeded (the reports are still
written), 2 for a usage error (bad arguments, unreadable prompts file).
"""


def _list(kind: Callable[[str], Any], name: str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected a comma-separated list, "
                                             f"got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{name}: values must be positive")
        return values
    return parse


def _add_inputs(b: argparse.ArgumentParser) -> None:
    """What is sent: generated prompts, a prompts file, or a capture export replayed."""
    prompts = b.add_mutually_exclusive_group()
    prompts.add_argument("--prompt-tokens", type=_list(int, "--prompt-tokens"), default=[128],
                         help="generated prompts of exactly these token lengths, sweep "
                              "(default 128)")
    prompts.add_argument("--prompts", metavar="FILE.jsonl",
                         help='one request per line: {"messages": [...], "max_tokens": N} '
                              "(max_tokens optional) or a bare messages list")
    prompts.add_argument("--replay", metavar="FILE.jsonl",
                         help="send the recorded requests of a capture export (docs/capture.md) "
                              "with their own bodies (only the model replaced by --model), each "
                              "once per endpoint by default; report cost and, with --compare, "
                              "the answers side by side")
    prompts.add_argument("--replay-captures", action="store_true",
                         help="as --replay, straight from the capture store (the one `tokenmeter "
                              "captures list` reads: --url, else --config's), the captures "
                              "chosen by the filters below")
    b.add_argument("--prices", metavar="FILE.yaml",
                   help="with --replay: a `prices:` table as in the config, for the cost")
    b.add_argument("--config", metavar="FILE.yaml",
                   help="with --replay: a tokenmeter config whose prices are used (and, with "
                        "--replay-captures, whose capture store is read)")
    captured = b.add_argument_group(
        "--replay-captures", "which captures are sent, as `tokenmeter captures list` chooses "
        "them (--captured-model is its --model)")
    captured.add_argument("--url", help="the capture store: sqlite:///path or postgresql://...")
    add_filters(captured, limit=None, model_flag="--captured-model")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    b: argparse.ArgumentParser = sub.add_parser(
        "bench", help="load-test an OpenAI-compatible endpoint (or two, side by side)",
        description="Measure TTFT, ITL, TPOT, latency and tokens/s of an OpenAI-compatible "
                    "chat-completions endpoint under a sweep of loads and prompt sizes.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8080/v1")
    b.add_argument("--model", help="the model asked for (required, except with --replay: "
                   "there it replaces the recorded model when given)")
    b.add_argument("--compare", metavar="URL2", help="a second base URL, run interleaved")
    b.add_argument("--api", choices=[a.value for a in Api],
                   help="wire format: openai (chat completions, default) or anthropic "
                        "(the Messages API); with --replay each line is sent in its own "
                        "route's API, and --api keeps only that API's lines")
    b.add_argument("--label", help="name of --base-url in the report (default: host:port)")
    b.add_argument("--compare-label", help="name of --compare in the report")
    load = b.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_list(int, "--concurrency"),
                      help="closed loop: requests in flight, levels to sweep (default 1)")
    load.add_argument("--rate", type=_list(float, "--rate"),
                      help="open loop: Poisson arrivals at these requests/s, levels to sweep")
    b.add_argument("--max-connections", type=int, help="open loop: cap on requests in flight")
    size = b.add_mutually_exclusive_group()
    size.add_argument("--requests", type=int, help="requests per endpoint per level (default 32)")
    size.add_argument("--duration", type=float, help="seconds per endpoint per level")
    _add_inputs(b)
    b.add_argument("--max-tokens", type=int, default=256,
                   help="max output tokens per request (default 256; 0: do not send)")
    b.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream responses (default on)")
    b.add_argument("--api-key-env", metavar="NAME",
                   help="environment variable holding the API key (default OPENAI_API_KEY, "
                        "ANTHROPIC_API_KEY with --api anthropic; a --replay without --api: "
                        "each line's API's own); the key is sent as a bearer token (x-api-key "
                        "to Anthropic) and never printed")
    b.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="extra request header, repeatable")
    b.add_argument("--extra-body", metavar="JSON", help='merged into each body, e.g. '
                   '\'{"ignore_eos": true}\'')
    b.add_argument("--tokenizer-model", help="model whose encoding counts output locally "
                   "(default: --model; unknown names use o200k_base)")
    b.add_argument("--warmup", type=int, help="unmeasured requests per endpoint first "
                   "(default 2; 0 with --replay: each recorded request is sent once)")
    b.add_argument("--rounds", type=int, help="blocks per endpoint per level (default 4 with "
                   "--compare, else 1)")
    b.add_argument("--slo", help="e.g. ttft=200ms,tpot=5ms,e2e=2s: report goodput")
    b.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    b.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    b.add_argument("--lag-warn-ms", type=float, default=5.0,
                   help="warn when the event-loop lag p99 exceeds this (default 5)")
    b.add_argument("--json", metavar="FILE", help="write the results as JSON")
    b.add_argument("--csv", metavar="FILE", help="write one CSV row per level")
    b.add_argument("--plot", metavar="FILE", help="write charts: .svg, or an .html report page")
    b.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    return b


class UsageError(ValueError):
    pass


def _label(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.netloc or url


def _headers(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise UsageError(f"--header {item!r}: expected 'NAME: VALUE'")
        out[name.strip()] = value.strip()
    return out


_SECRET = ("authorization", "key", "token", "secret", "cookie")
# The --replay-captures options (by their argparse names).
_CAPTURE_FILTERS = ("url", "user", "capture_model", "status", "error_class", "start", "end",
                    "limit")


def _check(args: argparse.Namespace) -> Api:
    """Refuse arguments that contradict each other or are out of range; the API spoken."""
    if args.max_connections is not None and not args.rate:
        raise UsageError("--max-connections applies to --rate only")
    for name in ("requests", "duration", "max_connections", "rounds", "timeout"):
        if (v := getattr(args, name)) is not None and v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    replaying = args.replay or args.replay_captures
    if not args.model and not replaying:
        raise UsageError("--model is required (except with --replay)")
    if (args.prices or args.config) and not replaying:
        raise UsageError("--prices and --config apply to --replay only")
    chosen = [f for f in _CAPTURE_FILTERS if getattr(args, f) is not None]
    if chosen and not args.replay_captures:
        raise UsageError(f"--{chosen[0].replace('_', '-')} applies to --replay-captures only")
    if args.prices and args.config:
        raise UsageError("give --prices or --config, not both")
    if (args.warmup or 0) < 0 or args.max_tokens < 0:
        raise UsageError("--warmup and --max-tokens must not be negative")
    api = Api(args.api or Api.OPENAI)
    if api is Api.ANTHROPIC and not args.max_tokens:
        raise UsageError("--max-tokens: the Anthropic Messages API requires max_tokens")
    if args.plot:
        suffix = Path(args.plot).suffix.lower()
        if suffix not in (".svg", ".html", ".htm"):
            raise UsageError(f"--plot {args.plot}: only .svg or .html are supported (PNG would "
                             "need a plotting library); use FILE.svg or FILE.html")
    return api


def _extra_body(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--extra-body: not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise UsageError("--extra-body must be a JSON object")
    return extra


def _prompts(path: str | None, tok_model: str) -> list[Prompt] | None:
    if not path:
        return None
    try:
        return load_prompts(path, tok_model)
    except PromptsFileError as exc:
        raise UsageError(str(exc)) from None


@dataclass(frozen=True)
class Keys:
    """The API keys sent (from the environment): one for the run, or with a replay of both
    APIs and no --api-key-env, each API's own variable's."""

    env: str  # the variable(s) named, as the summary shows them
    key: str | None
    per_api: dict[Api, str | None]

    @classmethod
    def of(cls, args: argparse.Namespace, api: Api) -> Keys:
        if args.api_key_env or args.api or not (args.replay or args.replay_captures):
            env = args.api_key_env or (
                "ANTHROPIC_API_KEY" if api is Api.ANTHROPIC else "OPENAI_API_KEY")
            return cls(env, os.environ.get(env) or None, {})
        per_api = {a: os.environ.get(name) or None for a, name in _KEY_ENVS.items()}
        return cls(", ".join(_KEY_ENVS.values()), per_api[api], per_api)


_KEY_ENVS = {Api.OPENAI: "OPENAI_API_KEY", Api.ANTHROPIC: "ANTHROPIC_API_KEY"}


def _endpoints(args: argparse.Namespace, keys: Keys,
               headers: dict[str, str]) -> list[Endpoint]:
    endpoints = [Endpoint(args.base_url, args.label or _label(args.base_url), keys.key, headers,
                          keys.per_api)]
    if args.compare:
        other = args.compare_label or _label(args.compare)
        if other == endpoints[0].label:
            other += " (compare)"
        endpoints.append(Endpoint(args.compare, other, keys.key, headers, keys.per_api))
    return endpoints


@dataclass(frozen=True)
class Replay:
    """`--replay`: the recorded requests sent, and the prices their cost is reckoned at."""

    file: str
    prompts: list[Prompt]
    prices: dict[str, Price]
    loaded: Loaded


def _replay(args: argparse.Namespace, api: Api, tok_model: str) -> Replay | None:
    if not (args.replay or args.replay_captures):
        return None
    # Every line in its own API, unless --api was given: then that API's lines only.
    only = api if args.api else None
    try:
        if args.replay:
            loaded = load_replay(args.replay, only, tok_model)
            return Replay(args.replay, loaded.prompts, load_prices(args.prices, args.config),
                          loaded)
        url = store_url(args)
        redact = redactor(load_config(args.config).capture.redact if args.config
                          else list(DEFAULT_REDACT))
        loaded = load_captures(url, filters_of(args), redact, only, tok_model)
        return Replay(f"captures in {shown_url(url)}", loaded.prompts,
                      load_prices(args.prices, args.config), loaded)
    except (ReplayError, ConfigError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    except (OSError, TimeoutError, sqlite3.Error, asyncpg.PostgresError) as exc:
        raise UsageError(f"--replay-captures: cannot read the captures: {exc}") from None


def build_config(args: argparse.Namespace) -> tuple[BenchConfig, dict[str, Any], Replay | None]:
    """The run's configuration from parsed arguments, and its printable summary (no secrets)."""
    api = _check(args)
    try:
        slo = parse_slo(args.slo) if args.slo else {}
    except ValueError as exc:
        raise UsageError(f"--slo: {exc}") from None
    extra = _extra_body(args.extra_body)
    headers = _headers(args.header)
    keys = Keys.of(args, api)
    tok_model = args.tokenizer_model or args.model or ""
    replay = _replay(args, api, tok_model)
    prompts = replay.prompts if replay else _prompts(args.prompts, tok_model)
    endpoints = _endpoints(args, keys, headers)
    spec = RequestSpec(model=args.model or "", stream=args.stream,
                       max_tokens=args.max_tokens or None, extra_body=extra,
                       timeout_s=args.timeout, tokenizer_model=tok_model, api=api)
    each_once = len(replay.prompts) if replay else 32
    requests = None if args.duration else (args.requests or each_once)
    warmup = args.warmup if args.warmup is not None else (0 if replay else 2)
    config = BenchConfig(
        endpoints=endpoints, spec=spec, concurrency=args.concurrency or [1],
        rates=args.rate or [], prompt_tokens=args.prompt_tokens, prompts=prompts,
        requests=requests, duration_s=args.duration, warmup=warmup, rounds=args.rounds,
        slo=slo, seed=args.seed, lag_warn_ms=args.lag_warn_ms,
        max_connections=args.max_connections)
    summary = {
        "endpoints": [{"label": e.label, "base_url": e.base_url} for e in endpoints],
        "model": args.model, "mode": config.mode, "loads": config.loads,
        "prompt_tokens": None if prompts else config.sizes,
        "prompts_file": args.prompts, "replay_file": replay.file if replay else None,
        "requests_per_level": requests,
        "duration_per_level_s": args.duration, "max_tokens": spec.max_tokens,
        "stream": None if replay else spec.stream, "warmup": warmup, "rounds": config.blocks,
        "slo_s": slo,
        "seed": args.seed,
        # A replay without --api speaks each line's own API.
        "api": "per line" if replay and not args.api else api.value, "api_key_env": keys.env,
        "api_key_set": keys.key is not None or any(k is not None for k in keys.per_api.values()),
        "headers": {k: ("<redacted>" if any(s in k.lower() for s in _SECRET) else v)
                    for k, v in headers.items()},
        "extra_body": extra,
    }
    return config, summary, replay


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _replay_report(replay: Replay | None, result: BenchResult,
                   config: BenchConfig) -> ReplayReport | None:
    if replay is None:
        return None
    labels = [e.label for e in config.endpoints]
    loaded = replay.loaded
    return ReplayReport(
        replay.file, len(replay.prompts),
        tuple(target_costs(result.results, replay.prompts, config.spec.model, replay.prices)),
        compare_answers(result.results, replay.prompts, labels),
        lines=loaded.lines, skipped=loaded.skipped, endpoints=tuple(labels),
        outcomes=request_outcomes(result.results, replay.prompts, loaded.recorded, labels,
                                  config.spec.api))


_URL_PASSWORD = re.compile(r"(://[^/:@\s]*:)[^@/\s]*@")


def _redact_arg(arg: str, after_header: bool) -> str:
    """A command-line word with a secret-looking header's value and a URL's password hidden."""
    arg = _URL_PASSWORD.sub(r"\1<redacted>@", arg)
    flag, eq, rest = arg.partition("=")
    if eq and flag == "--header":
        return f"--header={_redact_arg(rest, True)}"
    name, sep, _ = arg.partition(":")
    if after_header and sep and any(s in name.lower() for s in _SECRET):
        return f"{name}: <redacted>"
    return arg


def command_line(argv: list[str]) -> str:
    """The bench command as typed, secrets redacted, for the report page."""
    words = argv[argv.index("bench"):] if "bench" in argv else ["bench"]
    shown = [_redact_arg(w, i > 0 and words[i - 1] == "--header") for i, w in enumerate(words)]
    return shlex.join(["tokenmeter", *shown])


def _version() -> str:
    try:
        return importlib.metadata.version("tokenmeter")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run(args: argparse.Namespace) -> int:
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    try:
        config, summary, replay = build_config(args)
    except UsageError as exc:
        print(f"tokenmeter bench: {exc}", file=sys.stderr)
        return 2
    show = sys.stderr.isatty() if args.progress is None else args.progress
    bar = ProgressBar(sys.stderr) if show else None
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        try:
            result: BenchResult = runner.run(run_bench(config, bar))
        finally:
            if bar is not None:
                bar.close()
    table = render(result)
    extra = _replay_report(replay, result, config)
    if extra is not None:
        table += "\n" + extra.render()
    print(table, flush=True)
    if args.json:
        write_text(args.json, to_json(result, summary,
                                      {"replay": extra.to_dict()} if extra else None))
    if args.csv:
        write_text(args.csv, to_csv(result))
    if args.plot:
        shown = json.loads(_URL_PASSWORD.sub(r"\1<redacted>@", json.dumps(summary)))
        info = RunInfo(shown, command_line(sys.argv), started, _version(), result.results,
                       extra)
        try:
            write_plot(args.plot, result.levels,
                       "tokenmeter bench: "
                       + (args.model or "replay of " + str(args.replay or "captures")),
                       table, info)
        except PlotFormatError as exc:  # checked above already; kept for API callers
            print(f"tokenmeter bench: {exc}", file=sys.stderr)
            return 2
    if not any(r.ok for r in result.results):
        print(f"tokenmeter bench: no request succeeded ({len(result.results)} sent, all "
              "failed: see the errors above); exit status 1", file=sys.stderr)
        return 1
    return 0
