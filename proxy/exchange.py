"""What is known about one request while it runs: filled in along the way, read once at settling."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.auth import Principal
from proxy.budget import Reservation
from proxy.meter import RequestMeter
from proxy.state import Runtime
from proxy.translators import Translator
from proxy.upstream import Route
from proxy.usage import ZERO, Usage

# A request whose client left: it cannot have read an answer, whatever the upstream did.
CLIENT_GONE = frozenset({"client_disconnect", "client_timeout"})


@dataclass(slots=True)
class Exchange:
    """Mutable facts about one request, filled in as it goes and read once when settling."""

    request_id: str
    operation: str
    meter: RequestMeter
    model: str = ""
    stream: bool = False
    runtime: Runtime | None = None
    principal: Principal | None = None
    route: Route | None = None
    translator: Translator | None = None
    reservation: Reservation | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    status: int = 500
    error_class: str = "none"
    upstream_answered: bool = False
    fallback_from: str | None = None
    attempts: int = 1
    deadline: float | None = None  # loop time: the total cap of a non-streaming request
    # The upstream has the request: sent, and not answered with an error (it then has read
    # the prompt, or is reading it).
    in_flight: bool = False

    def usage(self) -> Usage:
        """What the request is charged. An answer read, whole or in part, is charged by its
        translator: the upstream's usage, else an estimate of what was streamed. A request its
        client abandoned while the upstream had it is charged its prompt, estimated: the
        upstream has read it, and whatever it generated never reached anyone."""
        translator = self.translator
        if translator is None:
            return ZERO
        if self.upstream_answered and self.status < 300:
            return translator.usage()
        if self.in_flight and self.error_class in CLIENT_GONE:
            return translator.prompt_usage()
        return ZERO
