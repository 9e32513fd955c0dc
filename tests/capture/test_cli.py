"""`tokenmeter captures` run on a store the test wrote: list filters, show gives the capture
whole with the ledger's figures, export writes docs/capture.md's line. The CLI runs in-process
(tests.helpers.tokenmeter), and as a process of its own once, which must print the same."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import pytest

from proxy.bench.replay import load_replay
from proxy.bench.workload import Api
from proxy.capture.record import Body, Capture, StreamEvent
from proxy.capture.store import CaptureStore
from proxy.testing.replay import load_recordings
from tests.books import ledger_row, write_sqlite
from tests.capture.captures import capture
from tests.helpers import tokenmeter

T0 = 1_764_000_000.0  # 2025-11-24T16:00:00Z


def write(url: str, captures: Sequence[Capture]) -> None:
    async def go() -> None:
        store = await CaptureStore.open(url)
        try:
            await store.write(captures)
        finally:
            await store.close()

    asyncio.run(go())


def captures(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    with mock.patch.dict(os.environ, env or {}):
        return tokenmeter("captures", *args)


def test_captures_as_a_process_of_its_own_prints_the_same(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'c.sqlite3'}"
    write(url, [capture("a", T0, user="alice"), capture("b", T0 + 60, user="bob")])
    for args in (["list", "--url", url], ["show", "b", "--format", "json", "--url", url]):
        done = subprocess.run([sys.executable, "-m", "proxy.cli", "captures", *args],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        mine = captures(*args)
        assert (done.returncode, done.stdout, done.stderr) == (0, mine.stdout, mine.stderr)
    assert '"request_id": "b"' in done.stdout


def test_list_filters_in_json_and_shows_a_table(store_url: str) -> None:
    write(store_url, [
        capture("a", T0, user="alice"),
        capture("b", T0 + 3600, user="bob", model="gpt-4o", status=429,
                error_class="rate_limited"),
        capture("c", T0 + 86_400, user="alice\x1b[31m"),
    ])
    done = captures("list", "--url", store_url, "--format", "json")
    assert done.returncode == 0, done.stderr
    assert [r["request_id"] for r in json.loads(done.stdout)] == ["c", "b", "a"]
    for flags, expected in ((["--user", "bob"], ["b"]), (["--model", "gpt-4o"], ["b"]),
                            (["--status", "429"], ["b"]),
                            (["--error-class", "rate_limited"], ["b"]),
                            (["--from", "2025-11-24T16:30", "--to", "2025-11-24"], ["b"]),
                            (["--from", "2025-11-25"], ["c"])):
        done = captures("list", "--url", store_url, "--format", "json", *flags)
        assert done.returncode == 0, done.stderr
        assert [r["request_id"] for r in json.loads(done.stdout)] == expected, flags
    done = captures("list", "--url", store_url)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["started", "(UTC)", "request_id"]
    assert lines[2].split() == ["2025-11-24T17:00:00.000Z", "b", "bob", "gpt-4o", "429",
                                "rate_limited", "yes", lines[2].split()[-1]]
    assert "\x1b" not in done.stdout and "alice\\x1b[31m" in done.stdout
    assert lines[-1] == "(3 captures)"


def test_show_json_holds_the_capture_and_the_ledgers_figures(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite3"
    write_sqlite(db, [ledger_row("r1", T0, input_tokens=42, output_tokens=7, ttft_ms=33.0,
                                 cost_nanousd=1_500_000)])
    url = f"sqlite://{db}"
    write(url, [capture("r1", T0), capture("r2", T0, stream=False, events=(),
                                           output_text=None, response=Body('{"id": 1}', 9))])
    done = captures("show", "r1", "--format", "json", "--url", url, "--ledger", url)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["request"]["text"].startswith('{"model": "gpt-4o-mini"')
    assert shown["upstream_request"] == shown["request"]
    assert shown["stream_text"] == "hello r1" and shown["events"][0]["at_ms"] == 12.5
    ledger = shown["ledger"]
    assert (ledger["input_tokens"], ledger["output_tokens"], ledger["ttft_ms"]) == (42, 7, 33.0)
    assert ledger["cost_usd"] == "0.001500000" and ledger["cache"] == "none"
    done = captures("show", "r2", "--format", "json", "--url", url, "--ledger", url)
    shown = json.loads(done.stdout)
    assert shown["response"]["text"] == '{"id": 1}' and shown["ledger"] is None
    assert "stream_text" not in shown


def test_show_puts_the_ledgers_cache_field_and_exact_cost_beside_a_cache_hit(
        tmp_path: Path) -> None:
    """A cache hit's capture holds the answer's usage while its ledger row charges 0 tokens:
    both formats say `cache: hit` (and what the stored answer used); the text format prints
    the ledger's figures; cost_usd is the exact nano-dollar decimal, never a binary float."""
    db = tmp_path / "ledger.sqlite3"
    write_sqlite(db, [
        ledger_row("hit", T0, input_tokens=0, output_tokens=0, cost_nanousd=0, ttft_ms=1.5,
                   token_source="none", cache="hit", saved_input_tokens=40,
                   saved_output_tokens=300, saved_cost_nanousd=3),
        ledger_row("big", T0, input_tokens=42, output_tokens=7, ttft_ms=33.0,
                   cost_nanousd=123_456_789_012_345_678),
    ])
    url = f"sqlite://{db}"
    write(url, [capture("hit", T0), capture("big", T0)])
    done = captures("show", "hit", "--format", "json", "--url", url, "--ledger", url)
    assert done.returncode == 0, done.stderr
    ledger = json.loads(done.stdout)["ledger"]
    assert (ledger["cache"], ledger["cost_usd"], ledger["saved_output_tokens"],
            ledger["saved_cost_usd"]) == ("hit", "0.000000000", 300, "0.000000003")
    done = captures("show", "big", "--format", "json", "--url", url, "--ledger", url)
    assert json.loads(done.stdout)["ledger"]["cost_usd"] == "123456789.012345678"
    done = captures("show", "hit", "--url", url, "--ledger", url)
    assert done.returncode == 0, done.stderr
    block = done.stdout[done.stdout.index("--- ledger"):].splitlines()
    assert block[1].split() == ["tokens", "input", "0", "(cached", "0,", "cache", "writes",
                                "0),", "output", "0", "(reasoning", "0),", "none"]
    assert block[2].split()[:3] == ["timing", "ttft", "1.5"]
    assert block[3].split() == ["cost_usd", "0.000000000"]
    assert block[4].split() == ["cache", "hit"]
    assert "output 300 (cost_usd 0.000000003" in block[5]
    done = captures("show", "big", "--url", url, "--ledger", url)
    assert "cost_usd     123456789.012345678\ncache        none" in done.stdout


def test_show_text_and_a_missing_request(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'c.sqlite3'}"
    write(url, [capture("r1", T0, events=(StreamEvent(1.0, "data: \x1b[2J"),),
                        events_truncated=True)])
    done = captures("show", "r1", "--url", url)
    assert done.returncode == 0, done.stderr
    assert "request_id   r1" in done.stdout and "--- events (1, truncated)" in done.stdout
    assert "\x1b" not in done.stdout and "--- output\nhello r1" in done.stdout
    done = captures("show", "nope", "--url", url)
    assert done.returncode == 1 and "no capture of request 'nope'" in done.stderr


def test_export_writes_the_documented_line_oldest_first(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'c.sqlite3'}"
    anthropic = ('{"model": "claude", "system": "be brief", "max_tokens": 100, '
                 '"messages": [{"role": "user", "content": "hey"}]}')
    write(url, [
        capture("s", T0),
        capture("j", T0 + 1, api="anthropic", path="/v1/messages", stream=False, events=(),
                output_text=None, request=Body(anthropic, len(anthropic)),
                response=Body('{"content": []}', 15)),
        capture("cut", T0 + 2, request=Body('{"messages": [', 5000, truncated=True)),
    ])
    done = captures("export", "--format", "jsonl", "--url", url)
    assert done.returncode == 0, done.stderr
    s, j = (json.loads(line) for line in done.stdout.splitlines())
    assert s == {
        "request_id": "s", "api": "openai", "path": "/v1/chat/completions",
        "model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi s"}],
        "max_tokens": 64, "stream": True, "request": json.loads(capture("s", T0).request.text),
        "response": {"status": 200, "body": None,
                     "events": [{"at_ms": 12.5,
                                 "text": 'data: {"choices":[{"delta":{"content":"hel"}}]}'},
                                {"at_ms": 20.0, "text": "data: [DONE]"}],
                     "output_text": "hello s"},
    }
    assert j["messages"] == [{"role": "user", "content": "hey"}] and j["max_tokens"] == 100
    assert j["request"]["system"] == "be brief" and j["stream"] is False
    assert j["response"]["body"] == {"content": []} and j["response"]["events"] == []
    assert "1 captures left out" in done.stderr
    # The line is what mock-upstream --replay reads (proxy/testing/replay.py).
    exported = tmp_path / "export.jsonl"
    exported.write_text(done.stdout)
    recordings = load_recordings(exported)
    found = recordings.find("/v1/chat/completions", s["messages"], stream=True)
    assert found is not None and found.stream
    assert recordings.find("/v1/messages", j["messages"], stream=False) is not None


def test_the_default_store_is_the_ledgers_file_in_the_state_directory(tmp_path: Path) -> None:
    write(f"sqlite://{tmp_path / 'ledger.sqlite3'}", [capture("r1", T0)])
    done = captures("list", "--format", "json", env={"TOKENMETER_STATE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert [r["request_id"] for r in json.loads(done.stdout)] == ["r1"]


def test_a_bad_url_is_a_usage_error() -> None:
    done = captures("list", "--url", "mysql://x")
    assert done.returncode == 2 and "sqlite:///<path> or postgresql://" in done.stderr
    done = captures("list", "--url", "sqlite:///x.db", "--limit", "0")
    assert done.returncode == 2 and "--limit must be at least 1" in done.stderr


def test_an_export_holding_unicode_line_breaks_replays_and_a_bad_line_is_skipped_by_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """U+2028, U+2029 and U+0085 in a prompt and an answer: the export escapes them, both
    replays (mock-upstream's and the bench's) read the file line by line on `\\n` alone, and a
    line that is not a capture is skipped with a warning naming it, the others kept."""
    url = f"sqlite://{tmp_path / 'c.sqlite3'}"
    odd = "one\u2028two\u2029three\x85four"
    request = json.dumps({"model": "gpt-4o-mini", "max_tokens": 9, "stream": True,
                          "messages": [{"role": "user", "content": odd}]})
    event = "data: " + json.dumps({"choices": [{"delta": {"content": odd}}]}, ensure_ascii=False)
    write(url, [capture("odd", T0, request=Body(request, len(request)),
                        events=(StreamEvent(1.0, event), StreamEvent(2.0, "data: [DONE]")),
                        output_text=odd),
                capture("plain", T0 + 1)])
    done = captures("export", "--format", "jsonl", "--url", url)
    assert done.returncode == 0, done.stderr
    assert "\u2028" not in done.stdout and "\x85" not in done.stdout
    exported = tmp_path / "export.jsonl"
    exported.write_text(done.stdout + "{not a capture\n" + done.stdout.split("\n")[1] + "\n",
                        encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="tokenmeter.replay"):
        recordings = load_recordings(exported)
        loaded = load_replay(str(exported), Api.OPENAI, "gpt-4o-mini")
    prompts = loaded.prompts
    found = recordings.find("/v1/chat/completions", [{"role": "user", "content": odd}], True)
    assert found is not None and json.loads(found.events[0].text[6:])["choices"][0]["delta"][
        "content"] == odd
    assert [p.line for p in prompts] == [1, 2, 4]
    assert (loaded.lines, [s.text for s in loaded.skipped]) == (4, ["1 not readable"])
    assert prompts[0].messages == ({"role": "user", "content": odd},)
    warned = [r.getMessage() for r in caplog.records if r.name == "tokenmeter.replay"]
    assert warned and all(f"{exported}: line 3: " in w and "skipped" in w for w in warned)
