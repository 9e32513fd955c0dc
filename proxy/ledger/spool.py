"""The ledger's local spool: where each request's row waits between settle and the database.

Two sides, two processes. A serving process's `SpoolWriter` appends rows (`encode_row`, one
JSON line each; the rows of one loop turn in one `os.write`) to an `O_APPEND` file descriptor:
once the write returns, the rows are in the OS's page cache, so a SIGKILL of the process loses
nothing. There is no fsync: a power loss (or a kernel crash) may lose the rows of the last few
seconds, which is out of scope (the database itself is the durable copy). The shipper process's
`RowSpool` follows every writer's segments in the directory and ships them
(proxy.ledger.shipper_process); a writer never reads, ships or deletes.

On disk, in the spool directory:
- `ledger-<owner>-<seq>.jsonl`: append-only segments. `owner` is `<pid>-<random hex>` (a
  restarted container has the same pid, never the same owner); a segment is closed once it
  passes `segment_bytes` and the next one is started. A segment of a live writer with a later
  one beside it can no longer grow (the writer closed it before making the next).
- `ledger-<owner>.lock`: flock'd by the writer for its whole life. A shipper that can take the
  lock of an owner knows that owner is gone, and adopts its segments (its own cursors say where
  they stand). The lock is taken before the first segment exists, so a segment found is always
  under a lock: held (a live writer, followed) or free (gone, adopted).
- `<segment>.pos`: the byte offset up to which the segment's rows are stored in the database,
  written by the shipper only after the database committed them. A crash of the shipper between
  the commit and this write ships those rows again: the database stores a request id once
  (primary key), so that is safe. A fully stored, closed segment is deleted (with its `.pos`).
  Always `CURSOR_WIDTH` bytes (the number right-aligned), so a full disk can still take it:
  overwritten in place when a new file cannot be written.

The shipper reads complete lines only. A segment's last line without its newline (the process
was killed inside its write) is skipped once the segment can no longer grow, and counted as
dropped. A short write (a full disk) is cut off again at once: its rows are counted when the
write fails, once.

The bound: a writer's rows not yet stored may take `max_bytes`; past it `append` refuses new
rows (the caller counts them as dropped). The writer learns what is stored from the shipper's
files (its closed segments deleted, the live one's cursor), looked at when it is full (at most
every RECLAIM_EVERY_S) and at each new segment.

Threads: the shipper's `scan` and big `read_batch`es do file I/O only and run in a worker
thread; `take`, `advance` and the bookkeeping on its event loop's thread.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.files import FILE_MODE, private_dir
from proxy.ledger.row import COLUMNS, LedgerRow, complete

log = logging.getLogger("tokenmeter.ledger")

SEGMENT_MIN_BYTES = 64 * 1024
SEGMENT_MAX_BYTES = 16 * 1024 * 1024
_SEGMENT_RE = re.compile(r"^ledger-(\d+-[0-9a-f]+)-(\d+)\.jsonl$")
_ENDED = COLUMNS.index("ended_at")
RECLAIM_EVERY_S = 0.1  # a full spool looks again whether the shipper freed room
CURSOR_WIDTH = 20  # bytes of a `.pos` file: any offset, right-aligned (see `_write_cursor`)

# The row is a tuple: the C JSON encoder writes it as the array the spool holds, with no
# per-field Python (this is on every request's settle path).
_encode = json.JSONEncoder(separators=(",", ":")).encode


def encode_row(row: LedgerRow) -> bytes:
    """One spool line, byte for byte what `row.to_json()` returns."""
    return (_encode(row) + "\n").encode()


@dataclass(eq=False, slots=True)
class Segment:
    """One spool file and how much of it is stored."""

    path: Path
    owner: str
    seq: int
    start: int  # bytes [0, start) are stored in the database
    end: int  # bytes [start, end) are written and wait; for a live segment, grows with appends
    rows: int  # complete rows in [start, end)
    live: bool  # this process still appends to it
    gone: bool = False  # stored completely and deleted
    # Its torn tail is a row `append` already reported dropped (a short write it could not cut).
    torn_counted: bool = False

    @property
    def cursor_path(self) -> Path:
        return self.path.with_name(self.path.name + ".pos")


@dataclass(frozen=True, slots=True)
class Batch:
    """Rows read from one segment, parsed and made ready for the database."""

    segment: Segment
    records: list[tuple[Any, ...]]
    lines: int  # complete lines consumed, parsed or not
    bad: int  # lines that did not parse as a row (counted as dropped)
    next_start: int  # the segment's cursor once this batch is stored
    torn: int  # bytes of a torn last line skipped (the segment can no longer grow)
    torn_counted: bool  # that line's row was counted as dropped when its write failed
    oldest_ended_at: float | None  # the oldest row's end time, for the lag gauge


@dataclass(slots=True)
class _Adopted:
    owner: str
    lock_fd: int
    segments: list[Segment] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Seen:
    """One segment of a live writer as a scan found it (its rows are counted from `counted`,
    where the shipper's count of it stopped, or from its cursor when it is new)."""

    path: Path
    owner: str
    seq: int
    size: int
    start: int
    new_rows: int  # complete lines in [counted or start, size)
    sealed: bool  # its writer has moved on to a later segment: it can no longer grow


@dataclass(frozen=True, slots=True)
class Scan:
    adopted: list[_Adopted]
    seen: list[_Seen]
    live_owners: int  # writers still holding their lock


class RowSpool:
    """The shipper process's view of the spool directory: the segments of every writer, live
    (followed: their complete lines are shipped as they come) or gone (adopted under their lock),
    with the cursors it keeps. Never appended to: writers are `SpoolWriter`s (not the budget's
    debts either: that is proxy.budget.spool.SettleSpool)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"  # never writes: adopts nothing of
        self.pending_rows = 0
        self.pending_bytes = 0
        self.cursor_failing = False  # the last cursor write failed (logged once)
        self._segments: list[Segment] = []  # in shipping order: adopted first, then followed
        self._adopted: dict[str, _Adopted] = {}
        self._followed: dict[Path, Segment] = {}  # segments of writers that are alive

    @property
    def segments(self) -> Sequence[Segment]:
        return self._segments

    # --- shipping (event loop side) ----------------------------------------------------------
    def head(self) -> Segment | None:
        """The first segment with rows (or a torn tail) waiting; deletes finished ones."""
        for seg in list(self._segments):
            if seg.start < seg.end:
                return seg
            if not seg.live:
                self._delete(seg)
        return None

    def marks(self) -> list[tuple[Segment, int]]:
        """Where every segment ends now: everything recorded so far is stored when each
        segment's cursor has reached its mark (or the segment is gone)."""
        return [(seg, seg.end) for seg in self._segments]

    def advance(self, batch: Batch) -> None:
        """Batch stored (or skipped): move the cursor, durably for a restart, then forget."""
        seg = batch.segment
        consumed = batch.next_start - seg.start
        seg.start = batch.next_start
        seg.rows -= batch.lines
        self.pending_rows -= batch.lines
        self.pending_bytes -= consumed
        if not seg.live and seg.start >= seg.end:
            self._delete(seg)
            return
        try:
            _write_cursor(seg)
        except OSError as exc:
            # The rows are stored; a stale cursor only means a restart ships them again.
            if not self.cursor_failing:
                log.error("ledger: cannot write the spool cursor %s (%s): after a restart "
                          "these rows are shipped again (and stored once)", seg.cursor_path, exc)
            self.cursor_failing = True
        else:
            self.cursor_failing = False

    def forget(self, seg: Segment) -> None:
        """A segment whose file vanished: its rows are lost (the caller says so)."""
        self._delete(seg)

    def _delete(self, seg: Segment) -> None:
        # The segment first: a `.pos` without its segment is only litter (removed on a scan);
        # a segment without its `.pos` would be shipped again from the start.
        with contextlib.suppress(FileNotFoundError):
            seg.path.unlink()
        with contextlib.suppress(FileNotFoundError):
            seg.cursor_path.unlink()
        seg.gone = True
        self._segments.remove(seg)
        self.pending_rows -= seg.rows
        self.pending_bytes -= seg.end - seg.start
        seg.rows = 0
        self._followed.pop(seg.path, None)
        adopted = self._adopted.get(seg.owner)
        if adopted is not None:
            adopted.segments.remove(seg)
            if not adopted.segments:
                self._release(adopted, unlink=True)

    def _release(self, adopted: _Adopted, *, unlink: bool) -> None:
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                (self.directory / f"ledger-{adopted.owner}.lock").unlink()
        os.close(adopted.lock_fd)
        del self._adopted[adopted.owner]

    # --- the writers: followed while alive, adopted once gone -------------------------------
    def known(self) -> dict[Path, int]:
        """Where the count of each followed segment stopped (for `scan`, in a thread)."""
        return {path: seg.end for path, seg in self._followed.items()}

    def scan(self, known: dict[Path, int]) -> Scan:
        """The directory now (blocking: run it in a thread; `take` then applies it on the
        loop's thread): the segments of writers that are gone, locked for us, and how far the
        live writers' segments have grown."""
        try:
            names = set(os.listdir(self.directory))
        except FileNotFoundError:
            return Scan([], [], 0)
        by_owner: dict[str, list[tuple[int, str]]] = {}
        for name in names:
            m = _SEGMENT_RE.match(name)
            if m is not None and m.group(1) != self.owner and m.group(1) not in self._adopted:
                by_owner.setdefault(m.group(1), []).append((int(m.group(2)), name))
            elif name.endswith(".jsonl.pos") and name[:-4] not in names:
                with contextlib.suppress(FileNotFoundError):
                    (self.directory / name).unlink()  # litter of a deleted segment
        adopted: list[_Adopted] = []
        seen: list[_Seen] = []
        live = 0
        for owner in sorted(by_owner):
            found = self._lock_owner(owner)
            if found is not None:
                adopted.append(found)
                continue
            live += 1
            files = sorted(by_owner[owner])
            for seq, name in files:
                with contextlib.suppress(FileNotFoundError):
                    seen.append(_see(self.directory / name, owner, seq, known,
                                     sealed=seq != files[-1][0]))
        return Scan(adopted, seen, live)

    def _lock_owner(self, owner: str) -> _Adopted | None:
        lock = self.directory / f"ledger-{owner}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The file we locked must still be the one at that name: an adopter that finished
            # this owner deletes its segments, then unlinks the lock.
            if os.fstat(fd).st_ino != os.stat(lock).st_ino:
                raise OSError("lock file replaced")
        except OSError:
            os.close(fd)
            return None  # a live process holds it, or another adopter
        adopted = _Adopted(owner, fd)
        # Listed again under the lock: what an earlier adopter shipped and deleted is gone.
        pattern = re.compile(rf"^ledger-{re.escape(owner)}-(\d+)\.jsonl$")
        for name in sorted(os.listdir(self.directory)):
            m = pattern.match(name)
            if m is None:
                if name.startswith(f"ledger-{owner}-") and name.endswith(".pos.tmp"):
                    with contextlib.suppress(FileNotFoundError):  # its cursor write was cut
                        (self.directory / name).unlink()
                continue
            path = self.directory / name
            try:
                seg = _load_segment(path, owner, int(m.group(1)))
            except FileNotFoundError:
                continue
            adopted.segments.append(seg)
        if not adopted.segments:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            os.close(fd)
            return None
        return adopted

    def take(self, scan: Scan) -> int:
        """Apply a `scan`: adopted segments go ahead of the followed ones (a followed writer
        that has died since is adopted: its segments are read again from its cursors, which
        this process wrote); followed ones grow. The rows adopted."""
        rows = 0
        at = sum(1 for s in self._segments if s.owner in self._adopted)
        for adopted in scan.adopted:
            for seg in [s for s in self._segments if s.owner == adopted.owner]:
                self._segments.remove(seg)  # followed until now: replaced by its reread
                self._followed.pop(seg.path, None)
                self.pending_rows -= seg.rows
                self.pending_bytes -= seg.end - seg.start
                seg.gone = True
                at = sum(1 for s in self._segments if s.owner in self._adopted)
            self._adopted[adopted.owner] = adopted
            for seg in adopted.segments:
                self._segments.insert(at, seg)
                at += 1
                rows += seg.rows
                self.pending_rows += seg.rows
                self.pending_bytes += seg.end - seg.start
        for seen in scan.seen:
            followed = self._followed.get(seen.path)
            if followed is None:
                if seen.owner in self._adopted:
                    continue
                followed = Segment(seen.path, seen.owner, seen.seq, seen.start, seen.start, 0,
                                   live=True)
                self._followed[seen.path] = followed
                self._segments.append(followed)
            if seen.size > followed.end:
                self.pending_bytes += seen.size - followed.end
                followed.end = seen.size
                followed.rows += seen.new_rows
                self.pending_rows += seen.new_rows
            followed.live = not seen.sealed
        return rows

    # --- close ------------------------------------------------------------------------------
    def close(self) -> int:
        """Release every lock (cursors are on disk); the rows left wait for the next shipper."""
        for seg in list(self._segments):
            if seg.start >= seg.end and not seg.live:
                self._delete(seg)
        for adopted in list(self._adopted.values()):
            self._release(adopted, unlink=False)
        left = self.pending_rows
        self._segments = []
        self._adopted = {}
        self._followed = {}
        self.pending_rows = 0
        self.pending_bytes = 0
        return left


def _see(path: Path, owner: str, seq: int, known: dict[Path, int], *, sealed: bool) -> _Seen:
    size = path.stat().st_size
    counted = known.get(path)
    start = 0
    if counted is None:
        with contextlib.suppress(FileNotFoundError, ValueError):
            start = min(size, max(0, int(path.with_name(path.name + ".pos").read_text())))
        counted = start
    rows = 0
    if size > counted:
        with path.open("rb") as f:
            f.seek(counted)
            rows = f.read(size - counted).count(b"\n")
    return _Seen(path, owner, seq, size, start, rows, sealed)


class SpoolWriter:
    """A serving process's side of the spool: appends rows to its own segments (lock held for
    its life), and never reads, ships or deletes them: the shipper process does. The bound on
    the disk rows not yet stored may take is checked against this writer's own segment files
    that are still there (the shipper deletes a segment once it is stored and closed)."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = min(SEGMENT_MAX_BYTES, max(SEGMENT_MIN_BYTES, max_bytes // 16))
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.pending_bytes = 0  # bytes of this writer's not known to be stored
        self.dropping = False  # the last append was refused or failed
        self._sealed: list[tuple[Path, int]] = []  # closed segments not yet seen deleted
        self._live: Path | None = None
        self._end = 0  # the live segment's size
        self._lock_fd = -1
        self._fd = -1
        self._seq = 0
        self._next_reclaim = 0.0

    # --- the hot path -----------------------------------------------------------------------
    def append(self, data: bytes) -> bool:
        """Write rows' lines (whole lines, one `write`). False: the spool is full and they were
        not written. Raises OSError when the write failed (the caller counts them dropped)."""
        n = len(data)
        if self.pending_bytes + n > self.max_bytes:
            self._reclaim(force=False)
            if self.pending_bytes + n > self.max_bytes:
                self.dropping = True
                return False
        if self._live is None:
            self._open_live()
        try:
            written = os.write(self._fd, data)
        except OSError:
            self.dropping = True
            raise
        if written != n:
            self._short_write(written)
        self._end += n
        self.pending_bytes += n
        self.dropping = False
        if self._end >= self.segment_bytes:
            self._roll()
            self._reclaim(force=True)
        return True

    def _reclaim(self, *, force: bool) -> None:
        """Forget the closed segments the shipper has deleted (a stat each, at most once a
        second unless `force`)."""
        now = time.monotonic()
        if force or now >= self._next_reclaim:
            self._next_reclaim = now + RECLAIM_EVERY_S
            self._sealed = [(path, size) for path, size in self._sealed if path.exists()]
            shipped = 0
            if self._live is not None:  # the live segment's stored part: its cursor
                with contextlib.suppress(FileNotFoundError, ValueError):
                    shipped = int(self._live.with_name(self._live.name + ".pos").read_text())
            self.pending_bytes = sum(size for _, size in self._sealed) + self._end - shipped

    def _short_write(self, written: int) -> None:
        """A partial line (a full disk): cut off again, so the shipper never sees it (the
        caller counts the rows as dropped when this raises). Should the cut fail, the bytes
        stay as a torn tail the shipper skips (and counts) once the segment is closed, which
        it is at once."""
        self.dropping = True
        try:
            os.ftruncate(self._fd, self._end)
        except OSError:
            self._end += written
            self.pending_bytes += written
        self._roll()
        raise OSError(f"short write to the ledger spool: {written} bytes")

    def _open_live(self) -> None:
        if self._lock_fd < 0:
            private_dir(self.directory)
            lock = self.directory / f"ledger-{self.owner}.lock"
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours: nobody else has this name
            self._lock_fd = fd
        self._seq += 1
        path = self.directory / f"ledger-{self.owner}-{self._seq:06d}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                     FILE_MODE)
        try:
            _first_cursor(path)
        except OSError:
            # No segment without its cursor: a full disk could never take its first one.
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self.dropping = True
            raise
        self._fd = fd
        self._live = path
        self._end = 0

    def _roll(self) -> None:
        """Close the live segment; the next append starts the next one, whose existence tells
        the shipper this one can no longer grow."""
        if self._live is not None:
            self._sealed.append((self._live, self._end))
            self._live = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # --- what the shipper has done ----------------------------------------------------------
    def marks(self) -> list[tuple[Path, int]]:
        """Where each segment in the directory ends now (this writer's and any other's): all
        written so far is stored once each is gone or its cursor has reached its mark."""
        out = dict(self._sealed)
        if self._live is not None:
            out[self._live] = self._end
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                path = self.directory / name
                if path not in out and _SEGMENT_RE.match(name):
                    with contextlib.suppress(FileNotFoundError):
                        out[path] = path.stat().st_size
        return list(out.items())

    # --- close ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop writing and release the lock: the shipper adopts what is left. A new `append`
        starts a new owner."""
        self._roll()
        if self._lock_fd >= 0:
            if not any(path.exists() for path, _ in self._sealed):
                with contextlib.suppress(FileNotFoundError):
                    (self.directory / f"ledger-{self.owner}.lock").unlink()
            os.close(self._lock_fd)
            self._lock_fd = -1
        self._sealed = []
        self.pending_bytes = 0
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._seq = 0


def reached(marks: list[tuple[Path, int]]) -> bool:
    """Whether the shipper has stored every segment up to its mark (a stat and a small read
    per segment)."""
    for path, mark in marks:
        try:
            pos = int(path.with_name(path.name + ".pos").read_text())
        except FileNotFoundError:
            if path.exists():
                return False
            continue
        except ValueError:
            return False
        if pos < mark:
            return False
    return True


def read_batch(seg: Segment, end: int, max_rows: int,
               prepare: Callable[[list[Any]], tuple[Any, ...]]) -> Batch:
    """Up to `max_rows` complete lines of `seg` from its cursor, parsed and prepared for the
    sink (blocking: run it in a thread). `end` is where the segment ended when asked (a live
    segment keeps growing, but only whole lines are ever below its `end`)."""
    start = seg.start
    want = end - start
    size = read_size(max_rows)
    with seg.path.open("rb") as f:
        f.seek(start)
        data = f.read(min(want, size))
        while b"\n" not in data and len(data) < want:  # one line longer than the read
            more = f.read(min(want - len(data), size))
            if not more:
                break
            data += more
    cut = data.rfind(b"\n") + 1
    lines = data[:cut].split(b"\n")[:-1]
    if len(lines) > max_rows:
        lines = lines[:max_rows]
        cut = sum(len(line) + 1 for line in lines)
    torn = 0
    if cut == 0 and not seg.live:
        torn = want  # the last line never got its newline, and never will: skip it
    records: list[tuple[Any, ...]] = []
    bad = 0
    oldest: float | None = None
    for line in lines:
        try:
            values = json.loads(line)
            if not isinstance(values, list) or not complete(values):
                raise ValueError("not a ledger row")
            ended = float(values[_ENDED])
            records.append(prepare(values))
        except (ValueError, TypeError, OverflowError):
            bad += 1
            continue
        if oldest is None or ended < oldest:
            oldest = ended
    return Batch(seg, records, len(lines), bad, start + cut + torn, torn, seg.torn_counted,
                 oldest)


def read_size(max_rows: int) -> int:
    """Bytes read at once for a batch of `max_rows` (rows are about 300 to 600 bytes)."""
    return max(SEGMENT_MIN_BYTES, max_rows * 1024)


def _load_segment(path: Path, owner: str, seq: int) -> Segment:
    size = path.stat().st_size
    start = 0
    with contextlib.suppress(FileNotFoundError, ValueError):
        start = min(size, max(0, int(path.with_name(path.name + ".pos").read_text())))
    rows = 0
    with path.open("rb") as f:
        f.seek(start)
        while chunk := f.read(1 << 20):
            rows += chunk.count(b"\n")
    return Segment(path, owner, seq, start, size, rows, live=False)


def _first_cursor(path: Path) -> None:
    """A new segment's cursor (0: nothing stored), written with the segment, before its first
    row: the shipper's cursors then always overwrite a file of CURSOR_WIDTH bytes, which a
    full disk still takes in place (`_write_cursor`). Without it, a disk filled up before the
    shipper's first cursor of a segment left that segment unable to say it was stored, and
    `Ledger.flush` waiting."""
    cursor = path.with_name(path.name + ".pos")
    fd = os.open(cursor, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        if os.write(fd, b"0".rjust(CURSOR_WIDTH)) != CURSOR_WIDTH:
            raise OSError(errno.ENOSPC, "short write of a spool cursor")
    except OSError:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            cursor.unlink()
        raise
    os.close(fd)


def _write_cursor(seg: Segment) -> None:
    # Replaced whole, so a kill mid-write leaves the old offset (rows shipped again), never a
    # torn number. No fsync: a power loss is out of scope, and a lost cursor only re-ships.
    # Always CURSOR_WIDTH bytes (the number right-aligned; `int` reads it), so that on a full
    # disk, where the new file cannot be written, the cursor is overwritten in place: the
    # same bytes of a file that has them, no new block. Without that, a disk filled by a
    # segment whose rows are all stored could never say so, and the writer, which learns
    # from this cursor that the segment's room is free, would go on dropping rows.
    text = str(seg.start).encode().rjust(CURSOR_WIDTH)
    tmp = seg.path.with_name(seg.path.name + ".pos.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            if os.write(fd, text) != len(text):
                raise OSError(errno.ENOSPC, "short write of a spool cursor")
        finally:
            os.close(fd)
        os.replace(tmp, seg.cursor_path)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(seg.cursor_path, os.O_WRONLY | os.O_CLOEXEC)  # no cursor yet: raises
        try:
            if os.fstat(fd).st_size != CURSOR_WIDTH or os.pwrite(fd, text, 0) != CURSOR_WIDTH:
                raise exc
        finally:
            os.close(fd)
