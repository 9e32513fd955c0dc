"""One stored answer: the complete, non-streamed answer in its API's JSON form, the usage it
reported (what a hit saves), and when it was made. Stored as compact JSON bytes."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from proxy.protocol.usage import Usage

_VERSION = 1
_USAGE_FIELDS = tuple(f.name for f in fields(Usage))  # asdict() deep-copies: 10x slower


class EntryUnreadable(ValueError):
    """Bytes from the store that are not an entry of this version (a miss)."""


@dataclass(frozen=True, slots=True)
class Entry:
    operation: str  # the API shape's (`chat`, `messages`, ...): how it is replayed
    answer: dict[str, Any]  # the JSON answer as a non-streamed request would have had it
    usage: Usage
    created_at: float  # epoch seconds, by the cache's clock
    size: int = 0  # its bytes as stored, once read back (0: not read from a store)

    def encode(self) -> bytes:
        return json.dumps(
            {"v": _VERSION, "operation": self.operation, "answer": self.answer,
             "usage": {f: getattr(self.usage, f) for f in _USAGE_FIELDS},
             "created_at": self.created_at},
            separators=(",", ":"), ensure_ascii=False,
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Entry:
        try:
            obj = json.loads(raw)
            if obj.get("v") != _VERSION:
                raise EntryUnreadable("another version")
            usage = Usage(**obj["usage"])
            answer = obj["answer"]
            if not isinstance(answer, dict):
                raise EntryUnreadable("no answer")
            return cls(str(obj["operation"]), answer, usage, float(obj["created_at"]), len(raw))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise EntryUnreadable(str(exc)) from None
