"""`tokenmeter reconcile`: the ledger's totals against the store's counters (being built)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("reconcile", help="compare the ledger's totals with the store's counters")
    r.add_argument("--config", required=True)
    r.add_argument("--date", help="YYYY-MM-DD in the configured time zone (default: today)")


def run(args: argparse.Namespace) -> int:
    print("reconcile is not built yet", file=sys.stderr)
    return 2
