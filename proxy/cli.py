"""`tokenmeter`: serve, demo, mock-upstream, check-config, usage, reconcile, bench."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.bench.cli import add_parser as add_bench_parser
from proxy.bench.cli import run as run_bench
from proxy.budget.store import StoreError
from proxy.budget.store_redis import RedisStore
from proxy.budget.usage_report import UserUsage, read_usage, render, today
from proxy.capture.cli import add_parser as add_captures_parser
from proxy.capture.cli import run as run_captures
from proxy.config.exposure import exposure_warning
from proxy.config.ledger import LedgerConfig
from proxy.config.load import Config, ConfigError, load_config, single_upstream_config
from proxy.cost import price_version
from proxy.ledger.lookup import find_request, render_rows
from proxy.ledger.query import LedgerUnavailable, Location, locate, open_reader
from proxy.ledger.report_plan import (
    Report,
    ReportPeriod,
    build_report,
    check_tags,
    checked_period,
    default_period,
    parse_bound,
    parse_by,
)
from proxy.ledger.report_render import (
    Export,
    Rounding,
    describe_period,
    render_csv,
    render_json,
    render_table,
)
from proxy.pipeline.services import SERVICES
from proxy.reconcile.command import add_parser as add_reconcile_parser
from proxy.reconcile.command import run as run_reconcile
from proxy.server import state as st
from proxy.server.app import Placement, create_app, create_metrics_app
from proxy.server.listener import ConnectionGuard, GuardedSite, ListenerLimits, raise_fd_limit
from proxy.server.workers import (
    WorkerSockets,
    budget_sharing_problem,
    inherited_sockets,
    parse_workers,
    resolve_workers,
    supervise,
    watch_supervisor,
)
from proxy.telemetry.accesslog import (
    JsonFormatter,
    LogFormat,
    TextFormatter,
    install_access_handler,
)
from proxy.telemetry.metrics import Metrics

log = logging.getLogger("tokenmeter")


class ClientErrorFilter(logging.Filter):
    """aiohttp logs a malformed request (bad header bytes, Content-Length with
    Transfer-Encoding, ...) at error level with a traceback, though the client is at fault and
    got its 400. Turn those into one warning line; errors of the server itself stay errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = f"refused a malformed request ({exc.code}): {exc.message.splitlines()[0]}"
            record.args = ()
            record.exc_info = record.exc_text = None
        return True


def setup_logging(level: str = "INFO", log_format: LogFormat = LogFormat.JSON) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format is LogFormat.JSON else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").addFilter(ClientErrorFilter())


def _mock_settings(args: argparse.Namespace) -> object:
    from proxy.testing.mock_upstream import MockSettings

    return MockSettings(
        tokens_per_second=args.tokens_per_second,
        ttft_ms=args.ttft_ms,
        output_tokens=args.output_tokens,
        usage=not args.no_usage,
        status=args.status,
        delay_ms=args.delay_ms,
        stall_after=args.stall_after,
        reset_after=args.reset_after,
    )


async def _start_site(
    app: web.Application, address: tuple[str, int], *, drain_seconds: float = 5.0,
    guard: ConnectionGuard | None = None, socks: Sequence[socket.socket] = (),
) -> tuple[web.AppRunner, int]:
    # handler_cancellation: a client that disconnects cancels its handler, so the upstream
    # request is closed at once instead of at the next chunk. shutdown_timeout: on SIGTERM the
    # listener closes first, running streams get this long to finish, then they are cancelled
    # (and still settled: settling is shielded). The guard bounds how long a request may take
    # to arrive and how many connections are open (proxy/listener.py). `socks`: listening
    # sockets a supervisor bound (serve --workers), one site each, instead of binding here.
    host, port = address
    guard = guard or ConnectionGuard()
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_seconds,
        keepalive_timeout=guard.limits.keepalive_timeout_s,
    )
    await runner.setup()
    sites = [GuardedSite(runner, host, port, guard, sock=sock) for sock in socks] or [
        GuardedSite(runner, host, port, guard)
    ]
    for site in sites:
        await site.start()
    return runner, sites[0].port


async def _embedded_upstream(host: str) -> tuple[web.AppRunner, str]:
    from proxy.testing.mock_upstream import MockSettings, create_mock_app

    runner, port = await _start_site(create_mock_app(MockSettings()), (host, 0))
    return runner, f"http://{host}:{port}/v1"


@dataclass(frozen=True)
class _ServeOptions:
    """How `serve` or `demo` runs, from its command line. `inherited`: this process is worker
    `inherited.index` of `serve --workers`, serving the sockets its supervisor bound."""

    host: str | None = None
    port: int | None = None
    demo: bool = False
    once: bool = False
    config_path: Path | None = None
    inherited: WorkerSockets | None = None


async def _serve(config: Config | None, options: _ServeOptions) -> None:
    runners: list[web.AppRunner] = []
    chores: list[asyncio.Task[None]] = []
    shared: Metrics | None = None  # a worker's metrics, summed with the other workers'
    inherited = options.inherited

    fd_limit = raise_fd_limit()
    try:
        if config is None:
            mock_runner, url = await _embedded_upstream("127.0.0.1")
            runners.append(mock_runner)
            log.warning("no --config or --upstream: serving the embedded simulated upstream %s",
                        url)
            config = single_upstream_config(url, None)
        placement = Placement() if inherited is None else Placement(
            workers=inherited.count, audit=inherited.index == 0, ship=False)
        app = create_app(config, config_path=options.config_path, placement=placement)
        base, metrics_url = await _start_listeners(app, config, options, fd_limit, runners)
        if inherited is not None:
            log.info("worker %d (pid %d) serving %s", inherited.index, os.getpid(), base)
        else:
            log.info("tokenmeter listening on %s (metrics at %s)", base, metrics_url)
        if options.demo:
            from proxy.demo import run_demo

            settling = app[SERVICES].settling
            await run_demo(base, metrics_url, lambda: asyncio.gather(*settling.tasks))
            if options.once:
                return
        stop = _stop_on_signals(app)
        if inherited is not None:
            chores.append(asyncio.create_task(watch_supervisor(stop)))
        metrics = app[SERVICES].metrics
        if metrics.shared:
            shared = metrics
            chores.append(asyncio.create_task(metrics.keep_fresh()))
        await stop.wait()
        log.info("shutting down: draining for up to %.0f s", config.server.drain_seconds)
    finally:
        for task in chores:
            task.cancel()
        for r in reversed(runners):
            await r.cleanup()
        if shared is not None:
            shared.publish()  # what the last requests counted, before the process ends


async def _start_listeners(
    app: web.Application, config: Config, options: _ServeOptions, fd_limit: int | None,
    runners: list[web.AppRunner],
) -> tuple[str, str]:
    """Serve `app` (and /metrics on its own port, if configured); the API's base URL and the
    metrics URL. Each runner started is added to `runners`, for the caller to clean up."""
    inherited = options.inherited
    host = options.host or config.server.host
    port = config.server.port if options.port is None else options.port
    # One guard for the API and metrics ports: one connection count, one fd budget.
    metrics = app[SERVICES].metrics
    guard = ConnectionGuard(
        ListenerLimits.from_config(config.server, fd_limit),
        on_event=lambda event: metrics.connection_closed(event.value),
    )
    metrics.connections_open(lambda: guard.open)
    runner, actual = await _start_site(
        app, (host, port), drain_seconds=config.server.drain_seconds, guard=guard,
        socks=inherited.api if inherited is not None else (),
    )
    runners.append(runner)
    metrics_host, metrics_port = host, actual
    if config.metrics.port is not None:
        metrics_host = config.metrics.host or host
        metrics_runner, metrics_port = await _start_site(
            create_metrics_app(app), (metrics_host, config.metrics.port), guard=guard,
            socks=inherited.metrics if inherited is not None else (),
        )
        runners.insert(0, metrics_runner)  # cleaned up last: scrapes see the drain
    return f"http://{host}:{actual}/v1", f"http://{metrics_host}:{metrics_port}/metrics"


def _stop_on_signals(app: web.Application) -> asyncio.Event:
    """An event set by SIGINT or SIGTERM; SIGHUP reloads the configuration, when watched."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    watcher = app.get(st.WATCHER)
    if watcher is not None:
        loop.add_signal_handler(signal.SIGHUP, watcher.request_reload)
    return stop


_USAGE_HELP = """\
Usage and cost from the ledger (the books: one row per request), or with --source store the
per-user counters the budget store holds for one day.

The ledger report: requests, refused (by the budget), failed, input, cached input, output and
reasoning tokens, total (input + output) and cost in USD (an exact decimal; 'unpriced' counts
requests whose model has no price), per group, then a total row. A request counts at the time
it started. --from and --to take dates (YYYY-MM-DD; --to D includes all of day D) or
datetimes (YYYY-MM-DDTHH:MM, --to excluded). Dates, days, weeks (Monday to Sunday, shown as the
Monday's date) and months are those of the configured time zone (timezone:, else UTC;
--timezone overrides). Without --from and --to: this month so far; --to before --from is an
error, and so is --by tag:KEY for a key the configuration's tags: does not declare.

CSV and JSON say what they are: the period (from, to), the time zone, the price version (the
fingerprint of the configuration's price table, as each ledger row records it; empty without
--config) and the cost rounding (CSV: columns of every line; JSON: top-level fields), and
mark the total line (total: true; none with --no-total). --round cents rounds USD to cents,
half up, each line from its exact sum.

  tokenmeter usage                                   # this month so far, per user
  tokenmeter usage --config tm.yaml --from 2026-11-01 --to 2026-11-30 --by team,model
  tokenmeter usage --by key,day --format csv > november.csv
  tokenmeter usage --ledger postgresql://reader@db/tokenmeter --by user,week --format json

The ledger read is the configuration's (ledger.url; without one, ledger.sqlite3 in the state
directory, $TOKENMETER_STATE_DIR else $XDG_STATE_HOME/tokenmeter), or --ledger's.

The store's counters (what the budget enforces now, kept eight days):
  tokenmeter usage --config tm.yaml --source store [--date 2026-12-01] [--json]
--date or --json alone also select this view (they are its options).
"""


def _add_usage_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    u = sub.add_parser(
        "usage", help="usage and cost from the ledger (or a day of the store's counters)",
        description=_USAGE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    u.add_argument("--config", help="YAML configuration (its ledger, time zone, store)")
    u.add_argument("--source", choices=["ledger", "store"],
                   help="ledger (default) or store; --date and --json imply store")
    books = u.add_argument_group("the ledger report")
    books.add_argument("--ledger", metavar="URL",
                       help="read this ledger instead: sqlite:///path or postgresql://...")
    books.add_argument("--from", dest="start", metavar="WHEN",
                       help="YYYY-MM-DD or YYYY-MM-DDTHH:MM, local time (default: the first "
                            "of this month, unless --to is given)")
    books.add_argument("--to", dest="end", metavar="WHEN",
                       help="YYYY-MM-DD (that whole day included) or YYYY-MM-DDTHH:MM "
                            "(excluded), local time (default: now)")
    books.add_argument("--by", default="user", metavar="KEYS",
                       help="comma-separated groups among user,team,key,model,upstream,day,"
                            "week,month and tag:KEY (a tag's value) (default: user)")
    books.add_argument("--format", choices=["table", "csv", "json"],
                       help="output format (default: table)")
    books.add_argument("--round", choices=list(Rounding), default=Rounding.EXACT,
                       help="cents: USD rounded to cents, half up, each line from its exact "
                            "sum (default: exact, nine decimals)")
    books.add_argument("--no-total", action="store_true", help="leave out the total line")
    books.add_argument("--timezone", metavar="ZONE",
                       help="IANA time zone for dates and buckets (default: the "
                            "configuration's, else UTC)")
    books.add_argument("--request-id", metavar="ID",
                       help="one request's row instead of a report: tokenmeter's id "
                            "(x-tokenmeter-request-id) or the upstream's (the SDK's request_id)")
    store = u.add_argument_group("the store's counters")
    store.add_argument("--date", help="YYYY-MM-DD in the configured time zone (default: today)")
    store.add_argument("--json", action="store_true", help="JSON instead of a table")


def _usage(args: argparse.Namespace) -> int:
    source = args.source or ("store" if args.date or args.json else "ledger")
    ledger_only = [flag for flag, value in (
        ("--ledger", args.ledger), ("--from", args.start), ("--to", args.end),
        ("--format", args.format), ("--timezone", args.timezone),
        ("--by", args.by if args.by != "user" else None), ("--request-id", args.request_id),
        ("--round", args.round if args.round != Rounding.EXACT else None),
        ("--no-total", True if args.no_total else None),
    ) if value is not None]
    if source == "ledger":
        if args.date or args.json:
            print("--date and --json belong to --source store; for the ledger use --from D "
                  "--to D and --format json", file=sys.stderr)
            return 2
        return _ledger_usage(args)
    if ledger_only:
        print(f"{', '.join(ledger_only)}: options of the ledger report, not of --source store",
              file=sys.stderr)
        return 2
    if not args.config:
        print("--source store needs --config (the store to read)", file=sys.stderr)
        return 2
    return _store_usage(args)


def _ledger_usage(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config) if args.config else None
        zone = args.timezone or (config.timezone if config is not None else "UTC")
        try:
            tz = ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {zone!r}") from None
        by = parse_by(args.by)
        if args.start is None and args.end is None:
            period = default_period(tz, time.time())
        else:
            period = checked_period(ReportPeriod(
                tz,
                None if args.start is None else parse_bound(args.start, tz, end=False),
                None if args.end is None else parse_bound(args.end, tz, end=True),
            ), args.start, args.end)
        if config is not None:
            check_tags(by, config.tags)
        ledger = config.ledger if config is not None else LedgerConfig()
        if not ledger.enabled and args.ledger is None:
            raise ValueError("the ledger is off in this configuration (ledger.enabled: false); "
                             "give --ledger URL to read one")
        location = locate(ledger, args.ledger)
    except (ConfigError, ValueError, LedgerUnavailable) as exc:
        print(exc, file=sys.stderr)
        return 2

    if args.request_id is not None:
        return _request_rows(location, args.request_id, tz, args.format or "table")

    async def run() -> Report:
        async with await open_reader(location) as reader:
            return await build_report(reader, by, period)

    try:
        report = asyncio.run(run())
    except LedgerUnavailable as exc:
        print(f"cannot read the ledger: {exc}", file=sys.stderr)
        return 1
    export = Export(None if config is None else price_version(config.prices),
                    Rounding(args.round), not args.no_total)
    fmt = args.format or "table"
    if fmt == "csv":
        sys.stdout.write(render_csv(report, export))
    elif fmt == "json":
        print(render_json(report, export))
    else:
        print(render_table(report, f"{location.describe()}: {describe_period(period)}",
                           export))
    return 0


def _request_rows(location: Location, request_id: str, tz: ZoneInfo, fmt: str) -> int:
    """`usage --request-id`: the row of the request either id names (1: none)."""
    async def run() -> list[dict[str, object]]:
        async with await open_reader(location) as reader:
            return await find_request(reader, request_id, tz)

    try:
        rows = asyncio.run(run())
    except LedgerUnavailable as exc:
        print(f"cannot read the ledger: {exc}", file=sys.stderr)
        return 1
    if not rows:
        print(f"no row of request {request_id!r} in {location.describe()} (not written yet, "
              "or past the ledger's retention)", file=sys.stderr)
        return 1
    print(render_rows(rows, fmt))
    return 0


def _store_usage(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        day = date.fromisoformat(args.date) if args.date else today(config, time.time())
    except (ConfigError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    if config.store.url == "memory":
        print("the in-process store lives inside the running proxy; usage needs a Redis store "
              "(see tokenmeter_budget_used_tokens on /metrics instead)", file=sys.stderr)
        return 2
    if not config.users:
        # Open and pass-through modes have no budgets: the store keeps no counters for them.
        print("no users are configured, so there are no budgets and the store counts nothing; "
              "what was used is in the ledger: tokenmeter usage --config FILE", file=sys.stderr)
        return 2

    async def run() -> list[UserUsage]:
        store = RedisStore(config.store.url, max(config.store.timeout_ms, 2000))
        try:
            return await read_usage(config, store, day)
        finally:
            await store.close()

    try:
        rows = asyncio.run(run())
    except StoreError as exc:
        print(f"cannot read the store: {exc}", file=sys.stderr)
        return 1
    print(render(rows, args.json))
    return 0


def _resolve_config(args: argparse.Namespace) -> Config | None:
    if args.config and args.upstream:
        raise ConfigError("give either --config or --upstream, not both")
    if args.config:
        config = load_config(args.config)
        if (warning := exposure_warning(Path(args.config))) is not None:
            log.warning(warning)
        return config
    if args.upstream:
        return single_upstream_config(args.upstream, os.environ.get("OPENAI_API_KEY"))
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmeter", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    for name, help_text in (
        ("serve", "run the proxy"),
        ("demo", "run the proxy with the simulated upstream and make one streaming request"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", help="YAML configuration file")
        p.add_argument("--upstream", help="one upstream base URL, e.g. https://api.openai.com/v1")
        p.add_argument("--host", help="listen address (default: server.host, else 127.0.0.1)")
        p.add_argument("--port", type=int, help="listen port (default: server.port, else 8080)")
        p.add_argument("--log-level", default="INFO")
        p.add_argument("--log-format", type=LogFormat, choices=list(LogFormat),
                       default=LogFormat.JSON,
                       help="json: one JSON object a line, for a log pipeline (default); "
                            "text: lines for a person at a terminal")
        if name == "serve":
            p.add_argument(
                "--workers", type=_workers_arg, metavar="N",
                help="processes serving the port: a number or 'auto' (one per CPU); default: "
                     "server.workers, else 1. More than 1 needs a Redis budget store when any "
                     "limit is configured",
            )
        if name == "demo":
            p.add_argument("--once", action="store_true", help="exit after the demo request")

    from proxy.testing.mock_settings import headers_help

    m = sub.add_parser("mock-upstream", help="run the simulated OpenAI-compatible upstream",
                       epilog=headers_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("--host", default="127.0.0.1")
    m.add_argument("--port", type=int, default=9000)
    m.add_argument("--tokens-per-second", type=float, default=750.0)
    m.add_argument("--ttft-ms", type=float, default=20.0)
    m.add_argument("--output-tokens", type=int, default=64)
    m.add_argument("--no-usage", action="store_true", help="never report usage")
    m.add_argument("--status", type=int, default=200, help="answer every request with this status")
    m.add_argument("--delay-ms", type=float, default=0.0, help="delay before response headers")
    m.add_argument("--stall-after", type=int, default=None, help="hang after N tokens")
    m.add_argument("--reset-after", type=int, default=None, help="reset connection after N tokens")
    m.add_argument("--replay", metavar="FILE", help="answer with the recorded answers of a "
                   "`captures export --format jsonl` file instead (docs/capture.md)")
    m.add_argument("--speed", type=_speed_arg, default=1.0, metavar="N",
                   help="with --replay: stream N times as fast as recorded; 0: no pacing")

    c = sub.add_parser("check-config", help="validate a configuration file")
    c.add_argument("file")
    c.add_argument("--connect", action="store_true",
                   help="also try the Redis and PostgreSQL servers it names")

    _add_usage_parser(sub)
    add_bench_parser(sub)
    add_reconcile_parser(sub)
    add_captures_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    setup_logging(getattr(args, "log_level", "INFO"),
                  getattr(args, "log_format", LogFormat.JSON))

    if args.command == "check-config":
        return _check_config(args.file, connect=args.connect)
    if args.command == "usage":
        return _usage(args)
    if args.command == "reconcile":
        return run_reconcile(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "captures":
        return run_captures(args)
    if args.command == "mock-upstream" and args.replay is not None:
        return _replay_upstream(args)
    if args.command == "mock-upstream":
        from proxy.testing.mock_upstream import MockSettings, run_mock

        settings = _mock_settings(args)
        assert isinstance(settings, MockSettings)
        run_mock(settings, args.host, args.port)
        return 0
    return _serve_command(args, argv)


def _version() -> str:
    """`tokenmeter --version`: the installed package's version, from its metadata."""
    try:
        return f"tokenmeter {importlib.metadata.version('tokenmeter')}"
    except importlib.metadata.PackageNotFoundError:
        return "tokenmeter (not installed: no package metadata)"


def _check_config(file: str, *, connect: bool = False) -> int:
    try:
        cfg = load_config(file)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    from proxy.server import preflight

    found = preflight.warnings(cfg)
    if (warning := exposure_warning(Path(file))) is not None:
        found.insert(0, warning)
    for warning in found:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"{file}: OK" + (f" with {len(found)} warnings" if found else "")
          + f" ({len(cfg.upstreams)} upstreams, {len(cfg.models)} model routes)")
    print(preflight.summary(cfg))
    if not connect:
        return 0
    reached = asyncio.run(preflight.reach(cfg))
    for r in reached:
        print(f"  {r.field} ({r.location}): " + ("reachable" if r.error is None
                                                 else f"UNREACHABLE: {r.error}"))
    if not reached:
        print("  --connect: no Redis or PostgreSQL server configured")
    return 1 if any(r.error is not None for r in reached) else 0


def _serve_command(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """`serve` or `demo`: in this process, or (serve --workers N) as the supervisor of N."""
    try:
        config = _resolve_config(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    inherited = inherited_sockets()
    if inherited is None and args.command == "serve":
        setting = args.workers or (config.server.workers if config is not None else 1)
        workers = resolve_workers(setting)
        if workers > 1:
            if config is not None and (problem := budget_sharing_problem(config, workers)):
                print(problem, file=sys.stderr)
                return 2
            try:
                return supervise(sys.argv[1:] if argv is None else list(argv), config, workers,
                                 args.host, args.port)
            except OSError as exc:
                print(f"cannot listen: {exc}", file=sys.stderr)
                return 1
    # Serving: its lines by the loop, no lock (accesslog).
    install_access_handler(sys.stderr, args.log_format)
    options = _ServeOptions(
        host=args.host, port=args.port, demo=args.command == "demo",
        once=getattr(args, "once", False),
        config_path=Path(args.config) if args.config else None, inherited=inherited,
    )
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=_loop_factory()) as r:
        r.run(_serve(config, options))
    return 0


def _replay_upstream(args: argparse.Namespace) -> int:
    from proxy.testing.replay import ReplayFileError, load_recordings, run_replay

    try:
        recordings = load_recordings(Path(args.replay))
    except ReplayFileError as exc:
        print(f"{args.replay}: {exc}", file=sys.stderr)
        return 2
    run_replay(recordings, args.speed, args.host, args.port)
    return 0


def _speed_arg(text: str) -> float:
    try:
        speed = float(text)
    except ValueError:
        speed = math.nan
    if not (math.isfinite(speed) and speed >= 0):
        raise argparse.ArgumentTypeError(f"not a speed (a number, 0 or more): {text!r}")
    return speed


def _workers_arg(text: str) -> int | Literal["auto"]:
    try:
        return parse_workers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    raise SystemExit(main())
