"""The optional wings' view of a request: one interface, a few points in the request's life.

A wing (capture, the response cache's fill, the spans) reads a request without the pipeline
knowing it is there. `Services.observers` holds one factory per wing the configuration turns
on; each is asked once, as the request opens, and returns its observer for the request, or
None when its wing does not want it (capture off, tracing not started). The cache step adds
the fill of a miss the same way (`proxy.pipeline.caching`). The pipeline calls the points on
the request's `Observers`, whatever is in it: a request without observers pays a loop over an
empty tuple per point, and its stream's chunks nothing at all (`receiving` and `streaming` are
empty: the relay's loop is the one without observers).

An observer bounds its own work (bytes held, time) and never blocks the relay: what it cannot
keep, it drops and counts. A point must not raise: a wing's failure loses the wing's view of
the request, never the request or its books (`settled` is guarded once more by `settled`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, MutableMapping
from typing import Generic, Protocol, TypeVar

from proxy.errors import ErrorClass
from proxy.record import RequestRecord

log = logging.getLogger("tokenmeter.observers")


class _Request(Protocol):
    @property
    def request_id(self) -> str: ...


# The request's candidacy and settlement (`proxy.pipeline.context`, which holds the request's
# observers: named here by type variables, not imported).
Candidacy = TypeVar("Candidacy")
Settlement = TypeVar("Settlement", bound=_Request)


class RequestObserver(Generic[Candidacy, Settlement]):
    """One wing's observer of one request. Every point does nothing here: a wing overrides
    the points it reads. Points in the order a request passes them."""

    __slots__ = ()

    def sent(self, body: bytes) -> None:
        """The client's body, as read (an authenticated client's only)."""

    def forwarded(self, candidacy: Candidacy, body: bytes) -> None:
        """The body sent upstream to `candidacy` (each candidate: a fallback's after its
        primary's)."""

    def attempt_started(self, headers: MutableMapping[str, str], host: str,
                        port: int | None) -> None:
        """An attempt goes out now, with `headers` (a copy of its own: a wing may add to
        them)."""

    def attempt_answered(self, status: int, error_class: ErrorClass) -> None:
        """The attempt under way got an answer."""

    def attempt_ended(self, error_class: ErrorClass) -> None:
        """The attempt under way failed and is given up on (retried, handed to a fallback)."""

    def answered(self, status: int, body: bytes, headers: MutableMapping[str, str]) -> None:
        """A JSON answer (or a cache hit's replay), as the client gets it, before its
        `headers` go out: a wing may add one of its own."""

    def received(self, chunk: bytes) -> None:
        """A chunk of the upstream's stream as it came, before it is relayed."""

    def relayed(self) -> None:
        """The chunk last `received` is relayed: the relay reads the upstream again."""

    def streamed(self, data: bytes, at_ms: float) -> None:
        """Bytes of a stream as written to the client, `at_ms` after the upstream request
        was sent (a cache hit's replay: 0)."""

    def finished(self, done: Settlement) -> None:
        """The request is over, its facts frozen; settling starts."""

    def settled(self, done: Settlement, record: RequestRecord) -> None:
        """The request's record, once its row is handed to the books."""


def _overrides(observer: object, point: str) -> bool:
    return getattr(type(observer), point) is not getattr(RequestObserver, point)


class Observers(Generic[Candidacy, Settlement]):
    """The observers of one request: each point handed to every one of them. `receiving` and
    `streaming` are those that read a stream's chunks, so a stream nobody reads runs the
    relay's loop without them."""

    __slots__ = ("all", "receiving", "streaming")

    def __init__(self, observers: Iterable[RequestObserver[Candidacy, Settlement]] = ()
                 ) -> None:
        self.all = tuple(observers)
        self.receiving = tuple(o for o in self.all
                               if _overrides(o, "received") or _overrides(o, "relayed"))
        self.streaming = tuple(o for o in self.all if _overrides(o, "streamed"))

    def adding(self, observer: RequestObserver[Candidacy, Settlement] | None
               ) -> Observers[Candidacy, Settlement]:
        """These and `observer` (a factory's answer: None adds nothing)."""
        return self if observer is None else Observers((*self.all, observer))

    def __bool__(self) -> bool:
        return bool(self.all)

    def sent(self, body: bytes) -> None:
        for o in self.all:
            o.sent(body)

    def forwarded(self, candidacy: Candidacy, body: bytes) -> None:
        for o in self.all:
            o.forwarded(candidacy, body)

    def attempt_started(self, headers: MutableMapping[str, str], host: str,
                        port: int | None) -> None:
        for o in self.all:
            o.attempt_started(headers, host, port)

    def attempt_answered(self, status: int, error_class: ErrorClass) -> None:
        for o in self.all:
            o.attempt_answered(status, error_class)

    def attempt_ended(self, error_class: ErrorClass) -> None:
        for o in self.all:
            o.attempt_ended(error_class)

    def answered(self, status: int, body: bytes, headers: MutableMapping[str, str]) -> None:
        for o in self.all:
            o.answered(status, body, headers)

    def received(self, chunk: bytes) -> None:
        for o in self.receiving:
            o.received(chunk)

    def relayed(self) -> None:
        for o in self.receiving:
            o.relayed()

    def streamed(self, data: bytes, at_ms: float) -> None:
        for o in self.streaming:
            o.streamed(data, at_ms)

    def stream_writer(self) -> Callable[[bytes, float], None]:
        """`streamed`, as the relay calls it per write: the one observer's own method when
        there is one (no loop per chunk)."""
        return self.streaming[0].streamed if len(self.streaming) == 1 else self.streamed

    def finished(self, done: Settlement) -> None:
        for o in self.all:
            o.finished(done)

    def settled(self, done: Settlement, record: RequestRecord) -> None:
        """Each observer's own failure is its own: logged, and the next one still runs."""
        for o in self.all:
            try:
                o.settled(done, record)
            except Exception:
                log.exception("an observer of request %s failed as it settled (%s)",
                              done.request_id, type(o).__name__)

