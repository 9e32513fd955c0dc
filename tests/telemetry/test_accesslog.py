"""The access log line: the same bytes as json.dumps of its fields, for any record; it and the
ledger row are projections of one record, so they agree on what both say."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.config.policy import Price
from proxy.cost import CostLines
from proxy.errors import ErrorClass
from proxy.ledger.row import LedgerRow
from proxy.protocol.usage import Usage
from proxy.record import CacheResult, Figures, RequestRecord
from proxy.telemetry.accesslog import request_line

pytestmark = pytest.mark.unit

_text = st.text(max_size=300)  # quotes, backslashes, control and non-ASCII characters
_opt_time = st.none() | st.floats(0, 1e4, allow_nan=False)


@st.composite
def _records(draw: st.DrawFn) -> RequestRecord:
    figures = Figures(
        duration=draw(st.floats(0, 1e4, allow_nan=False)), overhead=draw(_opt_time),
        ttft=draw(_opt_time), upstream_ttft=draw(_opt_time),
        time_per_output_token=draw(_opt_time), output_tokens_per_second=draw(_opt_time),
        content_chunks=draw(st.integers(0, 10**6)), mean_inter_chunk=draw(_opt_time),
    )
    counts = st.integers(0, 10**9)
    usage = Usage(draw(counts), draw(counts), draw(counts), draw(counts),
                  draw(st.sampled_from(["reported", "estimated"])))
    return RequestRecord(
        request_id=draw(st.text("0123456789abcdef", min_size=32, max_size=32)),
        operation="chat", requested_model=draw(_text), sent_model=draw(st.none() | _text),
        model_label=draw(_text), upstream=draw(st.none() | _text), user=draw(_text),
        key=draw(st.none() | _text), team=draw(st.none() | _text),
        status=draw(st.integers(100, 599)),
        error_class=draw(st.sampled_from([ErrorClass.NONE, ErrorClass.UPSTREAM_TIMEOUT])),
        stream=draw(st.booleans()), usage=usage, figures=figures,
        fallback_from=draw(st.none() | _text), response_model=draw(st.none() | _text),
        attempts=draw(st.integers(1, 9)),
        cost=draw(st.none() | st.builds(
            CostLines.of,
            st.builds(Price, input=st.floats(0, 100), output=st.floats(0, 100)), st.just(usage))),
        price_version=draw(st.none() | st.just("p1")), windows=draw(st.just("") | _text),
        ended_at=draw(st.floats(0, 2e9, allow_nan=False)),
        cache=draw(st.sampled_from(list(CacheResult))),
        saved_usage=Usage(draw(counts), draw(counts), draw(counts), draw(counts)),
    )


@given(_records())
def test_the_line_is_json_dumps_of_the_fields(rec: RequestRecord) -> None:
    assert request_line(rec) == json.dumps(request_fields(rec), separators=(",", ":"))


@given(_records())
def test_the_line_and_the_row_agree(rec: RequestRecord) -> None:
    fields, row = request_fields(rec), LedgerRow.of(rec, "r1")
    assert (row.user_name, row.key_name, row.operation, row.status, row.error_class,
            row.stream, row.attempts, row.token_source) == (
        fields["user"], fields["key"], fields["operation"], fields["status"],
        fields["error_class"], fields["stream"], fields["attempts"], fields["token_source"])
    assert ("none" if row.upstream is None else row.upstream) == fields["upstream"]
    assert (row.requested_model if row.model is None else row.model)[:200] == fields["model"]
    assert row.input_tokens == fields["input_tokens"]
    assert row.output_tokens == fields["output_tokens"]
    assert row.cost_nanousd == (None if rec.cost is None else rec.cost.nanousd)
    assert row.cache == fields["cache"] == rec.cache
    assert (row.saved_input_tokens, row.saved_output_tokens) == (
        rec.saved_usage.input_tokens, rec.saved_usage.output_tokens)
    # started_at is ended_at less the duration: at 2e9 s a float is good to about 2e-7 s.
    assert row.ended_at - row.started_at == pytest.approx(rec.figures.duration, abs=1e-6)


def request_fields(rec: RequestRecord) -> dict[str, object]:
    """What the line says, as a dict: the specification `request_line` is held to."""
    u, f = rec.usage, rec.figures
    return {
        "event": "request",
        "request_id": rec.request_id,
        "operation": rec.operation,
        "user": rec.user,
        "key": rec.key,
        "model": rec.model[:200],
        "fallback_from": None if rec.fallback_from is None else rec.fallback_from[:200],
        "response_model": None if rec.response_model is None else rec.response_model[:200],
        "attempts": rec.attempts,
        "upstream": rec.upstream_label,
        "status": rec.status,
        "error_class": rec.error_class,
        "stream": rec.stream,
        "cache": rec.cache,
        "cache_reason": rec.cache_reason,
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cached_input_tokens": u.cached_input_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "total_tokens": u.total_tokens,
        "token_source": u.source,
        "ttft_ms": _ms(f.ttft),
        "upstream_ttft_ms": _ms(f.upstream_ttft),
        "overhead_ms": _ms(f.overhead),
        "duration_ms": _ms(f.duration),
        "tpot_ms": _ms(f.time_per_output_token),
        "tokens_per_second": (
            None if f.output_tokens_per_second is None else round(f.output_tokens_per_second, 1)
        ),
        "content_chunks": f.content_chunks,
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)
