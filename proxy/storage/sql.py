"""A statement written once for both SQL dialects: `Sql` gives the placeholders and the
timestamp parameters of the dialect it writes for (PostgreSQL keeps `timestamptz`, SQLite epoch
seconds). The ledger's reports, reconcile and the capture store write their queries with it."""

from __future__ import annotations

from datetime import UTC, datetime

from proxy.storage.urls import Dialect


class Sql:
    """One statement's parameters, collected as its text is written: `p(v)` and `ts(epoch)`
    return the placeholder to put in the text."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self.params: list[object] = []

    def p(self, value: object) -> str:
        self.params.append(value)
        return "?" if self.dialect is Dialect.SQLITE else f"${len(self.params)}"

    def ts(self, epoch: float) -> str:
        """A point in time, as the dialect stores `started_at` and `ended_at`."""
        if self.dialect is Dialect.SQLITE:
            return self.p(float(epoch))
        return self.p(datetime.fromtimestamp(epoch, UTC))
