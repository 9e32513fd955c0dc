"""Hot reload of the configuration file: on change (polled) and on SIGHUP.

A new version is parsed, validated and built whole (keys hashed and indexed, routes, prices) in
a worker thread, off the event loop: with 10,000 users that takes seconds, and the loop keeps
serving meanwhile. Only then is the app's `Runtime` swapped, on the loop, in one assignment, so
a request in flight finishes under the version it started with and the next one sees the new
one. An invalid file is refused, logged and counted, and the previous version keeps serving.

Reloads are coalesced: one build runs at a time, and any number of SIGHUPs or file changes
while it runs lead to at most one more, of the file as it is when that one starts.

A changed file is loaded only once two consecutive polls read the same bytes (and size and
mtime): an editor or `cat > file` writes in steps, and a file cut after some users still
parses, so a half-written version could otherwise drop keys for a moment. SIGHUP loads at once.

The store settings (`store:`) are read once at start: a reload keeps the running ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from proxy.config.load import Config, ConfigError, collector_paused, parse_config
from proxy.telemetry.metrics import Metrics

log = logging.getLogger("tokenmeter.reload")

# A change is seen within one poll and loaded on the next: within half a second.
POLL_SECONDS = 0.25

T = TypeVar("T")  # what a configuration is built into (the app's `Runtime`)


class _SwitchInterval:
    """The GIL handed over every 0.2 ms instead of every 5 while a reload's thread works.

    The loop gives the GIL up at each socket call and wait; with a build holding it in
    between, each take-back cost up to the 5 ms default, several per request (requests took
    30-60 ms during a build instead of 3-8). Counted, so overlapping users restore it once."""

    INTERVAL_S = 0.0002

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._saved = 0.0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._running == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(self.INTERVAL_S)
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    sys.setswitchinterval(self._saved)


_switching_often = _SwitchInterval()


class Poll(enum.Enum):
    """What one look at the file did."""

    UNCHANGED = "unchanged"  # the version already loaded (or already refused)
    MISSING = "missing"  # unreadable right now (e.g. mid-replace): nothing changes
    SETTLING = "settling"  # new content, not yet seen twice alike: maybe still being written
    APPLIED = "applied"
    REFUSED = "refused"  # complete but invalid: the previous version keeps serving


@dataclass(frozen=True, slots=True)
class _Snapshot:
    digest: bytes
    size: int
    mtime_ns: int


def keep_running_store(config: Config, running: Config) -> Config:
    """`config` with the running `store:` and `ledger:` sections, warning about any field it
    changes.

    Both are set up once at start: switching the store's prefix mid-day would start every
    budget from zero, and the ledger's spool and database are open; changes wait for a restart."""
    for section in ("store", "ledger"):
        new, old = getattr(config, section), getattr(running, section)
        if new == old:
            continue
        changed = [f for f in type(old).model_fields if getattr(new, f) != getattr(old, f)]
        # Field names only: a URL can carry a password.
        log.warning(
            "%s settings changed (%s); they take effect on restart, the running ones are kept",
            section, ", ".join(f"{section}.{f}" for f in changed),
        )
        config = config.model_copy(update={section: old})
    return config


class ConfigWatcher(Generic[T]):
    """Polls the file and reloads it; `prepare` builds what a configuration is served with
    (in a worker thread: seconds for 10,000 users), `install` swaps it in (on the loop, at
    once) and returns the version it replaced. Either may refuse the configuration with a
    `ConfigError`. A replaced version is kept until no request holds it any more, then
    `release`d piece by piece in a worker thread: dropped whole, its million objects would be
    freed in one cascade that holds the GIL, and so the loop, for 400 ms."""

    def __init__(self, path: Path, prepare: Callable[[Config], T], install: Callable[[T], T],
                 release: Callable[[T], None], metrics: Metrics) -> None:
        self.path = path
        self._prepare = prepare
        self._install = install
        self._release = release
        self._retired: list[T] = []
        self._metrics = metrics
        read = self._read()
        # The digest of the version last loaded or refused: not looked at again until it changes.
        self._seen: bytes | None = read[1].digest if read is not None else None
        self._pending: _Snapshot | None = None  # new content seen on the last poll
        self._forced = False
        self._changed = asyncio.Event()
        # One poll, and so one build, at a time: what is asked for while a build runs (a storm
        # of SIGHUPs, files written) is one more poll after it, which reads the file as it is
        # then. Builds are never queued one per signal.
        self._polling = asyncio.Lock()

    def _read(self) -> tuple[bytes, _Snapshot] | None:
        try:
            with self.path.open("rb") as f:
                data = f.read()
                st = os.fstat(f.fileno())
        except OSError:
            return None
        return data, _Snapshot(hashlib.sha256(data).digest(), st.st_size, st.st_mtime_ns)

    def request_reload(self) -> None:
        """SIGHUP: load on the next poll, at once, even if the content looks unchanged (e.g. an
        environment variable it names changed). Only sets a flag: safe to call in any number."""
        self._forced = True
        self._changed.set()

    async def poll_once(self) -> Poll:
        """One look at the file; the run loop calls this every POLL_SECONDS (tests call it)."""
        async with self._polling:
            forced, self._forced = self._forced, False
            # Off the loop: the file may be megabytes, read and hashed four times a second.
            read = await asyncio.to_thread(self._read)
            if read is None:
                self._pending = None
                if forced:  # asked for by SIGHUP: say why nothing happened
                    self._metrics.config_reloaded(ok=False)
                    log.error("configuration reload refused: cannot read %s", self.path)
                return Poll.MISSING
            data, snap = read
            if not forced:
                if snap.digest == self._seen:
                    self._pending = None
                    return Poll.UNCHANGED
                if snap != self._pending:
                    self._pending = snap
                    return Poll.SETTLING
            self._pending = None
            self._seen = snap.digest
            return Poll.APPLIED if await self._load(data) else Poll.REFUSED

    def _build(self, data: bytes) -> T:
        """In a worker thread. The very bytes that were seen stable are parsed: no second read
        that could differ."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{self.path}: not UTF-8: {exc.reason}") from None
        with _switching_often(), collector_paused():
            built = self._prepare(parse_config(text, str(self.path)))
            # As at start (app._settle_heap): the new version's objects (a million for 10,000
            # users) out of the collector's sight before it runs again, or each full
            # collection would walk them all, holding the loop for 200 ms or more. It has no
            # cycles: freed by reference counting when replaced in turn, frozen or not.
            gc.freeze()
        return built

    def _release_off_loop(self, version: T) -> None:
        with _switching_often():
            self._release(version)

    async def _load(self, data: bytes) -> bool:
        started = time.monotonic()
        try:
            built = await asyncio.to_thread(self._build, data)
            self._retired.append(self._install(built))
        except ConfigError as exc:
            self._metrics.config_reloaded(ok=False)
            log.error("configuration reload refused, the previous version keeps serving: %s", exc)
            return False
        self._metrics.config_reloaded(ok=True)
        log.info("configuration reloaded from %s in %.2f s", self.path,
                 time.monotonic() - started)
        return True

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), POLL_SECONDS)
            self._changed.clear()
            await self.poll_once()
            await self.release_retired()

    async def release_retired(self) -> None:
        """Release the replaced versions that nothing but this list holds any more (a request
        in flight holds the version it started with until it ends)."""
        for version in list(self._retired):
            # References: this list, the loop variable, the copy of the list and the argument.
            if sys.getrefcount(version) <= 4:
                self._retired.remove(version)
                await asyncio.to_thread(self._release_off_loop, version)
