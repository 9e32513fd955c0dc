"""Configuration of OpenTelemetry traces (`tracing:`). Off by default. Every key left out is
read as the OpenTelemetry SDK reads it, from the standard `OTEL_*` environment variables, so a
deployment configured for OpenTelemetry the usual way needs no `tracing:` section at all; a key
given here wins over its variable (as an SDK's constructor argument does)."""

from __future__ import annotations

import enum

from pydantic import Field

from proxy.config.policy import ConfigModel


class TracingProtocol(enum.StrEnum):
    """OTEL_EXPORTER_OTLP_PROTOCOL's values that tokenmeter exports with."""

    HTTP_PROTOBUF = "http/protobuf"
    GRPC = "grpc"  # needs the `otlp-grpc` extra (grpcio)


class TracingConfig(ConfigModel):
    # None: on when OTEL_TRACES_EXPORTER names `otlp`, else off. OTEL_SDK_DISABLED=true turns
    # it off whatever this says.
    enabled: bool | None = None
    # As OTEL_EXPORTER_OTLP_ENDPOINT: the collector's base URL; http/protobuf adds /v1/traces.
    # None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT, else the SDK's
    # default (a collector on localhost).
    endpoint: str | None = None
    # None: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL, else
    # http/protobuf.
    protocol: TracingProtocol | None = None
    # None: OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES), else "tokenmeter".
    service_name: str | None = None
    # The fraction of requests traced, drawn by the proxy (traceidratio on an id of its own).
    # None: OTEL_TRACES_SAMPLER(_ARG) (a parentbased_ one's root sampler), else every request.
    sample_ratio: float | None = Field(default=None, ge=0.0, le=1.0)
    # Whether a client's `traceparent` flags decide if its request is traced. Off (the
    # default): clients are not trusted with the exporter's load, so the proxy's own draw
    # decides every request, one that continues a client's trace included (its server span is
    # still the child of the client's span). On: a client's flag is followed (parent-based
    # sampling, as OpenTelemetry's parentbased_* samplers do), both ways, but the traces only
    # a client's flag made are at most `client_traces_per_s`.
    parent_based: bool = False
    # With parent_based: traces per second (per process, all clients together) kept only
    # because a client's `traceparent` said sampled, past what the proxy's own draw keeps: a
    # token bucket holding one second's worth (at least one). 0: a client's flag adds none.
    client_traces_per_s: float = Field(default=10.0, ge=0.0, le=1_000_000.0)
    # Spans waiting to be exported; past it, new ones are dropped (the request never waits).
    # None: OTEL_BSP_MAX_QUEUE_SIZE, else 2048.
    queue_size: int | None = Field(default=None, ge=1, le=1_000_000)
