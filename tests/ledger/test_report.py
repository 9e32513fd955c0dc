"""`proxy.ledger.report_plan.Report` (and `proxy.reconcile.plan.Reconciliation`) as the
commands get them from `asyncio.run`: Python 3.11's runner formats a repr of its main task,
result included, when it restores the SIGINT handler. A report's groups are not in its repr, so a year of groups costs
the command nothing there (60,000 groups were 0.65 s of every `tokenmeter usage`)."""

from __future__ import annotations

from datetime import UTC, date, datetime
from zoneinfo import ZoneInfo

import pytest

from proxy.ledger.report_plan import GroupKey, Report, ReportPeriod, Totals
from proxy.reconcile.plan import Reconciliation


def _report(groups: int) -> Report:
    rows = tuple(((f"user-{i}", "2026-03-01"), Totals(requests=1, input_tokens=i))
                 for i in range(groups))
    period = ReportPeriod(ZoneInfo("UTC"), datetime(2026, 3, 1, tzinfo=UTC), None)
    return Report((GroupKey.USER, GroupKey.DAY), period, rows, Totals(requests=groups))


@pytest.mark.timeout(60)
def test_a_reports_repr_leaves_its_groups_out() -> None:
    large = repr(_report(100_000))
    assert len(large) < 2000 and large.count("Totals(") == 1  # the totals alone
    assert "totals=Totals(requests=100000" in large


@pytest.mark.timeout(60)
def test_a_reconciliations_repr_leaves_its_windows_out() -> None:
    r = Reconciliation(date(2026, 3, 1), "UTC", 0.0, checks=(), orphans=(), ledger_newest=None)
    assert "checks" not in repr(r) and "orphans" not in repr(r)
