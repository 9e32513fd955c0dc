"""OpenTelemetry traces: one SERVER span per request, one CLIENT span per upstream attempt.

Off by default and free when off: nothing here imports the OpenTelemetry SDK until tracing is
enabled (`tracing:` or the standard `OTEL_*` variables, `Tracing.of`), and the pipeline holds
`None` instead of a `RequestTrace`, so a request pays one attribute check.

When on, a request's server span continues the client's W3C `traceparent` (it is the child of
the client's span; whether it is sampled is the proxy's own draw unless `tracing.parent_based`,
and then the traces a client's flag alone adds are bounded: `RequestTrace._sample`), each
attempt's client span is the server span's child, and the upstream is
sent a `traceparent` naming that client span: retries and fallbacks show as sibling client
spans. The spans' attributes follow the OpenTelemetry GenAI semantic conventions
(`gen_ai.*`) plus tokenmeter's own (`tokenmeter.*`); they are read from the request's
`RequestRecord` (made once, by settle) and from what the routing knew of each attempt, never
from prompt or answer text, never a key. The server span ends when the request is settled:
for a stream, after its last byte. A span is handed to the SDK once, finished (`RequestTrace`
says why), to a `BatchSpanProcessor` (a bounded queue and a thread of its own: export is off
the request path, and a full queue drops spans rather than delay a request) and the SDK's OTLP
exporter; shutdown flushes it (`Tracing.stop`, from the server's cleanup).
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.config.tracing import TracingConfig, TracingProtocol
from proxy.cost import NANOS_PER_USD
from proxy.errors import ErrorClass
from proxy.record import RequestRecord

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.sdk.trace.sampling import Decision, Sampler
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Span, SpanContext, SpanKind, Status, TraceFlags, TraceState

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

    processor: SpanProcessor  # the BatchSpanProcessor: takes each finished span
    sampler: Sampler  # the provider's (OTEL_TRACES_SAMPLER, or `sample_ratio`)
    root: Context  # an empty context: the sampler asked as if no client sent a traceparent
    parent_based: bool  # tracing.parent_based: a client's flags are followed
    forced: ClientTraces  # ... and the traces only they made are bounded by this
    ids: IdGenerator  # the provider's
    resource: Resource
    scope: InstrumentationScope
    propagator: TextMapPropagator
    span: Callable[..., ReadableSpan]  # opentelemetry.sdk.trace.ReadableSpan
    context: Callable[..., SpanContext]  # opentelemetry.trace.SpanContext
    current_span: Callable[[Context], Span]  # opentelemetry.trace.get_current_span
    flags: type[TraceFlags]
    sample: Decision  # RECORD_AND_SAMPLE: the sampler's answer for a span that is exported
    server: SpanKind
    client: SpanKind
    ok: Status  # UNSET, as the SDK leaves a span nobody set a status on
    error: Status


class ClientTraces:
    """`tracing.client_traces_per_s`: a token bucket of the traces a client's sampled
    `traceparent` may add to what the proxy's own draw keeps, holding one second's worth (at
    least one). Asked on the event loop only."""

    __slots__ = ("_at", "_burst", "_rate", "_tokens")

    def __init__(self, per_s: float) -> None:
        self._rate = per_s
        self._burst = max(per_s, 1.0) if per_s > 0 else 0.0
        self._tokens = self._burst
        self._at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class _Attempt:
    """One attempt's client span while it is under way: its id and start (already sent in the
    `traceparent`) and the attributes it has so far."""

    __slots__ = ("attributes", "failed", "name", "span_id", "start")

    def __init__(self, name: str, span_id: int, attributes: dict[str, Any]) -> None:
        self.name = name
        self.span_id = span_id
        self.attributes = attributes
        self.failed = False
        self.start = time.time_ns()


class RequestTrace:
    """The spans of one request. The pipeline and the routing call it at fixed points; it
    never raises into them and holds no prompt or answer text.

    A span is handed to the SDK once, finished: its ids, times and attributes are kept here
    while the request runs and made into the SDK's `ReadableSpan` when it ends, which the
    batch processor queues and the OTLP exporter encodes as it would a span of the SDK's
    `Tracer`. The `Tracer`'s live spans cost ~60 us of the event loop per request (a lock, a
    check of every attribute value, a context per span, a copy at the end); this costs ~7
    (the same calls timed in a loop; the README's "Tracing" has the whole request's figures).
    The sampler is asked once per trace, for the server span, as the `Tracer` asks it (twice
    when a client's `traceparent` is followed: `_sample`): every built-in sampler gives its
    children the same answer (they share its trace id, and a parent-based one follows the
    server span). What the `Tracer` would add and this does not:
    the OTEL_*_LIMIT span limits (the attributes here are a fixed, bounded set) and the SDK's
    metrics about its own spans."""

    __slots__ = ("_attempt", "_flags", "_kit", "_operation", "_parent", "_sampled", "_server",
                 "_start", "_target", "_trace_flags", "_trace_id", "_trace_state")

    def __init__(self, kit: _Kit, operation: str, headers: Mapping[str, str]) -> None:
        self._kit = kit
        self._operation = operation  # gen_ai.operation.name
        # The client's traceparent (and tracestate), read as the SDK's Tracer reads them.
        context = kit.propagator.extract(headers) if "traceparent" in headers else None
        parent = None  # the client's span, when it sent a (valid) traceparent
        if context is not None:
            if (found := kit.current_span(context).get_span_context()).is_valid:
                parent = found
            else:
                context = None
        self._parent = parent
        self._trace_id = kit.ids.generate_trace_id() if parent is None else parent.trace_id
        self._sampled, self._trace_state = self._sample(kit, operation, context, parent)
        # As the Tracer sets them: sampled or not, and (W3C level 2) whether the trace id is
        # random: ours when the trace starts here, else as the client's flags say.
        random_id = (kit.ids.is_trace_id_random() if parent is None
                     else parent.trace_flags.random_trace_id)
        self._trace_flags = kit.flags(int(self._sampled) | (2 * random_id))
        self._flags = f"{self._trace_flags:02x}"
        self._server = kit.ids.generate_span_id()
        self._start = time.time_ns()
        self._target: Target | None = None
        self._attempt: _Attempt | None = None  # under way, or the one that answered

    def _sample(self, kit: _Kit, operation: str, context: Context | None,
                parent: SpanContext | None) -> tuple[bool, TraceState | None]:
        """Whether the trace is kept, and its trace state. A trace begun here is the
        sampler's, as the SDK's Tracer asks it. One that continues a client's is the proxy's
        own draw, on a trace id of its own (a ratio sampler reads the id, which the client
        chose), unless `parent_based`: then the client's flag is followed, and what it alone
        made sampled takes a token of `client_traces_per_s` (none left: the proxy's draw)."""
        if parent is None:
            sampling = kit.sampler.should_sample(kit.root, self._trace_id, operation,
                                                 kit.server)
            return sampling.decision is kit.sample, sampling.trace_state
        own = kit.sampler.should_sample(kit.root, kit.ids.generate_trace_id(), operation,
                                        kit.server).decision is kit.sample
        if kit.parent_based:
            theirs = kit.sampler.should_sample(context, self._trace_id, operation, kit.server)
            if theirs.decision is not kit.sample:
                own = False
            elif not own:
                own = kit.forced.take()
        return own, parent.trace_state

    def candidate(self, target: Target) -> None:
        """The next attempts go to `target` (a fallback's, after the primary's)."""
        self._target = target

    def attempt_started(self, headers: MutableMapping[str, str], host: str,
                        port: int | None) -> None:
        """An attempt goes out now, to `host`:`port`: its client span starts (the previous
        one, if still open, ends) and `headers` get the `traceparent` that names it."""
        self._end_attempt()
        span_id = self._kit.ids.generate_span_id()
        # W3C traceparent, written out (what the propagator's inject would write for this
        # span). A client's `tracestate` is forwarded as it came, as the propagator would.
        headers["traceparent"] = f"00-{self._trace_id:032x}-{span_id:016x}-{self._flags}"
        if not self._sampled:  # its id is all an unsampled span is: nothing is exported
            return
        target = self._target
        attributes: dict[str, Any] = {"gen_ai.operation.name": self._operation,
                                      "server.address": host}
        if port is not None:
            attributes["server.port"] = port
        name = self._operation
        if target is not None:
            name = f"{self._operation} {_short(target.model)}"
            attributes["gen_ai.provider.name"] = target.provider
            attributes["gen_ai.request.model"] = _short(target.model)
            attributes["tokenmeter.upstream"] = target.upstream
            if target.max_tokens is not None:
                attributes["gen_ai.request.max_tokens"] = target.max_tokens
        self._attempt = _Attempt(name, span_id, attributes)

    def attempt_answered(self, status: int, error_class: ErrorClass) -> None:
        """The attempt under way got an answer: its status and class (the span stays open: it
        ends with the next attempt, or at settle when its answer is the one relayed)."""
        if (attempt := self._attempt) is not None:
            attempt.attributes["http.response.status_code"] = status
            if error_class is not ErrorClass.NONE:
                attempt.attributes["error.type"] = error_class.value
                attempt.failed = True

    def attempt_ended(self, error_class: ErrorClass) -> None:
        """The attempt under way failed and is given up on (retried, handed to a fallback)."""
        if (attempt := self._attempt) is not None:
            attempt.attributes["error.type"] = error_class.value
            attempt.failed = True
            self._end_attempt()

    def settle(self, record: RequestRecord, decision: BudgetDecision) -> None:
        """The request is over: the spans still open get the record's figures and end."""
        if not self._sampled:  # nothing to export (and no attempt was kept)
            return
        usage = _usage(record)
        failed = record.error_class is not ErrorClass.NONE
        if (attempt := self._attempt) is not None:  # the one whose answer was relayed, or the last
            attempt.attributes.update(usage)
            if (ttft := record.figures.upstream_ttft) is not None:
                attempt.attributes["gen_ai.response.time_to_first_chunk"] = ttft
            if failed:
                attempt.attributes["error.type"] = record.error_class.value
                attempt.failed = True
            self._end_attempt()
        attributes = {"gen_ai.operation.name": self._operation,
                      **_server_attributes(record, decision), **usage}
        if (target := self._target) is not None:
            attributes["gen_ai.provider.name"] = target.provider
            if target.max_tokens is not None:
                attributes["gen_ai.request.max_tokens"] = target.max_tokens
        if failed:
            attributes["error.type"] = record.error_class.value
        kit = self._kit
        kit.processor.on_end(kit.span(
            name=f"{self._operation} {_short(record.requested_model)}",
            context=self._context(self._server), parent=self._parent,
            resource=kit.resource, attributes=attributes, kind=kit.server,
            status=kit.error if failed else kit.ok, start_time=self._start,
            end_time=time.time_ns(), instrumentation_scope=kit.scope))

    def _context(self, span_id: int) -> SpanContext:
        return self._kit.context(self._trace_id, span_id, False, self._trace_flags,
                                 self._trace_state)

    def _end_attempt(self) -> None:
        attempt, self._attempt = self._attempt, None
        if attempt is not None:  # kept only when sampled
            kit = self._kit
            kit.processor.on_end(kit.span(
                name=attempt.name, context=self._context(attempt.span_id),
                parent=self._context(self._server), resource=kit.resource,
                attributes=attempt.attributes, kind=kit.client,
                status=kit.error if attempt.failed else kit.ok, start_time=attempt.start,
                end_time=time.time_ns(), instrumentation_scope=kit.scope))


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
    # Closed-list tags only, as the metrics take them: a free tag's value is the client's
    # text (it may name a customer), kept in the ledger row, never in a span.
    for tag in record.tags.closed:
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
        from opentelemetry.context import Context
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import Decision, ParentBasedTraceIdRatio
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import (
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            get_current_span,
        )
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        cfg = self._config
        # The SDK's reading of OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, over our default.
        resource = Resource({"service.name": "tokenmeter"}).merge(OTELResourceDetector().detect())
        if "OTEL_SERVICE_NAME" in self._env:
            resource = resource.merge(Resource({"service.name": self._env["OTEL_SERVICE_NAME"]}))
        if cfg.service_name is not None:
            resource = resource.merge(Resource({"service.name": cfg.service_name}))
        sampler = None if cfg.sample_ratio is None else ParentBasedTraceIdRatio(cfg.sample_ratio)
        # The provider reads OTEL_TRACES_SAMPLER(_ARG) when no sampler is given, and owns the
        # processor (its shutdown flushes it); requests use its parts (RequestTrace).
        provider = TracerProvider(sampler=sampler, resource=resource)
        # A batch is at most the queue (the SDK refuses a larger one; its default is 512).
        batch = None if cfg.queue_size is None else min(cfg.queue_size, 512)
        processor = BatchSpanProcessor(self._exporter(), max_queue_size=cfg.queue_size,
                                       max_export_batch_size=batch)
        provider.add_span_processor(processor)
        self._provider = provider
        self._kit = _Kit(processor, provider.sampler, Context(), cfg.parent_based,
                         ClientTraces(cfg.client_traces_per_s), provider.id_generator,
                         provider.resource,
                         InstrumentationScope("tokenmeter"), TraceContextTextMapPropagator(),
                         ReadableSpan, SpanContext, get_current_span,
                         TraceFlags, Decision.RECORD_AND_SAMPLE,
                         SpanKind.SERVER, SpanKind.CLIENT, Status(StatusCode.UNSET),
                         Status(StatusCode.ERROR))

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
        return RequestTrace(kit, _OPERATIONS.get(operation, operation), headers)
