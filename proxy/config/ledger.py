"""Configuration of the books: where each request's ledger row goes, and for how long."""

from __future__ import annotations

from pydantic import Field, field_validator

from proxy.config.policy import ConfigModel
from proxy.storage.urls import Dialect, dialect_of


class LedgerConfig(ConfigModel):
    # Off: no rows are kept (metrics and the access log still see every request).
    enabled: bool = True
    # None: an SQLite file, `ledger.sqlite3`, in the state directory (printed at start); or
    # `sqlite:///absolute/path.sqlite3`; or `postgresql://user@host:5432/db` for replicas sharing
    # one ledger.
    url: str | None = None
    # Where rows wait between settle and the database (one append per request). Default: the
    # state directory ($TOKENMETER_STATE_DIR, else $XDG_STATE_HOME/tokenmeter).
    spool_dir: str | None = None
    # Rows not yet shipped may take this much disk; past it, new rows are dropped, loudly
    # (tokenmeter_ledger_rows_dropped_total, an error log): a full disk must not stop serving.
    spool_max_mb: float = Field(default=1024.0, gt=0)
    # Rows per database write. A shipper that is behind writes batches back to back; once caught
    # up, at most one batch every 250 ms (a row is in the database within about that).
    batch_rows: int = Field(default=2000, ge=1, le=100_000)
    # Rows older than this are deleted, a bounded slice at a time (writers never wait on it).
    retention_days: int = Field(default=400, ge=1)
    # The proxy compares its ledger with the store's counters this often and exports the
    # difference (tokenmeter_reconcile_drift_tokens, tokenmeter_reconcile_orphans); 0: never.
    reconcile_every_s: float = Field(default=300.0, ge=0)
    # Names this process in every row. Default: the host name and the process id.
    replica_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:@-]{1,128}$")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and dialect_of(v) is None:
            raise ValueError(
                "must be sqlite:///<path> or postgresql://... (or leave it out for an SQLite "
                "file in the state directory)"
            )
        return v

    @property
    def dialect(self) -> Dialect:
        """Of `url`, validated; no URL: the SQLite file in the state directory."""
        return Dialect.SQLITE if self.url is None else dialect_of(self.url) or Dialect.SQLITE
