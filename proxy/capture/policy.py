"""Whether a request is captured: one pure decision, from the `capture:` section, who asked,
the model and how the request ended. Never-capture (a user's or a key's `capture: false`)
wins over everything; a failed request is kept as `errors` says; any other request is kept
with probability `sample`."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from proxy.config.capture import CaptureConfig, CaptureErrors


@dataclass(frozen=True, slots=True)
class Subject:
    """What the decision reads of one request."""

    user: str
    key_name: str | None
    team: str | None
    model: str  # the model the client asked for
    failed: bool  # its error class is not `none`
    allowed: bool = True  # False: the user or the key is marked never-capture


def _selected(cfg: CaptureConfig, subject: Subject) -> bool:
    """The filters: each one set must name the request's user, key, team or model."""
    if cfg.users is not None and subject.user not in cfg.users:
        return False
    if cfg.keys is not None and subject.key_name not in cfg.keys:
        return False
    if cfg.teams is not None and subject.team not in cfg.teams:
        return False
    return cfg.models is None or any(fnmatch.fnmatchcase(subject.model, glob)
                                     for glob in cfg.models)


def wanted(cfg: CaptureConfig, subject: Subject, draw: float) -> bool:
    """`draw`: a uniform number in [0, 1) drawn for this request (the caller's random source,
    so a test can fix it)."""
    if not cfg.enabled or not subject.allowed or not _selected(cfg, subject):
        return False
    if subject.failed and cfg.errors is not CaptureErrors.SAMPLED:
        return cfg.errors is CaptureErrors.ALWAYS
    return draw < cfg.sample
