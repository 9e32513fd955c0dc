"""The replay's file parsing and matcher (proxy/testing/replay.py), without a server."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from proxy.testing.replay import (
    RecordedEvent,
    Recordings,
    ReplayFileError,
    canonical,
    load_recordings,
    parse_line,
)

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]


def line(messages: Any = HELLO, path: str = CHAT, stream: Any = False, **response: Any) -> str:
    answer = {"status": 200, "body": {"id": "x"}, "events": [], **response}
    return json.dumps({"request_id": "r", "api": "openai", "path": path, "model": "m",
                       "messages": messages, "stream": stream, "request": {},
                       "response": answer})


def test_canonical_ignores_key_order_and_spacing() -> None:
    assert canonical([{"role": "user", "content": "é"}]) == canonical(
        json.loads('[ {"content" : "é", "role" : "user"} ]'))
    assert canonical(HELLO) == '[{"content":"hello","role":"user"}]'


def test_a_line_parses_to_its_answer() -> None:
    events = [{"at_ms": 0, "text": "data: {}"}, {"at_ms": 12.5, "text": "data: [DONE]"}]
    rec = parse_line(line(stream=True, body=None, events=events), 3)
    assert (rec.line, rec.path, rec.key, rec.stream, rec.status) == (3, CHAT, canonical(HELLO),
                                                                   True, 200)
    assert rec.events == (RecordedEvent(0.0, "data: {}"), RecordedEvent(12.5, "data: [DONE]"))
    assert rec.streamed
    # A stream request answered with an error body is replayed as that JSON answer.
    assert not parse_line(line(stream=True, status=429, body={"error": {}}), 1).streamed


@pytest.mark.parametrize(("text", "says"), [
    ("{not json", "line 7: "),
    ("[1, 2]", "a line must be a JSON object"),
    (line(messages="hello"), "messages must be a list"),
    (line(status=99), "response.status"),
    (line(status=True), "response.status"),
    (line(events=[{"at_ms": -1, "text": "data: x"}]), "at_ms"),
    (line(events=[{"at_ms": 1}]), "with a text"),
    (line(events={"at_ms": 1}), "response.events must be a list"),
    (line(stream="yes"), "stream must be"),
    (json.dumps({"path": CHAT, "messages": []}), "response must be an object"),
])
def test_a_bad_line_is_refused_with_its_number(text: str, says: str) -> None:
    with pytest.raises(ReplayFileError, match=r"^line 7: ") as caught:
        parse_line(text, 7)
    assert says in str(caught.value)


def test_a_line_of_another_route_is_kept_but_needs_no_messages() -> None:
    rec = parse_line(line(messages=None, path="/v1/responses"), 1)
    assert Recordings.of([rec]).find(CHAT, None, False) is None


def test_find_matches_messages_on_the_same_route_whatever_the_model() -> None:
    chat, other = parse_line(line(), 1), parse_line(line(messages=[{"role": "user"}]), 2)
    found = Recordings.of([chat, other])
    assert found.find(CHAT, json.loads('[{"content":"hello","role":"user"}]'), False) is chat
    assert found.find(CHAT, [{"role": "user"}], True) is other  # the only one: stream or not
    assert found.find(CHAT, [{"role": "user", "content": "hello!"}], False) is None
    assert found.find("/v1/messages", HELLO, False) is None


def test_find_prefers_the_same_stream_flag_then_the_first_recorded() -> None:
    first, streamed, second = (parse_line(line(), 1), parse_line(line(stream=True), 2),
                               parse_line(line(), 3))
    found = Recordings.of([first, streamed, second])
    assert found.find(CHAT, HELLO, True) is streamed
    assert found.find(CHAT, HELLO, False) is first


def test_load_skips_blank_lines_and_counts_them(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(f"{line()}\n\n{line(messages=[])}\n   \n{{oops\n")
    with caplog.at_level(logging.WARNING, logger="tokenmeter.replay"):
        assert [r.line for r in load_recordings(path).by_key[(CHAT, canonical(HELLO))]] == [1]
    assert f"{path}: line 5: " in caplog.text  # the bad line is named and skipped
    path.write_text(f"\n{line()}\n")
    assert load_recordings(path).find(CHAT, HELLO, False) is not None


def test_load_refuses_an_empty_or_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text("\n")
    with pytest.raises(ReplayFileError, match="no recorded request"):
        load_recordings(path)
    with pytest.raises(ReplayFileError, match="cannot read it"):
        load_recordings(tmp_path / "missing.jsonl")
