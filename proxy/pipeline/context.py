"""What one request knows, split by lifetime.

- `RequestContext` (frozen): what admission established once: the id, the configuration the
  request runs under, who is asking, the parsed body, the model the client asked for.
- `Attempt` (frozen): one upstream candidate that answered: its route and model, the API shape's
  translator, its reservation, the response, its deadline and the headers the client gets.
- `Outcome`: the one mutable object of a request, owned by its handler: the facts that accumulate
  (status, error class, attempts made, whether the upstream has the request) and which attempt
  is current. Each step records into it through a method; `finish()` freezes it into the
  `Settlement` that settle reads. What the request is charged is decided there (a `Charge`);
  the tokens are counted by settle, off the loop when they must be counted at all.

Models are named as the OpenTelemetry GenAI conventions do: `request_model` (asked by the
client), `Candidacy.model` (sent upstream, a fallback's when one serves) and `response_model`
(the model the upstream's answer names, read by its translator; logged and booked, while the
answer's body reaches the client untouched).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from proxy.budget.accounting import Reservation
from proxy.budget.principal import Principal
from proxy.cache import cache as response_cache
from proxy.cache.cache import Decision
from proxy.config.tags import NO_TAGS, Tags
from proxy.errors import ErrorClass
from proxy.pipeline import counting
from proxy.pipeline import observers as watching
from proxy.pipeline.services import Opening, Runtime
from proxy.protocol.translators import ParsedRequest, Translator
from proxy.protocol.usage import ZERO, Usage
from proxy.record import NOT_CONSULTED, CacheOutcome
from proxy.routing.upstream import Route
from proxy.telemetry.meter import RequestMeter

# A request nothing observes (proxy.pipeline.observers).
NO_OBSERVERS: watching.Observers[Candidacy, Settlement] = watching.Observers()

# A request whose client left: it cannot have read an answer, whatever the upstream did.
CLIENT_GONE = frozenset({ErrorClass.CLIENT_DISCONNECT, ErrorClass.CLIENT_TIMEOUT})


@dataclass(frozen=True, slots=True)
class RequestContext:
    request_id: str
    operation: str
    runtime: Runtime
    principal: Principal
    request: ParsedRequest
    route: Route  # the route of the model asked for

    @property
    def request_model(self) -> str:
        return self.request.model

    @property
    def stream(self) -> bool:
        return self.request.stream


@dataclass(frozen=True, slots=True)
class Candidacy:
    """An attempt under way: reserved, not yet answered. Settle needs it if the call fails."""

    route: Route
    model: str  # sent upstream
    translator: Translator
    reservation: Reservation


@dataclass(frozen=True, slots=True)
class Attempt:
    """The attempt whose answer is relayed."""

    candidacy: Candidacy
    response: aiohttp.ClientResponse
    deadline: float | None  # loop time: the total cap of a non-streaming request
    response_headers: dict[str, str]

    @property
    def translator(self) -> Translator:
        return self.candidacy.translator

    @property
    def route(self) -> Route:
        return self.candidacy.route


class Charge(enum.Enum):
    """What a request is charged."""

    NOTHING = "nothing"  # no attempt, an error answer, or a call that never reached the model
    ANSWER = "answer"  # an answer read, whole or in part: its usage, reported or counted
    PROMPT = "prompt"  # abandoned by its client while the upstream had it: its prompt


@dataclass(frozen=True, slots=True)
class Settlement:
    """Everything settle needs, frozen once the request is over."""

    request_id: str
    operation: str
    runtime: Runtime | None
    principal: Principal | None
    request_model: str
    stream: bool
    candidacy: Candidacy | None
    status: int
    error_class: ErrorClass
    charge: Charge
    meter: RequestMeter
    fallback_from: str | None
    attempts: int
    cache: CacheOutcome = NOT_CONSULTED  # what the response cache did
    tags: Tags = NO_TAGS  # the request's tags, its caller's defaults under them
    observers: Observers = NO_OBSERVERS  # the wings that observe it
    # A cache hit's admission (`Budget.reserve_hit`): what it holds until settled.
    hit_reservation: Reservation | None = None
    # The upstream's own id of the answer relayed (its `x-request-id` / `request-id`).
    upstream_request_id: str | None = None

    @property
    def model(self) -> str:
        """The model that served (or was last tried), else the one asked for."""
        return self.candidacy.model if self.candidacy is not None else self.request_model

    @property
    def route(self) -> Route | None:
        return self.candidacy.route if self.candidacy is not None else None

    @property
    def response_model(self) -> str | None:
        """The model the upstream's answer names, when it named one."""
        return self.candidacy.translator.response_model if self.candidacy is not None else None

    async def usage(self) -> Usage:
        """What the request is charged (see `Charge`): the upstream's usage, else an estimate
        counted off the loop (the prompt reuses admission's count if it made one)."""
        if self.candidacy is None or self.charge is Charge.NOTHING:
            return ZERO
        translator = self.candidacy.translator
        if self.charge is Charge.ANSWER:
            return await counting.answer_usage(translator)
        return await counting.prompt_usage(translator)


# One wing's observer of a request, the request's observers, and a wing's factory of them
# (`Services.observers`): proxy.pipeline.observers, of this module's request.
RequestObserver = watching.RequestObserver[Candidacy, Settlement]
Observers = watching.Observers[Candidacy, Settlement]
ObserverFactory = Callable[[Opening], RequestObserver | None]


def opened(factories: Iterable[Callable[[Opening], object]], opening: Opening) -> Observers:
    """The observers the wings' factories make for a request as it opens."""
    made = [o for o in (make(opening) for make in factories)
            if isinstance(o, watching.RequestObserver)]
    return Observers(made) if made else NO_OBSERVERS


class Outcome:
    """The mutable facts of one request, written only through these methods."""

    __slots__ = ("_answered", "_attempts", "_candidacy", "_context", "_error_class",
                 "_fallback_from", "_hit", "_in_flight", "_model", "_principal", "_status",
                 "_stream", "_tags", "_upstream_request_id", "cache", "meter", "observers",
                 "operation", "request_id", "runtime")

    def __init__(self, request_id: str, operation: str, meter: RequestMeter) -> None:
        self.request_id = request_id
        self.operation = operation
        self.meter = meter
        self.runtime: Runtime | None = None
        # The wings that observe the request (proxy.pipeline.observers): the steps call its
        # points as the request passes them.
        self.observers = NO_OBSERVERS
        # What the response cache decided for the request (docs/cache.md): its result, which
        # the record books (a miss's fill observes the request: proxy.pipeline.caching); set
        # by the pipeline's cache step.
        self.cache: Decision = response_cache.NOT_CONSULTED
        self._principal: Principal | None = None
        self._model = ""
        self._stream = False
        self._context: RequestContext | None = None
        self._candidacy: Candidacy | None = None
        self._status = 500
        self._error_class = ErrorClass.NONE
        self._answered = False
        self._in_flight = False
        self._fallback_from: str | None = None
        self._attempts = 1
        self._tags = NO_TAGS
        self._hit: Reservation | None = None
        self._upstream_request_id: str | None = None

    # --- admission: known before the context is complete, needed if admission fails -----
    def configured(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def read(self, request: ParsedRequest) -> None:
        self._model, self._stream = request.model, request.stream

    def authenticated(self, principal: Principal) -> None:
        self._principal = principal

    def tagged(self, tags: Tags) -> None:
        self._tags = tags

    def observe(self, observers: Observers) -> None:
        self.observers = observers

    def admitted(self, context: RequestContext) -> None:
        self._context = context

    def cache_decided(self, decision: Decision) -> None:
        self.cache = decision

    def served_from_cache(self, reservation: Reservation) -> None:
        """A hit: the answer goes out without an upstream call (no candidacy), admitted by
        the budget like any request (`reservation`: held until settled)."""
        self._answered = True
        self._status = 200
        self._hit = reservation

    def not_served_from_cache(self) -> None:
        """The hit's entry held no answer (its reservation given back): a miss after all."""
        self._answered = False
        self._status = 500
        self._hit = None

    # --- attempts -----------------------------------------------------------------------
    def candidate(self, candidacy: Candidacy, fallback_from: str | None) -> None:
        self._candidacy = candidacy
        if fallback_from is not None:
            self._fallback_from = fallback_from

    def released(self) -> None:
        """The current candidate failed before answering and gave its reservation back."""
        self._candidacy = None
        self._attempts += 1
        self._in_flight = False

    def sent(self) -> None:
        self._in_flight = True

    def retried(self) -> None:
        self._in_flight = False
        self._attempts += 1

    def call_failed(self) -> None:
        self._in_flight = False

    def answered(self, status: int, error_class: ErrorClass,
                 upstream_request_id: str | None = None) -> None:
        """The answer to relay came, its class decided once as it did (`attempts.Answer`),
        with the upstream's id of it, when it sent one."""
        self._answered = True
        self._upstream_request_id = upstream_request_id
        self._status = status
        self._error_class = error_class
        # An error answer means the upstream is done with the request.
        self._in_flight = status < 300

    # --- the end ------------------------------------------------------------------------
    def fail(self, error_class: ErrorClass, status: int | None = None) -> None:
        self._error_class = error_class
        if status is not None:
            self._status = status

    def client_left(self) -> None:
        """The client went away (or was cut off for not reading): the status stays what the
        upstream answered, if it did; else 499."""
        if self._error_class is not ErrorClass.CLIENT_TIMEOUT:  # the proxy cut it: finer
            self._error_class = ErrorClass.CLIENT_DISCONNECT
        if not self._answered:
            self._status = 499

    @property
    def error_class(self) -> ErrorClass:
        return self._error_class

    @property
    def fallback_from(self) -> str | None:
        return self._fallback_from

    @property
    def attempts(self) -> int:
        """Upstream calls made so far, retries and fallbacks included."""
        return self._attempts

    def charge(self) -> Charge:
        """What the request is charged. An answer read, whole or in part, is charged by its
        translator: the upstream's usage, else an estimate of what was streamed. A request its
        client abandoned while the upstream had it is charged its prompt, estimated: the
        upstream has read it, and whatever it generated never reached anyone."""
        if self._candidacy is None:
            return Charge.NOTHING
        if self._answered and self._status < 300:
            return Charge.ANSWER
        if self._in_flight and self._error_class in CLIENT_GONE:
            return Charge.PROMPT
        return Charge.NOTHING

    def finish(self) -> Settlement:
        self.meter.finish()
        principal = self._context.principal if self._context else self._principal
        return Settlement(
            request_id=self.request_id,
            operation=self.operation,
            runtime=self.runtime,
            principal=principal,
            request_model=self._model,
            stream=self._stream,
            candidacy=self._candidacy,
            status=self._status,
            error_class=self._error_class,
            charge=self.charge(),
            meter=self.meter,
            fallback_from=self._fallback_from,
            attempts=self._attempts,
            observers=self.observers,
            tags=self._tags,
            cache=self.cache.outcome(),
            hit_reservation=self._hit,
            upstream_request_id=self._upstream_request_id,
        )
