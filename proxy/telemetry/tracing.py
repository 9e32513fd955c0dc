"""OpenTelemetry traces: one SERVER span per request, one CLIENT span per upstream attempt.

Off by default and free when off: nothing here imports the OpenTelemetry SDK until tracing is
enabled (`tracing:` or the standard `OTEL_*` variables, `Tracing.of`), and the pipeline holds
`None` instead of a `RequestTrace`, so a request pays one attribute check.

When on, a request's server span continues the client's W3C `traceparent` (it is the child of
the client's span), each attempt's client span is the server span's child, and the upstream is
sent a `traceparent` naming that client span: retries and fallbacks show as sibling client
spans. The spans' attributes follow the OpenTelemetry GenAI semantic conventions
(`gen_ai.*`) plus tokenmeter's own (`tokenmeter.*`); they are read from the request's
`RequestRecord` (made once, by settle) and from what the routing knew of each attempt, never
from prompt or answer text, never a key. The server span ends when the request is settled:
for a stream, after its last byte. Spans go to a `BatchSpanProcessor` (a bounded queue and a
thread of its own: export is off the request path, and a full queue drops spans rather than
delay a request); shutdown flushes it (`Tracing.stop`, from the server's cleanup).
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.config.tracing import TracingConfig, TracingProtocol
from proxy.cost import NANOS_PER_USD
from proxy.errors import ErrorClass
from proxy.telemetry.metrics import RequestRecord

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer

log = logging.getLogger("tokenmeter.tracing")

# Model names are the client's text: a span carries at most this much of one.
_MAX_NAME = 256


class BudgetDecision(enum.StrEnum):
    """`tokenmeter.budget.decision`: what the budget made of the request's (last) candidate."""

    NONE = "none"  # the request ended before the budget was asked
    ADMITTED = "admitted"  # reserved as asked
    CLAMPED = "clamped"  # admitted with a lower output cap than the request asked for
    REFUSED = "refused"  # a 429 of the budget's
    UNENFORCED = "unenforced"  # admitted while the store was unreachable (on_error: fail_open)


# The proxy's operations as GenAI `gen_ai.operation.name` values; the Responses API and
# Anthropic's Messages are chat. An operation the conventions do not name keeps its own name.
_OPERATIONS = {"chat": "chat", "responses": "chat", "messages": "chat",
               "text_completion": "text_completion", "embeddings": "embeddings"}


@dataclass(frozen=True, slots=True)
class Target:
    """One candidate as its client spans name it: the model sent, who serves it, and the
    output cap the proxy wrote into its body (None: the client's own, unchanged)."""

    model: str
    provider: str  # gen_ai.provider.name: the upstream's API (openai, anthropic)
    upstream: str  # its configured name
    max_tokens: int | None


@dataclass(frozen=True, slots=True)
class _Kit:
    """The SDK's parts a request uses, imported and made once, by `Tracing.start`."""

    tracer: Tracer
    propagator: TextMapPropagator
    in_context: Callable[[Span], Context]  # opentelemetry.trace.set_span_in_context
    server: SpanKind
    client: SpanKind
    error: StatusCode


class RequestTrace:
    """The spans of one request. The pipeline and the routing call it at fixed points; it
    never raises into them (the SDK does not raise) and holds no prompt or answer text."""

    __slots__ = ("_context", "_kit", "_open", "_operation", "_server", "_target")

    def __init__(self, kit: _Kit, operation: str, server: Span) -> None:
        self._kit = kit
        self._operation = operation  # gen_ai.operation.name
        self._server = server
        self._context = kit.in_context(server)  # every client span's parent
        self._target: Target | None = None
        self._open: Span | None = None  # the attempt under way, or the one that answered

    def candidate(self, target: Target) -> None:
        """The next attempts go to `target` (a fallback's, after the primary's)."""
        self._target = target

    def attempt_started(self, headers: MutableMapping[str, str], host: str,
                        port: int | None) -> None:
        """An attempt goes out now, to `host`:`port`: its client span starts (the previous
        one, if still open, ends) and `headers` get the `traceparent` that names it."""
        self._end_open()
        target, kit = self._target, self._kit
        attributes: dict[str, Any] = {"gen_ai.operation.name": self._operation,
                                      "server.address": host}
        if port is not None:
            attributes["server.port"] = port
        name = self._operation
        if target is not None:
            name = f"{self._operation} {_short(target.model)}"
            attributes.update({
                "gen_ai.provider.name": target.provider,
                "gen_ai.request.model": _short(target.model),
                "tokenmeter.upstream": target.upstream,
            })
            if target.max_tokens is not None:
                attributes["gen_ai.request.max_tokens"] = target.max_tokens
        span = kit.tracer.start_span(name, self._context, kit.client, attributes)
        self._open = span
        # W3C traceparent, written out: the propagator's inject does the same in 4x the time
        # (it validates what the SDK just made). A client's `tracestate` is forwarded as it
        # came, which is also what the propagator would send (the span inherits it).
        ids = span.get_span_context()
        headers["traceparent"] = f"00-{ids.trace_id:032x}-{ids.span_id:016x}-{ids.trace_flags:02x}"

    def attempt_answered(self, status: int, error_class: ErrorClass) -> None:
        """The attempt under way got an answer: its status and class (the span stays open: it
        ends with the next attempt, or at settle when its answer is the one relayed)."""
        if (span := self._open) is not None:
            if error_class is ErrorClass.NONE:
                span.set_attribute("http.response.status_code", status)
            else:
                span.set_attributes({"http.response.status_code": status,
                                     "error.type": error_class.value})
                span.set_status(self._kit.error)

    def attempt_ended(self, error_class: ErrorClass) -> None:
        """The attempt under way failed and is given up on (retried, handed to a fallback)."""
        if (span := self._open) is not None:
            span.set_attribute("error.type", error_class.value)
            span.set_status(self._kit.error)
            self._end_open()

    def settle(self, record: RequestRecord, decision: BudgetDecision) -> None:
        """The request is over: the spans still open get the record's figures and end. Each
        span's attributes are set in one call (the SDK takes a lock and checks each value)."""
        usage = _usage(record)
        failed = record.error_class is not ErrorClass.NONE
        if (span := self._open) is not None:  # the attempt whose answer was relayed, or the last
            attributes = dict(usage)
            if (ttft := record.figures.upstream_ttft) is not None:
                attributes["gen_ai.response.time_to_first_chunk"] = ttft
            if failed:
                attributes["error.type"] = record.error_class.value
                span.set_status(self._kit.error)
            span.set_attributes(attributes)
            self._end_open()
        server = self._server
        server.update_name(f"{self._operation} {_short(record.requested_model)}")
        attributes = _server_attributes(record, decision)
        attributes.update(usage)
        if (target := self._target) is not None:
            attributes["gen_ai.provider.name"] = target.provider
            if target.max_tokens is not None:
                attributes["gen_ai.request.max_tokens"] = target.max_tokens
        if failed:
            attributes["error.type"] = record.error_class.value
            server.set_status(self._kit.error)
        server.set_attributes(attributes)
        server.end()

    def _end_open(self) -> None:
        if self._open is not None:
            self._open.end()
            self._open = None


def _short(text: str) -> str:
    return text if len(text) <= _MAX_NAME else text[:_MAX_NAME]


def _usage(record: RequestRecord) -> dict[str, Any]:
    """What the server span and the relayed attempt's client span both carry: the usage as
    charged (a cache or reasoning figure only when there is one) and the answer's model."""
    usage = record.usage
    attributes: dict[str, Any] = {"gen_ai.usage.input_tokens": usage.input_tokens,
                                  "gen_ai.usage.output_tokens": usage.output_tokens}
    if usage.cached_input_tokens:
        attributes["gen_ai.usage.cache_read.input_tokens"] = usage.cached_input_tokens
    if usage.cache_creation_input_tokens:
        attributes["gen_ai.usage.cache_creation.input_tokens"] = (
            usage.cache_creation_input_tokens)
    if usage.reasoning_tokens:
        attributes["gen_ai.usage.reasoning.output_tokens"] = usage.reasoning_tokens
    if record.response_model is not None:
        attributes["gen_ai.response.model"] = _short(record.response_model)
    return attributes


def _server_attributes(record: RequestRecord, decision: BudgetDecision) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.request.model": _short(record.requested_model),
        "http.response.status_code": record.status,
        "tokenmeter.request_id": record.request_id,
        "tokenmeter.user": record.user,
        "tokenmeter.error_class": record.error_class.value,
        "tokenmeter.budget.decision": decision.value,
        "tokenmeter.attempts": record.attempts,
    }
    if (ttft := record.figures.ttft) is not None:  # a stream's
        attributes["gen_ai.response.time_to_first_chunk"] = ttft
    if record.key is not None:  # the key's configured name (or its hash's start), never the key
        attributes["tokenmeter.key"] = record.key
    if record.team is not None:
        attributes["tokenmeter.team"] = record.team
    if record.cost is not None:  # nano-dollars as USD: a double holds them exactly below $9M
        attributes["tokenmeter.cost_usd"] = record.cost.nanousd / NANOS_PER_USD
    if record.fallback_from is not None:
        attributes["tokenmeter.fallback_from"] = _short(record.fallback_from)
    if record.usage.source != "reported":
        attributes["tokenmeter.usage.source"] = record.usage.source
    for tag in record.tags.items:  # values the `tags:` rules let through: bounded, no text
        attributes[f"tokenmeter.tags.{tag.key}"] = tag.value
    return attributes


class Tracing:
    """The process's tracer: made at start when tracing is enabled (`of`), its SDK parts
    built by `start` (in the server's cleanup context, in the process that serves) and
    flushed by `stop`."""

    __slots__ = ("_config", "_env", "_kit", "_provider")

    def __init__(self, config: TracingConfig, env: Mapping[str, str]) -> None:
        self._config = config
        self._env = env
        self._provider: TracerProvider | None = None
        self._kit: _Kit | None = None

    @classmethod
    def of(cls, config: TracingConfig, env: Mapping[str, str] | None = None) -> Tracing | None:
        """A tracer when `tracing.enabled`, or (left out) when OTEL_TRACES_EXPORTER names
        otlp; None otherwise, and always under OTEL_SDK_DISABLED=true."""
        env = os.environ if env is None else env
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        enabled = config.enabled
        if enabled is None:
            exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")}
            enabled = "otlp" in exporters
            if exporters - {"otlp", "none", ""}:
                log.warning("OTEL_TRACES_EXPORTER=%s: tokenmeter exports traces with otlp only",
                            env.get("OTEL_TRACES_EXPORTER"))
        return cls(config, env) if enabled else None

    @property
    def protocol(self) -> TracingProtocol:
        if self._config.protocol is not None:
            return self._config.protocol
        raw = (self._env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
               or self._env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or TracingProtocol.HTTP_PROTOBUF)
        try:
            return TracingProtocol(raw.strip())
        except ValueError:
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={raw!r}: tokenmeter exports traces "
                             "with http/protobuf or grpc") from None

    def start(self) -> None:
        """Build the provider, its batch processor (a thread) and exporter. Raises ValueError
        for a protocol that cannot be used (grpc without its package)."""
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
        from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        cfg = self._config
        # The SDK's reading of OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, over our default.
        resource = Resource({"service.name": "tokenmeter"}).merge(OTELResourceDetector().detect())
        if "OTEL_SERVICE_NAME" in self._env:
            resource = resource.merge(Resource({"service.name": self._env["OTEL_SERVICE_NAME"]}))
        if cfg.service_name is not None:
            resource = resource.merge(Resource({"service.name": cfg.service_name}))
        sampler = None if cfg.sample_ratio is None else ParentBasedTraceIdRatio(cfg.sample_ratio)
        provider = TracerProvider(sampler=sampler, resource=resource)
        # A batch is at most the queue (the SDK refuses a larger one; its default is 512).
        batch = None if cfg.queue_size is None else min(cfg.queue_size, 512)
        provider.add_span_processor(BatchSpanProcessor(
            self._exporter(), max_queue_size=cfg.queue_size, max_export_batch_size=batch))
        self._provider = provider
        self._kit = _Kit(provider.get_tracer("tokenmeter"), TraceContextTextMapPropagator(),
                         set_span_in_context, SpanKind.SERVER, SpanKind.CLIENT, StatusCode.ERROR)

    def _exporter(self) -> Any:
        endpoint = self._config.endpoint
        if self.protocol is TracingProtocol.GRPC:
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )
            except ImportError:
                raise ValueError("tracing over grpc needs the otlp-grpc extra "
                                 "(pip install 'tokenmeter[otlp-grpc]'), or use "
                                 "http/protobuf") from None
            return GrpcExporter(endpoint=endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        if endpoint is not None:
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return OTLPSpanExporter(endpoint=endpoint)

    def stop(self) -> None:
        """Export what is queued and stop (blocking: the server runs it in a thread)."""
        if self._provider is not None:
            self._kit = None
            self._provider.shutdown()
            self._provider = None

    def request(self, headers: Mapping[str, str], operation: str) -> RequestTrace | None:
        """A request's trace, its server span started now as the child of the client's
        `traceparent` when it sent one. None before `start` (or after `stop`)."""
        kit = self._kit
        if kit is None:
            return None
        parent = kit.propagator.extract(headers)
        operation = _OPERATIONS.get(operation, operation)
        server = kit.tracer.start_span(operation, parent, kit.server,
                                       {"gen_ai.operation.name": operation})
        return RequestTrace(kit, operation, server)
