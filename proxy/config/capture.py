"""Configuration of capture: which requests are kept whole (request, upstream request, answer),
redacted how, where, and for how long. Off by default; kept apart from the ledger's rows."""

from __future__ import annotations

import enum
import re

from pydantic import Field, field_validator

from proxy.config.policy import ConfigModel
from proxy.storage.urls import dialect_of


class CaptureErrors(enum.StrEnum):
    """Whether a request that ended in an error class other than `none` is kept."""

    ALWAYS = "always"  # every failed request, whatever `sample` says
    SAMPLED = "sampled"  # like any other request
    NEVER = "never"


# What is removed from every text before it is written, unless `redact` replaces the list:
# API keys of the usual shapes, bearer tokens and e-mail addresses.
DEFAULT_REDACT = (
    r"sk-(?:ant-|proj-)?[A-Za-z0-9_-]{16,}",
    r"(?i)bearer\s+[A-Za-z0-9._~+/=-]{8,}",
    r"AKIA[0-9A-Z]{16}",
    # Bounded as addresses are (64 characters before the `@`, 253 after): unbounded, a long
    # run of these characters with no `@` (a base64 image) is tried from every position, a
    # quadratic time (a 256 KiB body took ~48 s); bounded, each try looks at most that far.
    r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9.-]{1,253}\.[A-Za-z]{2,}",
)


class CaptureConfig(ConfigModel):
    enabled: bool = False
    sample: float = Field(default=0.0, ge=0.0, le=1.0)  # fraction of requests kept
    errors: CaptureErrors = CaptureErrors.ALWAYS
    # Only requests of these (each: None = any): user names, key names, team names, model globs.
    users: list[str] | None = None
    keys: list[str] | None = None
    teams: list[str] | None = None
    models: list[str] | None = None
    max_body_kb: int = Field(default=256, ge=1, le=64 * 1024)  # longer: truncated, marked
    retention_days: int = Field(default=7, ge=1)
    redact: list[str] = Field(default_factory=lambda: list(DEFAULT_REDACT))
    # None: a table beside the ledger's, in the ledger's database; or its own database.
    url: str | None = None
    # Captures waiting to be written; past it, new ones are dropped and counted.
    queue_max: int = Field(default=1000, ge=1, le=1_000_000)

    @field_validator("redact")
    @classmethod
    def _compiles(cls, v: list[str]) -> list[str]:
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"redact pattern {pattern!r} does not compile: {exc}") from None
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and dialect_of(v) is None:
            raise ValueError("must be sqlite:///<path> or postgresql://... (or leave it out for "
                             "the ledger's database)")
        return v
