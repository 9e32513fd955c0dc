"""`tokenmeter captures list|show|export`: the captured requests, read from the capture store
(the ledger's database unless `--url` or `capture.url` names another). See docs/capture.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, tzinfo
from decimal import Decimal
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

import asyncpg

from proxy.capture.collect import redactor
from proxy.capture.record import Body, Capture
from proxy.capture.redact import Redactor
from proxy.capture.store import CaptureFilter, CaptureRow, CaptureStore, default_url
from proxy.config.capture import CaptureConfig
from proxy.config.ledger import LedgerConfig
from proxy.config.load import ConfigError, load_config
from proxy.ledger.query import LedgerUnavailable, Location, locate, open_reader
from proxy.ledger.report_plan import parse_bound
from proxy.ledger.schema import TABLE as LEDGER_TABLE
from proxy.protocol.codecs import codec_for
from proxy.storage.urls import shown_url
from proxy.telemetry.shown_text import for_terminal

T = TypeVar("T")

# What `show` gives of the ledger's row: the figures a capture does not hold. `cache` says why
# a cache hit's row holds 0 tokens and $0 beside an answer with usage (no upstream call: the
# `saved_*` figures are what the entry's answer used, priced when the hit was served).
_LEDGER_FIELDS = ("input_tokens", "output_tokens", "cached_input_tokens",
                  "cache_creation_input_tokens", "reasoning_tokens", "token_source", "ttft_ms",
                  "duration_ms", "cost_nanousd", "cache", "saved_input_tokens",
                  "saved_output_tokens", "saved_cost_nanousd")
_EVERYTHING = 2**31 - 1  # export: no limit unless one is given


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("captures", help="list, show and export captured requests")
    actions = c.add_subparsers(dest="captures_command", required=True)
    listing = actions.add_parser("list", help="captured requests, newest first")
    _add_filters(listing, limit=100)
    listing.add_argument("--format", choices=["table", "json"], default="table")
    show = actions.add_parser("show", help="one captured request, whole")
    show.add_argument("request_id", metavar="REQUEST_ID",
                      help="tokenmeter's id (x-tokenmeter-request-id) or the upstream's (the "
                           "SDK's request_id)")
    show.add_argument("--format", choices=["text", "json"], default="text")
    show.add_argument("--ledger", metavar="URL",
                      help="the ledger to read the request's row from (default: the "
                           "configuration's)")
    _add_source(show)
    export = actions.add_parser("export", help="one JSON line a request (bench and replay input)")
    _add_filters(export, limit=None)
    export.add_argument("--format", choices=["jsonl"], default="jsonl")


def _add_source(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML configuration (its capture.url, else its ledger)")
    p.add_argument("--url", help="read this store: sqlite:///path or postgresql://...")


def _add_filters(p: argparse.ArgumentParser, limit: int | None) -> None:
    _add_source(p)
    add_filters(p, limit)


def add_filters(p: argparse.ArgumentParser | argparse._ArgumentGroup, limit: int | None,
                model_flag: str = "--model") -> None:
    """The options that choose captures (`list`, `export`, and `tokenmeter bench
    --replay-captures`, where --model is taken and the filter is `model_flag`)."""
    p.add_argument("--user")
    p.add_argument(model_flag, dest="capture_model", metavar="MODEL",
                   help="asked for or sent upstream")
    p.add_argument("--status", type=int)
    p.add_argument("--error-class")
    p.add_argument("--request-id", dest="capture_request_id", metavar="ID",
                   help="tokenmeter's id of the request or the upstream's (the SDK's "
                        "request_id)")
    p.add_argument("--from", dest="start", metavar="WHEN",
                   help="YYYY-MM-DD or YYYY-MM-DDTHH:MM, UTC unless it carries an offset")
    p.add_argument("--to", dest="end", metavar="WHEN",
                   help="YYYY-MM-DD (that whole day included) or YYYY-MM-DDTHH:MM (excluded)")
    p.add_argument("--limit", type=int, default=limit)


def run(args: argparse.Namespace) -> int:
    commands: dict[str, Callable[[argparse.Namespace, str], int]] = {
        "list": _list, "show": _show, "export": _export,
    }
    try:
        url = store_url(args)
        # Which store was read: a capture not found may be in another (docs/capture.md).
        print(f"store: {shown_url(url)}", file=sys.stderr)
        return commands[args.captures_command](args, url)
    except (ConfigError, ValueError) as exc:  # a wrong option or configuration
        print(exc, file=sys.stderr)
        return 2
    except (OSError, TimeoutError, sqlite3.Error, asyncpg.PostgresError) as exc:
        print(f"cannot read the captures: {exc}", file=sys.stderr)
        return 1


def _configs(args: argparse.Namespace) -> tuple[CaptureConfig, LedgerConfig]:
    if not args.config:
        return CaptureConfig(), LedgerConfig()
    config = load_config(args.config)
    return config.capture, config.ledger


def _read_redactor(args: argparse.Namespace) -> Redactor:
    """What a capture's reassembled output is redacted with when read: --config's
    `capture.redact` and its upstreams' keys (a capture is written redacted; this is for what
    only joining a stream's pieces shows, and for captures written by an older version)."""
    if not args.config:
        return redactor(CaptureConfig().redact)
    config = load_config(args.config)
    return redactor(config.capture.redact, [u.api_key for u in config.upstreams.values()])


def store_url(args: argparse.Namespace) -> str:
    """The store `args` name: --url, else --config's capture.url, else its ledger's database
    (without --config: the default ledger file)."""
    if args.url is not None:
        return str(args.url)
    return default_url(*_configs(args))


def _zone(args: argparse.Namespace) -> tzinfo:
    """The time zone `list` shows times in: --config's `timezone`, else UTC."""
    zone = load_config(args.config).timezone if args.config else "UTC"
    return UTC if zone == "UTC" else ZoneInfo(zone)


def filters_of(args: argparse.Namespace) -> CaptureFilter:
    """The `add_filters` options as a CaptureFilter (ValueError for a bad bound or limit)."""
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, not {args.limit}")
    utc = ZoneInfo("UTC")
    since = None if args.start is None else parse_bound(args.start, utc, end=False).timestamp()
    until = None if args.end is None else parse_bound(args.end, utc, end=True).timestamp()
    return CaptureFilter(user=args.user, model=args.capture_model, status=args.status,
                         error_class=args.error_class, since=since, until=until,
                         request_id=args.capture_request_id,
                         limit=_EVERYTHING if args.limit is None else args.limit)


def _with_store(url: str, fn: Callable[[CaptureStore], Awaitable[T]]) -> T:
    async def go() -> T:
        store = await CaptureStore.open(url)
        try:
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(go())


def _when(epoch: float, zone: tzinfo = UTC) -> str:
    """To the millisecond: UTC with a Z, another zone with its offset."""
    t = datetime.fromtimestamp(epoch, zone)
    if zone is UTC:
        return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"
    offset = t.strftime("%z")
    return f"{t.strftime('%Y-%m-%dT%H:%M:%S.%f')[:-3]}{offset[:3]}:{offset[3:]}"


def _list(args: argparse.Namespace, url: str) -> int:
    filters = filters_of(args)
    rows = _with_store(url, lambda store: store.list(filters))
    if args.format == "json":
        print(json.dumps([_row_json(r) for r in rows], indent=2))
        return 0
    print(_table(rows, _zone(args)))
    return 0


def _row_json(r: CaptureRow) -> dict[str, Any]:
    return {"request_id": r.request_id, "started_at": r.started_at, "user": r.user,
            "key_name": r.key_name, "team": r.team, "requested_model": r.requested_model,
            "model": r.model, "status": r.status, "error_class": r.error_class,
            "stream": r.stream, "size": r.size, "upstream_request_id": r.upstream_request_id}


def _table(rows: list[CaptureRow], zone: tzinfo) -> str:
    head = (f"started ({zone})", "request_id", "user", "model", "status", "error_class", "stream",
            "size")
    lines = [head] + [
        (_when(r.started_at, zone), r.request_id, r.user or "-",
         r.model or f"({r.requested_model})", str(r.status), r.error_class,
         "yes" if r.stream else "no", str(r.size))
        for r in rows
    ]
    cells = [[for_terminal(c) for c in line] for line in lines]
    widths = [max(len(line[i]) for line in cells) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in cells]
    return "\n".join([*text, f"({len(rows)} captures)"])


def _show(args: argparse.Namespace, url: str) -> int:
    redact = _read_redactor(args)
    capture = _with_store(url, lambda store: store.get(args.request_id, redact))
    if capture is None:
        print(f"no capture of request {args.request_id!r} in the store", file=sys.stderr)
        return 1
    _, ledger_config = _configs(args)
    ledger = asyncio.run(_ledger_row(locate(ledger_config, args.ledger), capture))
    if args.format == "text":
        print(_text(capture, ledger))
        return 0
    obj = capture.to_json()
    if capture.stream:
        obj["stream_text"] = capture.output_text
    obj["ledger"] = ledger
    print(json.dumps(obj, indent=2, ensure_ascii=False))
    return 0


async def _ledger_row(location: Location, capture: Capture) -> dict[str, Any] | None:
    """The ledger's figures for the captured request; None when the ledger cannot be read or
    holds no row of it (not written yet, or past the ledger's retention)."""
    try:
        async with await open_reader(location) as reader:
            q = reader.sql()
            rows = await reader.fetch(f"SELECT {', '.join(_LEDGER_FIELDS)} FROM {LEDGER_TABLE} "
                                      f"WHERE request_id = {q.p(capture.request_id)}", q.params)
    except LedgerUnavailable:
        return None
    if not rows:
        return None
    row = dict(zip(_LEDGER_FIELDS, rows[0], strict=True))
    # Exact dollars as the ledger holds them (nano-dollars), never a binary float.
    row["cost_usd"] = _usd(row["cost_nanousd"])
    row["saved_cost_usd"] = _usd(row["saved_cost_nanousd"])
    return row


def _usd(nano: Any) -> str | None:
    return None if nano is None else format(Decimal(int(nano)).scaleb(-9), "f")


def _ledger_lines(row: dict[str, Any] | None) -> list[str]:
    """The ledger block of `show`'s text: the row's figures, or why there are none."""
    if row is None:
        return ["--- ledger", "no row of this request in the ledger (not written yet, past its "
                "retention, or the ledger cannot be read)"]
    lines = [
        "--- ledger",
        f"tokens       input {row['input_tokens']} (cached {row['cached_input_tokens']}, "
        f"cache writes {row['cache_creation_input_tokens']}), output {row['output_tokens']} "
        f"(reasoning {row['reasoning_tokens']}), {row['token_source']}",
        f"timing       ttft {_ms(row['ttft_ms'])}, duration {_ms(row['duration_ms'])}",
        f"cost_usd     {row['cost_usd'] if row['cost_usd'] is not None else 'unpriced'}",
        f"cache        {row['cache']}",
    ]
    if row["cache"] == "hit":
        saved = row["saved_cost_usd"] if row["saved_cost_usd"] is not None else "unpriced"
        # The row charges what `cache.charge_hits` says; the answer's own usage is what the
        # stored entry used when it was made.
        lines.append(f"             answered from the response cache, no upstream call; the "
                     f"stored answer used input {row['saved_input_tokens']}, output "
                     f"{row['saved_output_tokens']} (cost_usd {saved}, priced when the hit "
                     f"was served)")
    return lines


def _ms(value: Any) -> str:
    return "-" if value is None else f"{float(value):.1f} ms"


def _text(c: Capture, ledger: dict[str, Any] | None) -> str:
    lines = [
        f"request_id   {c.request_id} (upstream's: {c.upstream_request_id or '-'})",
        f"started      {_when(c.started_at)}",
        f"route        {c.api} {c.path} ({c.operation})",
        f"who          user={c.user} key={c.key_name} team={c.team}",
        f"model        {c.requested_model} -> {c.model}",
        f"outcome      status {c.status}, {c.error_class}, {'stream' if c.stream else 'json'}",
    ]
    for title, body in (("request", c.request), ("upstream request", c.upstream_request),
                        ("response", c.response), ("upstream error", c.upstream_error)):
        if body is not None:
            lines += [_heading(title, body), *_shown(body.text)]
    if c.events:
        more = ", truncated" if c.events_truncated else ""
        lines.append(f"--- events ({len(c.events)}{more})")
        lines += [f"{e.at_ms:10.1f} ms  {for_terminal(e.text)}" for e in c.events]
    if c.output_text is not None:
        lines += ["--- output", *_shown(c.output_text)]
    if c.reasoning is not None:
        lines += ["--- reasoning", *_shown(c.reasoning)]
    if c.refusal is not None:
        lines += ["--- refusal", *_shown(c.refusal)]
    if c.tool_calls:
        lines += ["--- tool calls", *(for_terminal(json.dumps(t)) for t in c.tool_calls)]
    lines += [for_terminal(line) for line in _ledger_lines(ledger)]
    return "\n".join(for_terminal(line) if i < 6 else line for i, line in enumerate(lines))


def _heading(title: str, body: Body) -> str:
    return f"--- {title} ({body.size} bytes{', truncated' if body.truncated else ''})"


def _shown(text: str) -> list[str]:
    return [for_terminal(line) for line in text.split("\n")]


def _export(args: argparse.Namespace, url: str) -> int:
    lines, skipped = exported(url, filters_of(args), _read_redactor(args))
    for line in lines:
        sys.stdout.write(jsonl(line))
    if skipped:
        print(f"{skipped} captures left out: their request is not whole JSON (truncated at "
              "capture.max_body_kb, or not JSON)", file=sys.stderr)
    return 0


# Characters JSON leaves raw (ensure_ascii=False) that some readers take for a line break
# (Python's str.splitlines, JavaScript's line terminators): escaped, so that one export line
# is one line for every reader. Inside JSON they can only be in strings, where `\uXXXX` means
# the same character.
_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def jsonl(line: dict[str, Any]) -> str:
    """One export line as written: compact JSON, UTF-8 kept, ending with its one `\\n`."""
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")).translate(_BREAKS) + "\n"


def exported(url: str, filters: CaptureFilter,
             redact: Callable[[str], str]) -> tuple[list[dict[str, Any]], int]:
    """The export lines of the captures `filters` chooses, oldest first, and how many were
    left out (their request is not whole JSON). What `export` prints and `tokenmeter bench
    --replay-captures` sends."""

    async def read(store: CaptureStore) -> list[Capture]:
        rows = await store.list(filters)
        # oldest first
        found = [await store.get(r.request_id, redact) for r in reversed(rows)]
        return [c for c in found if c is not None]

    lines = [export_line(c) for c in _with_store(url, read)]
    kept = [line for line in lines if line is not None]
    return kept, len(lines) - len(kept)


def _json_or_none(body: Body | None) -> Any:
    if body is None or body.truncated:
        return None
    try:
        return json.loads(body.text)
    except ValueError:
        return None


def export_line(c: Capture) -> dict[str, Any] | None:
    """docs/capture.md's export line; None when the request is not whole JSON (a replay could
    not match it by its messages)."""
    request = _json_or_none(c.request)
    if not isinstance(request, dict):
        return None
    line: dict[str, Any] = {
        "request_id": c.request_id, "api": c.api, "path": c.path, "model": c.requested_model,
        "messages": request.get("messages"),
    }
    cap = next(iter(codec_for(c.operation).asked_caps(request)), None)
    if cap is not None:
        line["max_tokens"] = cap
    line["stream"] = c.stream
    line["request"] = request
    line["response"] = {
        "status": c.status, "body": _json_or_none(c.response),
        "events": [{"at_ms": e.at_ms, "text": e.text} for e in c.events],
        "output_text": c.output_text,
    }
    return line
