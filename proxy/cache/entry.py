"""One stored answer: the answer as the upstream sent it (its JSON body, or its stream), the
usage it reported (what a hit saves), and when it was made.

Stored as one line of JSON (version, operation, form, usage, time) then the payload's bytes as
they are: a miss stores what it already holds, with no parse or re-encoding on its path (the
cost every miss would pay on a workload that never hits). A hit pays instead: a stream is
reassembled into its answer there, once per hit (`answer`). A stream is kept uncompressed:
zlib's fastest level costs some 4 us per KB, 5% of a request's CPU on its own; its events carry
some 10-40 times the bytes of their text, which the stores' bounds (`memory_mb`, Redis's
`maxmemory`) count as they are."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields
from typing import Any

from proxy.protocol.codecs import codec_for
from proxy.protocol.usage import Usage

_VERSION = 2
_USAGE_FIELDS = tuple(f.name for f in fields(Usage))  # asdict() deep-copies: 10x slower


# The operations whose answers the cache stores: those whose codec tells an answer that ended by
# itself from a cut one, and replays it as the stream a client of the API expects.
OPERATIONS = frozenset({"chat", "text_completion", "messages"})


class EntryUnreadable(ValueError):
    """Bytes from the store that are not an entry of this version (a miss)."""


class Form(enum.StrEnum):
    """What an entry's payload is."""

    JSON = "json"  # the answer's JSON body (as the upstream sent it, or redacted)
    STREAM = "stream"  # the upstream's event stream as it came


@dataclass(frozen=True, slots=True)
class Entry:
    operation: str  # the API shape's (`chat`, `messages`, ...): how it is replayed
    form: Form
    payload: bytes  # the answer's bytes
    usage: Usage
    created_at: float  # epoch seconds, by the cache's clock
    size: int = 0  # its bytes as stored, once encoded or read back

    def encode(self) -> bytes:
        # json.dumps escapes any newline: the first b"\n" ends the head.
        head = json.dumps(
            {"v": _VERSION, "operation": self.operation, "form": self.form.value,
             "usage": {f: getattr(self.usage, f) for f in _USAGE_FIELDS},
             "created_at": self.created_at},
            separators=(",", ":"),
        ).encode()
        return head + b"\n" + self.payload

    @classmethod
    def decode(cls, raw: bytes) -> Entry:
        head, newline, payload = raw.partition(b"\n")
        try:
            if not newline:
                raise EntryUnreadable("no head")
            obj = json.loads(head)
            if obj.get("v") != _VERSION:
                raise EntryUnreadable("another version")
            return cls(str(obj["operation"]), Form(obj["form"]), payload, Usage(**obj["usage"]),
                       float(obj["created_at"]), len(raw))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise EntryUnreadable(str(exc)) from None

    def answer(self) -> dict[str, Any] | None:
        """The answer in its JSON form (a stream reassembled), or None if it is not one."""
        codec = codec_for(self.operation)
        if self.form is Form.JSON:
            return codec.answer_of(self.payload)
        return codec.assemble_stream(self.payload)
