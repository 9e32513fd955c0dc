"""The tag rules (`tags:`) and the one reading of a client's tags: what is kept, what is dropped
and why, the bounds applied before anything is split, and default tags checked at load."""

from __future__ import annotations

import random
import string

import pytest
from pydantic import ValidationError

from proxy.config.load import Config
from proxy.config.policy import Price
from proxy.config.tags import (
    MAX_HEADER_CHARS,
    MAX_TAGS,
    NO_TAGS,
    TagDrop,
    TagRule,
    TagRules,
    Tags,
)
from proxy.cost import CostLines
from proxy.errors import ErrorClass
from proxy.protocol.usage import Usage
from proxy.record import Figures, RequestRecord
from proxy.telemetry.metrics import Metrics

RULES = TagRules({"feature": TagRule(values=["faq", "search"]),
                  "env": TagRule(values=["prod"]),
                  "customer": TagRule(free=True, max_length=8)})


def test_header_kept_and_dropped() -> None:
    read = RULES.header(" feature=faq , env=dev,customer=acme,colour=red,junk,customer2=")
    assert _pairs(read.tags) == {"customer": "acme", "feature": "faq"}
    assert read.tags.json() == '{"customer":"acme","feature":"faq"}'
    assert sorted(read.dropped) == sorted([TagDrop.NOT_LISTED, TagDrop.UNDECLARED,
                                           TagDrop.UNDECLARED, TagDrop.UNDECLARED])
    assert [t.key for t in read.tags.closed] == ["feature"]


def test_free_values_are_bounded_and_plain() -> None:
    read = RULES.header("customer=abcdefghi")
    assert read.tags is not None and not read.tags.items
    assert read.dropped == (TagDrop.TOO_LONG,)
    assert RULES.metadata({"metadata": {"customer": "a\x1bb"}}).dropped == (TagDrop.MALFORMED,)
    assert RULES.metadata({"metadata": {"customer": 7}}).dropped == (TagDrop.MALFORMED,)
    # A header's undecodable bytes (aiohttp keeps them as lone surrogates): PostgreSQL's
    # jsonb refuses their escapes, so they never reach the books.
    assert RULES.header("customer=a\udcffb").dropped == (TagDrop.MALFORMED,)
    assert RULES.metadata({"metadata": {"customer": "a\x00"}}).dropped == (TagDrop.MALFORMED,)
    assert RULES.metadata({"metadata": "text"}).tags == NO_TAGS


def test_bounded_before_split() -> None:
    long = "feature=faq," * (MAX_HEADER_CHARS // 12 + 1)
    assert RULES.header(long).dropped == (TagDrop.HEADER_TOO_LONG,)
    many = ",".join(f"k{i}=v" for i in range(MAX_TAGS * 3))
    read = RULES.header(many)
    assert read.dropped.count(TagDrop.TOO_MANY) == 1
    assert len(read.dropped) == MAX_TAGS + 1
    # Metadata is looked up by the declared keys: its other keys are the upstream's business.
    meta = {"metadata": {**{f"k{i}": "v" for i in range(1000)}, "feature": "faq"}}
    read = RULES.metadata(meta)
    assert _pairs(read.tags) == {"feature": "faq"} and read.dropped == ()
    assert RULES.header("feature=faq,,env=prod,").dropped == ()


def test_later_sources_win_per_key() -> None:
    defaults = RULES.defaults({"feature": "search", "customer": "acme"}, {"env": "prod"})
    request = RULES.header("feature=faq").tags
    assert _pairs(request.over(defaults)) == {"customer": "acme", "env": "prod",
                                              "feature": "faq"}


def _config(**tags: object) -> Config:
    return Config.model_validate({
        "upstreams": {"u": {"base_url": "http://127.0.0.1:9/v1"}},
        "tags": {"feature": {"values": ["faq"]}},
        "users": {"alice": {"keys": ["sk-alice-0123456789"], **tags}},
    })


def test_default_tags_are_checked_at_load() -> None:
    assert _config(tags={"feature": "faq"}).users["alice"].tags == {"feature": "faq"}
    with pytest.raises(ValidationError, match=r"users.alice.tags.feature.*not_listed"):
        _config(tags={"feature": "other"})
    with pytest.raises(ValidationError, match="either"):
        TagRule(values=["a"], free=True)
    with pytest.raises(ValidationError, match="lower-case word"):
        Config.model_validate({"upstreams": {"u": {"base_url": "http://127.0.0.1:9/v1"}},
                               "tags": {"Bad Key": {"free": True}}})


def record(tags: Tags) -> RequestRecord:
    """A finished, priced chat request with `tags`."""
    usage = Usage(10, 5, 0, 0, "reported")
    return RequestRecord(
        request_id="r", operation="chat", requested_model="m", sent_model="m",
        model_label="m", upstream="u", user="alice", key=None, team=None, status=200,
        error_class=ErrorClass.NONE, stream=False, usage=usage,
        figures=Figures(duration=0.1, overhead=None, ttft=None, upstream_ttft=None,
                        time_per_output_token=None, output_tokens_per_second=None,
                        content_chunks=1, mean_inter_chunk=None),
        fallback_from=None, response_model=None, attempts=1,
        cost=CostLines.of(Price(input=1.0, output=2.0), usage), price_version="p",
        windows="", ended_at=1.0, tags=tags)


def test_random_free_values_add_no_series() -> None:
    """10,000 requests, each with a fresh random free value: the tag families hold the
    closed-list series only, and no free value appears anywhere in /metrics."""
    metrics = Metrics()
    rng = random.Random(24)
    values = set()
    for _ in range(10_000):
        value = "".join(rng.choices(string.ascii_letters, k=8))
        values.add(value)
        tags = RULES.header(f"customer={value},feature=faq").tags
        metrics.record_request(record(tags=tags), [])
    text = metrics.exposition().decode()
    tag_series = [line for line in text.splitlines()
                  if line.startswith("tokenmeter_tag_") and not line.startswith("#")]
    assert tag_series, "the closed-list tag is a label"
    assert all('tag="feature"' in line and 'value="faq"' in line for line in tag_series)
    # input, output and the cost (each with its _created): per type, not per value.
    assert len(tag_series) == 6
    assert not any(v in text for v in values)


def _pairs(tags: Tags) -> dict[str, str]:
    return {t.key: t.value for t in tags.items}
