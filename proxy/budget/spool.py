"""Usage owed to the budget store while it cannot take it, kept on local disk until it can.

Two kinds of debt:
- an `Owed` settlement under its own id: it replaces what the store may hold for a reservation
  (or releases a reservation whose reply never arrived), so the store must see that id;
- usage of requests admitted while the store was down: they reserved nothing, so their amounts
  are plain additions and are summed per counter (exact, and memory grows with the number of
  counters touched, not with requests). When the store is back, each user's sums are sealed
  into one batch with an id of its own and applied like any settlement.

Every id is applied once, and struck from the spool only after the store took it, so a crash in
between replays an id the store will skip: a reservation's settle is recognised by the store
itself (the reservation's record is gone once settled; see `proxy.budget.store`), a batch of
additions by a done-marker kept `REPLAY_DONE_TTL_S`.

On disk: one append-only JSON-lines file per process (`spool-<id>.jsonl`), one `write` per
record (a killed process loses nothing the OS has; a short write is cut off again, so a line is
whole or absent), compacted to its current state now and then, and guarded by an flock on
`spool-<id>.lock`. A starting process adopts the files of processes that are gone (their lock is
free): a restart replays what the previous run owed; a line it cannot read is skipped and named
(file and line number), never fatal. No count bound: the disk is the bound. When the disk fails
(full, read-only), what it cannot take is kept in memory and replayed from there like the rest;
it is lost only if the process stops first with the disk still failing (`close` says which).
Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from proxy.budget.limits import Window
from proxy.budget.store import SettleKind, WindowAmount
from proxy.files import private_dir, private_opener

log = logging.getLogger("tokenmeter.spool")

# Long enough that a replay after any restart within the daily counters' retention is skipped
# by the store if it already took it.
REPLAY_DONE_TTL_S = 9 * 86400
_COMPACT_EVERY = 20_000  # appended records between rewrites of the file
_BAD_LINES_SHOWN = 20  # line numbers named in the log line about an unreadable file


@dataclass(frozen=True, slots=True, kw_only=True)  # three names in a row: by name only
class Debit:
    """One settlement on its way to the store, or to the spool while the store cannot take it
    (`SettleSpool.owe`, `SettleSpool.add`); a replay hands it back (`Owed.charge`)."""

    slot: str
    res_id: str
    entries: tuple[WindowAmount, ...]
    tokens: int  # for the books and the logs: the request's total tokens
    kind: SettleKind  # replaces a reservation the store granted, or adds usage without one
    # The user's limited daily-quota window, for threshold notices, and whose it is.
    notice: Window | None = None
    user: str = ""
    # Parallel to `entries`, for the gauges of a live settlement (not spooled: a replayed
    # one sets no gauges).
    windows: tuple[Window, ...] | None = None


@dataclass(frozen=True, slots=True)
class Debt:
    key: str
    amount: int
    expires_at: float  # epoch seconds: when the counter would have expired in the store


@dataclass(frozen=True, slots=True)
class Owed:
    slot: str
    res_id: str
    debts: tuple[Debt, ...]
    tokens: int  # for the books and the logs: the request's total tokens
    # The user's limited daily-quota window, so a replay sends the threshold notices a live
    # settle would have (it is the same code path).
    notice: Window | None = None
    user: str = ""  # whose notice it is
    # Spool lines written before reservations settled without markers carry no kind: an
    # addition under a marker is what the store applied them as then (and it replaces a
    # reservation still held under the id, so it is right for both).
    kind: SettleKind = SettleKind.ADDITION

    def entries(self, now: float) -> tuple[WindowAmount, ...]:
        """Store entries for what has not expired yet (an expired counter is gone in the store
        too, so there is nothing to restore), with what remains of each ttl."""
        return tuple(
            WindowAmount(d.key, None, d.amount, max(1, math.ceil(d.expires_at - now)))
            for d in self.debts if d.expires_at > now
        )

    def charge(self, now: float) -> Debit:
        """What to apply to the store for it now (see `entries`)."""
        return Debit(slot=self.slot, res_id=self.res_id, entries=self.entries(now),
                      tokens=self.tokens, kind=self.kind, notice=self.notice, user=self.user)


class SettleSpool:
    """The budget's spool: settlements and usage the store could not take yet (not the
    ledger's rows: that is proxy.ledger.spool.RowSpool)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._id = uuid.uuid4().hex[:16]
        self._owed: dict[str, Owed] = {}
        # (slot, key) -> [amount, latest expires_at]; the tokens they carry, per slot
        self._sums: dict[tuple[str, str], list[float]] = {}
        self._sum_tokens: dict[str, int] = {}
        self._sum_notice: dict[str, tuple[str, Window]] = {}  # per slot: user, latest window
        # What memory holds that the file does not (its write failed: a full disk): tokens per
        # owed id, and per slot of the sums. Still delivered by a replay; lost only if the
        # process stops before that and the file still cannot take the state (see `close`).
        self._unsaved: dict[str, int] = {}
        self._unsaved_sums: dict[tuple[str, str], list[float]] = {}  # like `_sums`
        self._unsaved_sum_tokens: dict[str, int] = {}
        self._fd = -1  # the file, O_APPEND: one write per record, no buffer to flush later
        self._size = 0  # its length after the last whole record
        self._lock: IO[str] | None = None
        self._appended = 0
        self.bad_lines = 0  # lines of adopted files that could not be read (see `open`)

    @property
    def path(self) -> Path:
        return self.directory / f"spool-{self._id}.jsonl"

    # --- lifecycle ------------------------------------------------------------------------
    def open(self) -> int:
        """Create this process's file and adopt the files of processes that are gone. Returns
        how many of their lines were unreadable (skipped, logged with their file and number)."""
        private_dir(self.directory)
        self._lock = open(self.directory / f"spool-{self._id}.lock", "w",  # noqa: SIM115
                          opener=private_opener)  # held open: the lock lives as long as we do
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._reopen()
        for data in sorted(self.directory.glob("spool-*.jsonl")):
            if data != self.path:
                self._adopt(data.with_suffix(".lock"))
        return self.bad_lines

    def close(self) -> list[int]:
        """Write the current state durably; an empty spool leaves no file behind. Returns the
        tokens of each settlement lost now: held in memory only (its write failed) and the
        state still cannot be written. The rest stays on disk for the next start."""
        if self._fd < 0:
            return []
        empty = not self._owed and not self._sums
        lost: list[int] = []
        if empty:
            self.path.unlink(missing_ok=True)
        else:
            try:
                self._compact()
            except OSError as exc:
                lost = [*self._unsaved.values(), *self._unsaved_sum_tokens.values()]
                log.error("cannot write the settlement spool %s at stop (%s): what it holds "
                          "from before stays for the next start", self.path, exc)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock is not None:
            if empty:
                (self.directory / f"spool-{self._id}.lock").unlink(missing_ok=True)
            self._lock.close()  # the next process to start adopts what is left
            self._lock = None
        return lost

    # --- recording ------------------------------------------------------------------------
    def owe(self, charge: Debit, now: float) -> None:
        """Owe `charge` under its own id (and kind). Raises OSError when the file cannot take
        it: it is held in memory all the same (and replayed from there), but a stop before the
        replay would lose it."""
        res_id = charge.res_id
        owed = Owed(charge.slot, res_id, _debts(charge.entries, now), charge.tokens,
                    charge.notice, charge.user, charge.kind)
        self._owed[res_id] = owed
        try:
            self._append(_owed_record(owed))
        except OSError:
            self._unsaved[res_id] = owed.tokens
            raise
        self._unsaved.pop(res_id, None)

    def add(self, charge: Debit, now: float) -> None:
        """Sum `charge`'s amounts per counter with the other additions of its slot (its own id
        and kind are not kept: the sums are sealed into a batch of their own, an addition).
        Raises OSError like `owe`, the usage summed in memory all the same."""
        slot, tokens, notice = charge.slot, charge.tokens, charge.notice
        debts = _debts(charge.entries, now)
        self._sum(slot, debts, tokens)
        if notice is not None:
            self._sum_notice[slot] = (charge.user, notice)
        try:
            self._append({"a": slot, "e": [[d.key, d.amount, d.expires_at] for d in debts],
                          "t": tokens, "n": _notice_json(notice), "u": charge.user})
        except OSError:
            _sum_into(self._unsaved_sums, self._unsaved_sum_tokens, slot, debts, tokens)
            raise

    def _sum(self, slot: str, debts: tuple[Debt, ...], tokens: int) -> None:
        _sum_into(self._sums, self._sum_tokens, slot, debts, tokens)

    # --- replay ---------------------------------------------------------------------------
    def pending(self) -> tuple[int, int]:
        """Settlements waiting (each user's sums count as one), and the tokens they carry."""
        count = len(self._owed) + len(self._sum_tokens)
        tokens = sum(o.tokens for o in self._owed.values()) + sum(self._sum_tokens.values())
        return count, tokens

    def take(self) -> list[Owed]:
        """Everything owed, each user's sums sealed into a batch under a new id (written to
        disk before it is handed out, so that id is what a crash replays).

        While the disk cannot take the sealed state, the sums the file holds stay sums and
        wait (replayed under an id the file does not know, they would be applied a second time
        by whoever adopts the file); the part of them only memory holds is sealed apart and
        handed out, since no file can replay it."""
        if self._sums:
            sealed = {o.res_id: o for o in _seal(self._sums, self._sum_tokens,
                                                 self._sum_notice, uuid.uuid4().hex).values()}
            try:
                self._write_state({**self._owed, **sealed}, {}, {}, {})
            except OSError:
                self._seal_unsaved()
                return list(self._owed.values())
            self._owed.update(sealed)
            self._sums.clear()
            self._sum_tokens.clear()
            self._sum_notice.clear()
        return list(self._owed.values())

    def _seal_unsaved(self) -> None:
        """The sums only memory holds, out of the sums and into owed batches of their own."""
        if not self._unsaved_sums:
            return
        loose = _seal(self._unsaved_sums, self._unsaved_sum_tokens, self._sum_notice,
                      uuid.uuid4().hex)
        for (slot, key), (amount, _) in self._unsaved_sums.items():
            acc = self._sums[(slot, key)]
            acc[0] -= amount
            if acc[0] == 0:
                del self._sums[(slot, key)]
        for slot, tokens in self._unsaved_sum_tokens.items():
            self._sum_tokens[slot] -= tokens
            if not any(s == slot for s, _ in self._sums):
                self._sum_tokens.pop(slot, None)
                self._sum_notice.pop(slot, None)
        for owed in loose.values():
            self._owed[owed.res_id] = owed
            self._unsaved[owed.res_id] = owed.tokens
        self._unsaved_sums.clear()
        self._unsaved_sum_tokens.clear()

    def done(self, owed: Owed) -> None:
        """`owed` reached the store. Its strike-out may fail to reach the disk: then a restart
        replays it, and the store recognises the id (see the module's note)."""
        if self._owed.pop(owed.res_id, None) is None:
            return
        self._unsaved.pop(owed.res_id, None)
        with contextlib.suppress(OSError):
            if not self._owed and not self._sums:
                self._compact()
            else:
                self._append({"d": owed.res_id})

    def __iter__(self) -> Iterator[Owed]:
        return iter(list(self._owed.values()))

    # --- disk -----------------------------------------------------------------------------
    def _append(self, record: dict[str, Any]) -> None:
        """One whole line or nothing (a short write is cut off again), in the OS's hands when
        this returns: a killed process loses nothing."""
        if self._fd < 0:
            raise OSError("the spool is not open")
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        written = os.write(self._fd, line)
        if written != len(line):
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise OSError(errno.ENOSPC, f"short write to {self.path}: {written} bytes")
        self._size += written
        self._appended += 1
        if self._appended >= _COMPACT_EVERY:
            with contextlib.suppress(OSError):  # the record is written; this only saves disk
                self._compact()

    def _compact(self) -> None:
        """Rewrite the file as the current state: sums and owed settlements, no history."""
        self._write_state(self._owed, self._sums, self._sum_tokens, self._sum_notice)

    def _write_state(self, owed: dict[str, Owed], sums: dict[tuple[str, str], list[float]],
                     sum_tokens: dict[str, int],
                     sum_notice: dict[str, tuple[str, Window]]) -> None:
        """Replace the file with this state, whole or not at all."""
        tmp = self.directory / f"spool-{self._id}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8", opener=private_opener) as out:
                for o in owed.values():
                    out.write(json.dumps(_owed_record(o), separators=(",", ":")) + "\n")
                by_slot: dict[str, list[list[Any]]] = {}
                for (slot, key), (amount, expires) in sums.items():
                    by_slot.setdefault(slot, []).append([key, int(amount), expires])
                for slot, entries in by_slot.items():
                    user, notice = sum_notice.get(slot, ("", None))
                    out.write(json.dumps({"a": slot, "e": entries, "t": sum_tokens.get(slot, 0),
                                          "n": _notice_json(notice), "u": user},
                                         separators=(",", ":")) + "\n")
                out.flush()
                os.fsync(out.fileno())
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk: the old file stands, whole
            raise
        os.replace(tmp, self.path)
        self._reopen()
        self._unsaved.clear()  # everything memory holds is on disk now
        self._unsaved_sums.clear()
        self._unsaved_sum_tokens.clear()

    def _reopen(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = private_opener(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self._size = os.fstat(self._fd).st_size
        self._appended = 0

    def _adopt(self, lock_path: Path) -> None:
        """Take over a gone process's file: its owed settlements keep their ids; its sums are
        sealed under an id derived from its name, so adopting it twice (a crash between
        writing ours and deleting theirs) yields the same id, which the store applies once."""
        try:
            lock = open(lock_path, "a", opener=private_opener)  # noqa: SIM115  closed below
        except OSError:
            return
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return  # a live process holds it
            data = lock_path.with_suffix(".jsonl")
            loaded = _load(data)
            owed, sum_tokens = loaded.owed, loaded.tokens
            batch = hashlib.sha256(f"adopted:{data.name}".encode()).hexdigest()[:32]
            sealed = _seal(loaded.sums, sum_tokens, loaded.notices, batch)
            for o in [*owed.values(), *sealed.values()]:
                self._owed[o.res_id] = o
                self._append(_owed_record(o))
            if self._fd >= 0:
                os.fsync(self._fd)
            if owed or sealed:
                count, tokens = len(owed) + len(sum_tokens), sum(o.tokens for o in owed.values())
                log.warning("adopted %d settlements (%d tokens) owed by a previous run from %s",
                            count, tokens + sum(sum_tokens.values()), data)
            if loaded.bad:
                # Their usage cannot be read back: lost to the budgets (the ledger still has
                # the requests' rows). Loud, with where to look; the file is kept aside.
                self.bad_lines += len(loaded.bad)
                shown = ", ".join(map(str, loaded.bad[:_BAD_LINES_SHOWN]))
                more = len(loaded.bad) - _BAD_LINES_SHOWN
                log.error("skipped %d unreadable lines of the settlement spool %s (line %s%s): "
                          "the settlements they held are lost to the budgets; the file is kept "
                          "as %s", len(loaded.bad), data, shown,
                          f" and {more} more" if more > 0 else "", _kept_name(data))
                data.replace(_kept_name(data))
            data.unlink(missing_ok=True)
            lock_path.unlink(missing_ok=True)
        finally:
            lock.close()


def _sum_into(sums: dict[tuple[str, str], list[float]], tokens: dict[str, int], slot: str,
              debts: tuple[Debt, ...], count: int) -> None:
    for d in debts:
        acc = sums.get((slot, d.key))
        if acc is None:
            sums[(slot, d.key)] = [d.amount, d.expires_at]
        else:
            acc[0] += d.amount
            acc[1] = max(acc[1], d.expires_at)
    tokens[slot] = tokens.get(slot, 0) + count


def _kept_name(data: Path) -> Path:
    """Where an adopted file with unreadable lines is kept for an operator to look at (a name
    no process adopts: it does not end in `.jsonl`)."""
    return data.with_name(data.name + ".bad")


def _debts(entries: tuple[WindowAmount, ...], now: float) -> tuple[Debt, ...]:
    return tuple(Debt(e.key, e.amount, now + e.ttl_s) for e in entries)


def _owed_record(owed: Owed) -> dict[str, Any]:
    return {"o": owed.slot, "i": owed.res_id, "t": owed.tokens,
            "e": [[d.key, d.amount, d.expires_at] for d in owed.debts],
            "n": _notice_json(owed.notice), "u": owed.user, "k": owed.kind.value}


def _notice_json(notice: Window | None) -> dict[str, Any] | None:
    return notice.to_json() if notice is not None else None


def _notice(obj: Any) -> Window | None:
    """The threshold notice a record carries. A malformed one is dropped, not its record: the
    usage is what must reach the store; a notice is a courtesy."""
    if not isinstance(obj, dict):
        return None
    try:
        return Window.from_json(obj)
    except (KeyError, ValueError, TypeError):
        return None


def _seal(sums: dict[tuple[str, str], list[float]], tokens: dict[str, int],
          notices: dict[str, tuple[str, Window]], batch: str) -> dict[str, Owed]:
    debts: dict[str, list[Debt]] = {}
    for (slot, key), (amount, expires) in sums.items():
        debts.setdefault(slot, []).append(Debt(key, int(amount), expires))
    return {
        slot: Owed(slot, f"batch-{batch}-{hashlib.sha256(slot.encode()).hexdigest()[:8]}",
                   tuple(ds), tokens.get(slot, 0), *_notice_of(notices, slot))
        for slot, ds in debts.items()
    }


def _kind(value: object) -> SettleKind:
    try:
        return SettleKind(value)
    except ValueError:
        return SettleKind.ADDITION  # a line from before kinds: see `Owed.kind`


def _notice_of(notices: dict[str, tuple[str, Window]], slot: str) -> tuple[Window | None, str]:
    user, notice = notices.get(slot, ("", None))
    return notice, user


@dataclass(slots=True)
class _Loaded:
    """A spool file's state, replayed from its lines."""

    owed: dict[str, Owed] = field(default_factory=dict)
    sums: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    notices: dict[str, tuple[str, Window]] = field(default_factory=dict)
    bad: list[int] = field(default_factory=list)  # numbers (from 1) of the lines skipped


def _load(path: Path) -> _Loaded:
    """Replay a spool file. A line that is not a whole, valid record (garbled on disk, edited,
    cut by a crash mid-write) is skipped and its number kept: one bad line must not keep the
    file's other settlements, or the process, from starting."""
    loaded = _Loaded()
    with contextlib.suppress(FileNotFoundError), path.open("rb") as f:
        for number, line in enumerate(f, 1):
            try:
                _apply_line(loaded, json.loads(line))
            except (ValueError, TypeError, KeyError, OverflowError):
                loaded.bad.append(number)
    return loaded


def _apply_line(loaded: _Loaded, rec: Any) -> None:
    """One record into `loaded`, all or nothing; raises ValueError (or TypeError) when it is not
    a record this module writes."""
    if not isinstance(rec, dict):
        raise ValueError("not a record")
    if "o" in rec:
        owed = Owed(_text(rec["o"]), _text(rec["i"]), _debts_of(rec["e"]), _int(rec.get("t", 0)),
                    _notice(rec.get("n")), str(rec.get("u", "")), _kind(rec.get("k")))
        loaded.owed[owed.res_id] = owed
    elif "a" in rec:
        slot = _text(rec["a"])
        debts = _debts_of(rec["e"])
        tokens = _int(rec.get("t", 0))
        for d in debts:
            acc = loaded.sums.setdefault((slot, d.key), [0, 0.0])
            acc[0] += d.amount
            acc[1] = max(acc[1], d.expires_at)
        loaded.tokens[slot] = loaded.tokens.get(slot, 0) + tokens
        notice = _notice(rec.get("n"))
        if notice is not None:
            loaded.notices[slot] = (str(rec.get("u", "")), notice)
    elif "d" in rec:
        loaded.owed.pop(_text(rec["d"]), None)
    else:
        raise ValueError("no record kind")


def _debts_of(value: Any) -> tuple[Debt, ...]:
    if not isinstance(value, list):
        raise ValueError("entries are not a list")
    debts = []
    for item in value:
        if not isinstance(item, list) or len(item) != 3:
            raise ValueError("an entry is not [key, amount, expires_at]")
        key, amount, expires = item
        if isinstance(expires, bool) or not isinstance(expires, int | float) \
                or not math.isfinite(expires):
            raise ValueError("an entry's expiry is not a time")
        debts.append(Debt(_text(key), _int(amount), float(expires)))
    return tuple(debts)


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("not a name")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("not an integer")
    return value
