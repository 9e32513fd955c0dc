"""The capture store on a real SQLite file and on the machine's PostgreSQL: a capture comes back
whole, a write is idempotent by request_id, listings filter, retention deletes in slices."""

from __future__ import annotations

import sqlite3
import zlib
from pathlib import Path

import pytest

from proxy.capture.record import Body, Chunks
from proxy.capture.store import CaptureFilter, CaptureStore, decode, default_url, encode
from proxy.capture.writer import CaptureSink
from proxy.config.capture import CaptureConfig
from proxy.config.ledger import LedgerConfig
from tests.capture.captures import capture

T0 = 1_764_000_000.0


async def test_a_capture_comes_back_whole(store_url: str) -> None:
    original = capture("r1", T0, tool_calls=({"id": "c1", "arguments": "{}"},),
                       response=Body('{"x": "é"}', 11), upstream_error=Body("boom", 4, True))
    store = await CaptureStore.open(store_url)
    try:
        assert await store.write([original]) == len(encode(original))
        assert await store.get("r1") == original
        assert await store.get("missing") is None
    finally:
        await store.close()


async def test_a_capture_written_twice_is_stored_once_as_first_written(store_url: str) -> None:
    store = await CaptureStore.open(store_url)
    try:
        first = await store.write([capture("r1", T0), capture("r2", T0)])
        again = await store.write([capture("r1", T0, status=500), capture("r3", T0)])
        sizes = {r.request_id: r.size for r in await store.list(CaptureFilter())}
        assert (first, again) == (sizes["r1"] + sizes["r2"], sizes["r3"])  # bytes of new ones
        stored = await store.get("r1")
        assert stored is not None and stored.status == 200
        assert len(await store.list(CaptureFilter())) == 3
    finally:
        await store.close()


async def test_listing_filters_and_orders_newest_first(store_url: str) -> None:
    store = await CaptureStore.open(store_url)
    try:
        await store.write([
            capture("a", T0, user="alice"),
            capture("b", T0 + 10, user="bob", model="gpt-4o", status=429,
                    error_class="rate_limited"),
            capture("c", T0 + 20, user="alice", requested_model="big", model="gpt-4o"),
            capture("d", T0 + 30, user=None, stream=False),
        ])

        async def ids(**kw: object) -> list[str]:
            return [r.request_id for r in await store.list(CaptureFilter(**kw))]  # type: ignore[arg-type]

        assert await ids() == ["d", "c", "b", "a"]
        assert await ids(user="alice") == ["c", "a"]
        assert await ids(model="gpt-4o") == ["c", "b"]
        assert await ids(model="big") == ["c"]
        assert await ids(status=429) == ["b"]
        assert await ids(error_class="rate_limited") == ["b"]
        assert await ids(since=T0 + 10, until=T0 + 30) == ["c", "b"]
        assert await ids(limit=2) == ["d", "c"]
        (row,) = await store.list(CaptureFilter(status=429))
        assert (row.user, row.key_name, row.team, row.stream) == ("bob", "k1", "t1", True)
        assert row.started_at == T0 + 10 and row.size > 0
        (d,) = await store.list(CaptureFilter(since=T0 + 30))
        assert d.user is None and d.stream is False
    finally:
        await store.close()


async def test_the_stored_data_is_compressed_json(store_url: str) -> None:
    store = await CaptureStore.open(store_url)
    try:
        big = capture("r1", T0, output_text="word " * 20_000)
        await store.write([big])
        (row,) = await store.list(CaptureFilter())
        assert row.size < 10_000  # 100 kB of repetitive text, compressed
        ((data,),) = await store._fetch(f"SELECT data FROM {store.table}", ())
        assert zlib.decompress(bytes(data)).startswith(b'{"request_id":"r1"')
    finally:
        await store.close()


async def test_retention_deletes_old_captures_in_slices(store_url: str) -> None:
    store = await CaptureStore.open(store_url)
    try:
        await store.write([capture(f"old{i}", T0 + i) for i in range(7)])
        await store.write([capture(f"new{i}", T0 + 100 + i) for i in range(3)])
        assert await store.delete_older_than(T0 + 100, slice_rows=2) == 7
        assert await store.delete_older_than(T0 + 100, slice_rows=2) == 0
        assert sorted(r.request_id for r in await store.list(CaptureFilter())) == \
            ["new0", "new1", "new2"]
        with pytest.raises(ValueError, match="slice_rows"):
            await store.delete_older_than(T0 + 200, slice_rows=0)
    finally:
        await store.close()


async def test_reopening_keeps_the_table_and_its_rows(store_url: str) -> None:
    store = await CaptureStore.open(store_url)
    await store.write([capture("r1", T0)])
    await store.close()
    store = await CaptureStore.open(store_url)
    try:
        assert await store.get("r1") == capture("r1", T0)
    finally:
        await store.close()


def test_the_default_url_is_capture_url_then_the_ledgers_database() -> None:
    pg = "postgresql://u@h/db"
    assert default_url(CaptureConfig(url="sqlite:///c.db"), LedgerConfig(url=pg)) == \
        "sqlite:///c.db"
    assert default_url(CaptureConfig(), LedgerConfig(url=pg)) == pg
    assert default_url(CaptureConfig(), LedgerConfig()).endswith("/ledger.sqlite3")


async def test_an_unreachable_store_fails_to_open(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        await CaptureStore.open("postgresql://postgres@127.0.0.1:1/none")
    (tmp_path / "dir.sqlite3").mkdir()  # a directory where the file should be
    with pytest.raises(sqlite3.OperationalError):
        await CaptureStore.open(f"sqlite://{tmp_path / 'dir.sqlite3'}")


async def test_the_writer_takes_the_store_as_its_sink(store_url: str) -> None:
    sink: CaptureSink = await CaptureStore.open(store_url)
    assert isinstance(sink, CaptureStore)
    await sink.close()


def test_texts_kept_after_the_json_come_back_byte_for_byte() -> None:
    """Bodies and a stream's chunks are stored after the JSON head, each by its UTF-8 length:
    newlines, non-ASCII and braces in them change nothing."""
    stream = 'data: {"choices":[{"delta":{"content":"é\\n}"}}]}\n\ndata: [DONE]\n\n'
    written = capture("r1", T0, events=(), output_text=None,
                      request=Body('{"a": "line\\none ✓"}\n', 22),
                      response=Body("{\n}", 3), upstream_error=Body("ünïcode\n", 10, True),
                      chunks=Chunks(stream, (len(stream.encode()) - 14, len(stream.encode())),
                                    (1500, 2250)))
    read = decode(encode(written))
    assert read.request == written.request and read.response == written.response
    assert read.upstream_error == written.upstream_error
    assert [(e.at_ms, e.text) for e in read.events] == [
        (1.5, 'data: {"choices":[{"delta":{"content":"é\\n}"}}]}'), (2.25, "data: [DONE]")]
    assert read.output_text == "é\n}" and read.chunks is None
