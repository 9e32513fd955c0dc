"""What is known about one request while it runs: filled in along the way, read once at settling."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.auth import Principal
from proxy.budget import Reservation
from proxy.meter import RequestMeter
from proxy.state import Runtime
from proxy.translators import Translator
from proxy.upstream import Route


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
