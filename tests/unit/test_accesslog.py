"""The access log line: the same bytes as json.dumps of its fields, for any record."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from proxy.protocol.usage import Usage
from proxy.telemetry.accesslog import request_fields, request_line
from proxy.telemetry.meter import Figures
from proxy.telemetry.metrics import RequestRecord

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
        draw(st.text("0123456789abcdef", min_size=32, max_size=32)), "chat", draw(_text),
        draw(_text), draw(_text), draw(_text), draw(st.none() | _text),
        draw(st.integers(100, 599)), draw(st.sampled_from(["none", "upstream_timeout"])),
        draw(st.booleans()), usage, figures, draw(st.none() | _text), draw(st.none() | _text),
        draw(st.integers(1, 9)),
    )


@given(_records())
def test_the_line_is_json_dumps_of_the_fields(rec: RequestRecord) -> None:
    assert request_line(rec) == json.dumps(request_fields(rec), separators=(",", ":"))
