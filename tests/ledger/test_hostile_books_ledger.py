"""The ledger's own counts under a full disk (issue 20, item 14c): a row torn by a short write is
counted as dropped once, so rows stored plus rows dropped is the number of requests; and a disk
full of stored rows can still say so (the shipper's cursor)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import asyncpg
import pytest
from aiohttp.test_utils import TestServer

from proxy.ledger.schema import TABLE
from proxy.ledger.spool import RowSpool, SpoolWriter, encode_row, reached, read_batch
from proxy.pipeline import services as st
from tests.books import ledger_row
from tests.helpers import MESSAGES, StackFactory, make_config, sample, scrape


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: a disk that fills up after a hundred-odd rows."""
    where = tmp_path / "tiny"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.mark.timeout(120)
async def test_a_row_torn_by_a_full_disk_is_dropped_once(
    make_stack: StackFactory, upstream: TestServer, pg_url: str, tiny_disk: Path,
    caplog: pytest.LogCaptureFixture
) -> None:
    ledger = {"enabled": True, "url": pg_url, "spool_dir": str(tiny_disk)}
    stack = await make_stack(make_config(str(upstream.make_url("/v1")),
                                         extra={"ledger": ledger}))
    requests = 400
    async with aiohttp.ClientSession() as s:
        for _ in range(requests):
            async with s.post(stack.proxy.make_url("/v1/chat/completions"),
                              json={"model": "mock-gpt", "messages": MESSAGES}) as resp:
                assert resp.status == 200
    await stack.settled(requests)
    books = stack.app[st.SERVICES].ledger
    assert books is not None
    assert await books.flush(30)
    assert any("short write" in r.getMessage() for r in caplog.records), \
        "the disk never tore a row: nothing was tested"
    conn = await asyncpg.connect(pg_url)
    try:
        stored = await conn.fetchval(f"SELECT count(*) FROM {TABLE}")
    finally:
        await conn.close()
    dropped = sample(await scrape(stack.proxy), "tokenmeter_ledger_rows_dropped_total")
    assert dropped >= 1
    # On main the torn row was counted twice: when its write failed, and when the shipper
    # skipped its bytes.
    assert stored + dropped == requests, (stored, dropped)


@pytest.mark.timeout(60)
def test_a_full_disk_still_takes_the_shippers_cursor(tiny_disk: Path) -> None:
    """A disk filled up while the rows on it are all stored: the shipper's cursor (which the
    writer and `flush` read to learn the room is free) is overwritten in place, since a new
    file cannot be written. On main the cursor stayed behind and the spool could not drain."""
    writer = SpoolWriter(tiny_disk, 1 << 20)
    assert writer.append(b"".join(encode_row(ledger_row(f"r{i:04d}", 1_796_000_000.0 + i))
                                  for i in range(40)))
    spool = RowSpool(tiny_disk)
    spool.take(spool.scan(spool.known()))
    seg = spool.head()
    assert seg is not None and seg.live
    spool.advance(read_batch(seg, seg.end, 10, tuple))  # a cursor written as always
    fd = os.open(tiny_disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while True:  # the disk full: not a byte more
                os.write(fd, b"x" * 4096)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        (tiny_disk / "probe").write_bytes(b"x")
    assert not reached(writer.marks())
    while (head := spool.head()) is not None:
        spool.advance(read_batch(head, head.end, 10, tuple))
    assert not spool.cursor_failing
    assert int(seg.cursor_path.read_text()) == seg.end
    assert reached(writer.marks())  # `Ledger.flush` sees everything stored


@pytest.mark.timeout(60)
def test_a_disk_full_before_the_shippers_first_cursor_still_takes_it(tiny_disk: Path) -> None:
    """A disk filled up before the shipper stored anything of a segment: its first cursor is
    written in place too (the writer made the file with the segment). On main it could not
    be created, the segment never said it was stored, and `Ledger.flush` waited (seen as a
    failed flush after a second torn row of the full-disk test above)."""
    writer = SpoolWriter(tiny_disk, 1 << 20)
    assert writer.append(b"".join(encode_row(ledger_row(f"r{i:04d}", 1_796_000_000.0 + i))
                                  for i in range(40)))
    fd = os.open(tiny_disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while True:  # the disk full: not a byte more
                os.write(fd, b"x" * 4096)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        (tiny_disk / "probe").write_bytes(b"x")
    spool = RowSpool(tiny_disk)
    spool.take(spool.scan(spool.known()))
    seg = spool.head()
    assert seg is not None and seg.live and seg.start == 0
    assert not reached(writer.marks())
    while (head := spool.head()) is not None:
        spool.advance(read_batch(head, head.end, 10, tuple))
    assert not spool.cursor_failing
    assert int(seg.cursor_path.read_text()) == seg.end
    assert reached(writer.marks())
