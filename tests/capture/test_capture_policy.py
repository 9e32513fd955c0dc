"""The capture decision: never-capture wins, the filters select, errors follow `errors`, the
rest is sampled."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.auth import UserIndex
from proxy.capture.policy import Subject, wanted
from proxy.config.callers import CallerIndex
from proxy.config.capture import CaptureConfig, CaptureErrors
from proxy.config.load import Config
from proxy.config.policy import Policy
from proxy.config.tags import TagRules
from proxy.identity import key_hash

pytestmark = pytest.mark.unit

ALICE = Subject(user="alice", key_name="laptop", team="eng", model="gpt-4o-mini", failed=False)


def _cfg(**fields: object) -> CaptureConfig:
    return CaptureConfig.model_validate({"enabled": True, **fields})


def test_off_by_default_and_nothing_kept_when_off() -> None:
    assert CaptureConfig().enabled is False
    assert Config.model_fields["capture"].default_factory is CaptureConfig
    assert not wanted(CaptureConfig(), ALICE, 0.0)
    assert not wanted(CaptureConfig(sample=1.0), ALICE, 0.0)  # sampled, but not enabled


def test_sampled_by_the_draw() -> None:
    cfg = _cfg(sample=0.25)
    assert wanted(cfg, ALICE, 0.0) and wanted(cfg, ALICE, 0.2499)
    assert not wanted(cfg, ALICE, 0.25) and not wanted(cfg, ALICE, 0.9)
    assert not wanted(_cfg(sample=0.0), ALICE, 0.0)
    assert wanted(_cfg(sample=1.0), ALICE, 0.999999)


@pytest.mark.parametrize(("errors", "kept"), [("always", True), ("never", False)])
def test_failed_requests_follow_errors_whatever_the_sample(errors: str, kept: bool) -> None:
    failed = replace(ALICE, failed=True)
    assert wanted(_cfg(sample=0.0, errors=errors), failed, 0.99) is kept
    assert wanted(_cfg(sample=1.0, errors=errors), failed, 0.0) is kept


def test_sampled_errors_are_sampled_like_the_rest() -> None:
    failed = replace(ALICE, failed=True)
    cfg = _cfg(sample=0.5, errors=CaptureErrors.SAMPLED)
    assert wanted(cfg, failed, 0.1) and not wanted(cfg, failed, 0.6)


def test_never_capture_wins_over_everything() -> None:
    marked = replace(ALICE, allowed=False, failed=True)
    assert not wanted(_cfg(sample=1.0, errors="always"), marked, 0.0)


@pytest.mark.parametrize(("filters", "kept"), [
    ({"users": ["alice"]}, True), ({"users": ["bob"]}, False),
    ({"keys": ["laptop"]}, True), ({"keys": ["ci"]}, False),
    ({"teams": ["eng"]}, True), ({"teams": ["ops"]}, False),
    ({"models": ["gpt-4o*"]}, True), ({"models": ["claude-*"]}, False),
    ({"users": ["alice"], "models": ["claude-*"]}, False),  # every filter set must select it
])
def test_filters_select_by_user_key_team_and_model(filters: dict[str, list[str]],
                                                   kept: bool) -> None:
    assert wanted(_cfg(sample=1.0, **filters), ALICE, 0.0) is kept
    failed = replace(ALICE, failed=True)
    assert wanted(_cfg(sample=0.0, errors="always", **filters), failed, 0.0) is kept


@given(st.floats(0, 1, exclude_max=True), st.floats(0, 1), st.booleans(), st.booleans())
def test_a_marked_or_disabled_request_is_never_kept(draw: float, sample: float, failed: bool,
                                                    enabled: bool) -> None:
    cfg = CaptureConfig(enabled=enabled, sample=sample)
    subject = replace(ALICE, failed=failed, allowed=False)
    assert not wanted(cfg, subject, draw)
    if not enabled:
        assert not wanted(cfg, replace(ALICE, failed=failed), draw)


def test_bad_redaction_patterns_are_refused_at_load() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        CaptureConfig(redact=["(unclosed"])



def test_never_capture_is_resolved_per_key_from_the_user_and_the_key() -> None:
    """A user's `capture: false` covers all its keys; a key's covers that key alone; a key
    that says nothing of capture gets no counters of its own for it."""
    keys = {name: f"sk-{name}-0123456789abcdef" for name in ("a1", "a2", "b1")}
    policy = Policy.model_validate({"users": {
        "alice": {"keys": [keys["a1"], {"key": keys["a2"], "name": "ci", "capture": False}]},
        "bob": {"keys": [keys["b1"]], "capture": False},
    }})
    by_hash = UserIndex(policy)._by_hash
    callers = CallerIndex(policy, TagRules({}))

    def capture(user: str, key: str) -> bool:
        return callers.of(user, by_hash[key_hash(keys[key])].key_id).capture

    assert capture("alice", "a1") is True
    assert capture("alice", "a2") is False
    assert by_hash[key_hash(keys["a2"])].limits.key_scope is None
    assert capture("bob", "b1") is False
    assert callers.of("alice", None).capture is True  # no key (open mode): never refused
