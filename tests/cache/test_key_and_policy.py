"""The cache key (what decides an answer, nothing else) and the rule a request gets from the
`cache:` section and its overrides."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.budget.limits import unlimited
from proxy.budget.principal import Principal
from proxy.cache.cache import directives
from proxy.cache.key import cache_key
from proxy.cache.policy import rule_for, samples, scope_id
from proxy.config.cache import CacheConfig, CacheScope
from proxy.config.policy import Limits

BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "temperature": 0, "max_tokens": 10}


def _principal(user: str = "alice", key_id: str = "abc123", key_name: str | None = None,
               team: str | None = None) -> Principal:
    return Principal(user, unlimited(Limits()), key_id=key_id, key_name=key_name, team=team)


def test_delivery_fields_do_not_change_the_key_and_content_fields_do() -> None:
    base = cache_key("chat", "m", "up", BODY, "user:alice")
    delivered = {**BODY, "stream": True, "stream_options": {"include_usage": True},
                 "user": "u1", "metadata": {"a": 1}}
    assert cache_key("chat", "m", "up", delivered, "user:alice") == base
    reordered = dict(reversed(list(BODY.items())))
    assert cache_key("chat", "m", "up", reordered, "user:alice") == base
    changes: list[dict[str, Any]] = [
        {"max_tokens": 11}, {"temperature": 0.0001}, {"seed": 1}, {"stop": ["x"]},
        {"tools": []}, {"response_format": {"type": "json_object"}},
        {"messages": [{"role": "user", "content": "hi!"}]},
    ]
    for change in changes:
        assert cache_key("chat", "m", "up", {**BODY, **change}, "user:alice") != base, change
    assert cache_key("messages", "m", "up", BODY, "user:alice") != base
    assert cache_key("chat", "m2", "up", BODY, "user:alice") != base
    assert cache_key("chat", "m", "up", BODY, "user:bob") != base
    assert cache_key("chat", "m", "other", BODY, "user:alice") != base  # routed elsewhere


def test_scope_ids() -> None:
    p = _principal(team="t")
    assert scope_id(CacheScope.KEY, p) == "key:abc123"
    assert scope_id(CacheScope.USER, p) == "user:alice"
    assert scope_id(CacheScope.TEAM, p) == "team:t"
    assert scope_id(CacheScope.TEAM, _principal()) == "user:alice"  # no team: their own
    assert scope_id(CacheScope.GLOBAL, p) == "global"


@pytest.mark.parametrize(("body", "sampled"), [
    ({}, True),  # the APIs' default temperature is 1
    ({"temperature": 0}, False),
    ({"temperature": 0.2}, True),
    ({"temperature": 0, "n": 2}, True),
    ({"temperature": 0, "n": 1}, False),
    ({"temperature": "0"}, True),
])
def test_sampling(body: dict[str, Any], sampled: bool) -> None:
    assert samples(body) is sampled


def test_overrides_field_by_field_key_over_user_over_team_over_route() -> None:
    config = CacheConfig.model_validate({
        "enabled": False, "ttl_s": 100, "scope": "user", "models": ["gpt-*", "claude-*"],
        "routes": {"gpt-4o*": {"enabled": True, "ttl_s": 50, "scope": "global"}},
        "teams": {"t": {"ttl_s": 40}},
        "users": {"alice": {"scope": "team", "max_entry_kb": 8}},
        "keys": {"ci": {"scope": "key"}, "abc123": {"cache_sampled": True}},
    })
    rule = rule_for(config, _principal(team="t"), "gpt-4o-mini")
    assert (rule.enabled, rule.ttl_s, rule.scope, rule.max_entry_bytes, rule.cache_sampled) == \
        (True, 40.0, CacheScope.TEAM, 8 * 1024, True)
    named = rule_for(config, _principal(key_name="ci", team="t"), "gpt-4o")
    assert named.scope is CacheScope.KEY and not named.cache_sampled
    assert not rule_for(config, _principal(), "gpt-3.5").enabled  # no route turns it on
    other = CacheConfig.model_validate({"enabled": True, "models": ["gpt-*"]})
    assert not rule_for(other, _principal(), "claude-3").enabled  # not in `models`
    assert rule_for(other, _principal(), "gpt-4").enabled


def test_cache_control_directives() -> None:
    assert directives("no-cache") == {"no-cache"}
    assert directives("No-Store, max-age=0") == {"no-store", "max-age"}
    assert directives("") == frozenset()


def test_bad_redact_pattern_and_bad_names_are_refused() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        CacheConfig.model_validate({"redact": ["("]})
    with pytest.raises(ValueError, match="must match"):
        CacheConfig.model_validate({"users": {"bad name": {}}})
    with pytest.raises(ValueError):
        CacheConfig.model_validate({"scope": "everyone"})
