"""What hits are answered from, kept in the process so each is made once: the entries read
lately (`Hot`: a hit of an entry this process has read or made reads neither the store nor its
bytes again) and the forms hits were answered in (`Replays`: a stream entry is reassembled on
its first hit, some 110 ms of CPU for a 4 MB one, then every later hit of that entry, in any
form, starts from what was made). Each an LRU bounded in bytes (the cache's `memory_mb`, read
at each insert: a reload may change it). An entry's forms are keyed by its key and the time it
was made: a newer entry under the same key is another answer."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable

from proxy.cache.entry import Entry


class ReplayForm(enum.Enum):
    JSON = "json"  # the answer's JSON body (a stream entry's, reassembled)
    STREAM = "stream"  # the API's events
    STREAM_USAGE = "stream+usage"  # with OpenAI's usage chunk (`stream_options.include_usage`)


_Slot = tuple[str, float, ReplayForm]


class Replays:
    """Reads and writes are dict operations on the loop: no await, no lock needed."""

    def __init__(self, max_bytes: Callable[[], int]) -> None:
        self._max_bytes = max_bytes
        self._made: OrderedDict[_Slot, bytes] = OrderedDict()
        self.size = 0

    def get(self, key: str, created_at: float, form: ReplayForm) -> bytes | None:
        slot = (key, created_at, form)
        found = self._made.get(slot)
        if found is not None:
            self._made.move_to_end(slot)
        return found

    def put(self, key: str, created_at: float, form: ReplayForm, body: bytes) -> None:
        bound = self._max_bytes()
        if len(body) > bound:
            return
        slot = (key, created_at, form)
        old = self._made.pop(slot, None)
        if old is not None:
            self.size -= len(old)
        self._made[slot] = body
        self.size += len(body)
        while self.size > bound:
            _, dropped = self._made.popitem(last=False)
            self.size -= len(dropped)

    def __len__(self) -> int:
        return len(self._made)


class Hot:
    """Entries by key, as read from the store or made by this process. An entry is an answer
    valid until its TTL whoever reads it; a newer one made elsewhere under the same key (a
    `no-cache` refresh on another replica) is read here once this one is dropped (its TTL, or
    the LRU). Dict operations on the loop: no await, no lock."""

    def __init__(self, max_bytes: Callable[[], int]) -> None:
        self._max_bytes = max_bytes
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self.size = 0

    def get(self, key: str) -> Entry | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: str, entry: Entry) -> None:
        bound = self._max_bytes()
        self.drop(key)
        if entry.size > bound:
            return
        self._entries[key] = entry
        self.size += entry.size
        while self.size > bound:
            _, dropped = self._entries.popitem(last=False)
            self.size -= dropped.size

    def drop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.size -= old.size

    def __len__(self) -> int:
        return len(self._entries)
