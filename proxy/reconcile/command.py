"""`tokenmeter reconcile`: the command. How a reading is made and judged is
`proxy.reconcile.plan`'s (its docstring says what may legitimately differ, and why);
what it prints, `proxy.reconcile.render`'s."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import date, datetime
from zoneinfo import ZoneInfo

from proxy.budget.store import StoreError
from proxy.budget.store_redis import RedisStore
from proxy.config.load import ConfigError, load_config
from proxy.ledger.query import LedgerUnavailable, locate, open_reader
from proxy.reconcile.plan import Reconciliation, reconcile
from proxy.reconcile.render import reconciliation_json, redact, render_table

_HELP = """\
Compare the ledger's totals with the budget store's counters, per user, key, model group and
team, for every calendar window (day, week, month; tokens and cost) a day is in, and list the
reservations held past their lease (orphans).

A row counts towards the windows its settle charged (the ledger's `windows` column). The
ledger is read first, then the store: what the store settled is its counter less what
reservations (requests in flight, orphans) hold in it. Books above that are drift (the budgets
under-count). A store above the books is rows on their way to the ledger ("on its way"): after
--recheck seconds the rows that ended by the first reading must reach what the store had
settled then, else it is drift. --recheck 0 judges one reading alone.

The ledger's side is read from its hourly windows rollup, which the shipper keeps with every
row it writes (the in-process reconcile and its drift alert read it so, every minute). A row
deleted or changed by hand in the database leaves the rollup as it was: --deep sums the rows
themselves instead (a scan of the weeks and month around the day), and reports that as drift.

Exit status: 0 agree (orphans are listed, they do not fail the run), 1 drift, 2 could not
reconcile (configuration, store or ledger unreadable).
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("reconcile", help="compare the ledger's totals with the store's counters",
                       description=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--config", required=True, help="YAML configuration (its store and ledger)")
    r.add_argument("--date", help="YYYY-MM-DD in the configured time zone (default: today)")
    r.add_argument("--ledger", metavar="URL",
                   help="read this ledger instead of the configuration's")
    r.add_argument("--recheck", type=float, default=3.0, metavar="SECONDS",
                   help="wait before reading a difference again (default 3; 0: one reading)")
    r.add_argument("--deep", action="store_true",
                   help="sum the ledger's rows rather than its rollup: slower, and catches rows "
                        "deleted or changed by hand (which the rollup does not see)")
    r.add_argument("--json", action="store_true", help="JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        tz = ZoneInfo(config.timezone)
        day = (date.fromisoformat(args.date) if args.date
               else datetime.now(tz).date())
        if config.store.url == "memory":
            raise ValueError("the in-process store lives inside the running proxy; reconcile "
                             "needs a Redis store")
        if not config.ledger.enabled and args.ledger is None:
            raise ValueError("the ledger is off in this configuration (ledger.enabled: false); "
                             "give --ledger URL to read one")
        location = locate(config.ledger, args.ledger)
    except (ConfigError, ValueError, LedgerUnavailable) as exc:
        print(exc, file=sys.stderr)
        return 2

    async def go() -> Reconciliation:
        store = RedisStore(config.store.url, max(config.store.timeout_ms, 2000))
        try:
            async with await open_reader(location, rollups=not args.deep) as reader:
                first = await reconcile(config, store, reader, day)
                if args.recheck <= 0:
                    return first.single()
                if first.agrees and not first.behind:
                    return first
                await asyncio.sleep(args.recheck)  # rows on their way get the time to land
                return await reconcile(config, store, reader, day, earlier=first)
        finally:
            await store.close()

    try:
        result = asyncio.run(go())
    except StoreError as exc:
        print(f"cannot read the store: {exc}", file=sys.stderr)
        return 2
    except LedgerUnavailable as exc:
        print(f"cannot read the ledger: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(reconciliation_json(result), indent=2))
    else:
        caption = (f"reconcile {day.isoformat()} ({config.timezone}): ledger "
                   f"{location.describe()}{' (its rows: --deep)' if args.deep else ''} "
                   f"against store {redact(config.store.url)}")
        print(render_table(result, caption))
    return 0 if result.agrees else 1
