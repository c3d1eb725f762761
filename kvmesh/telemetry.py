"""Tracing for every service: OpenTelemetry configured by the standard `OTEL_*` variables.

Tracing is on when an OTLP endpoint is named (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) or `OTEL_TRACES_EXPORTER` is `otlp` or `console`, and
`OTEL_SDK_DISABLED` is not true; otherwise spans are no-ops, so a laptop without a collector logs
no export errors. The sampler is the SDK's (`OTEL_TRACES_SAMPLER`, default parent-based always-on);
spans leave through a BatchSpanProcessor, whose bounded queue drops spans rather than block the
batching loop when the collector is slow or down.

W3C trace context crosses gRPC hops as `traceparent`/`tracestate` metadata, and crosses the
scheduler's step stream and page batches as one `traceparent` string per sequence.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

log = logging.getLogger("kvmesh.telemetry")

__all__ = ["Link", "Span", "SpanKind", "Status", "StatusCode", "setup_tracing", "tracer", "context_from_metadata",
           "metadata_with_context", "traceparent", "context_from_traceparent", "span_context_from_traceparent",
           "trace_id_hex", "tracing_enabled"]

_enabled = False


def tracing_enabled() -> bool:
    return _enabled


def _wanted() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service: str) -> bool:
    """Installs the tracer provider for `kvmesh-<service>` (or `OTEL_SERVICE_NAME`); returns whether spans export."""
    global _enabled
    if not _wanted():
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME") or f"kvmesh-{service}"
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint, headers, timeout and TLS from OTEL_EXPORTER_OTLP_*
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info("tracing: %s exporting as %s", type(exporter).__name__, name)
    return True


def shutdown_tracing() -> None:
    """Flushes what is queued (bounded by the exporter's timeout) when the service stops."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def context_from_metadata(metadata: Iterable[tuple[str, str]] | None) -> otel_context.Context:
    """The caller's trace context from gRPC invocation metadata (an empty context when none)."""
    carrier = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            carrier[key.lower()] = value
    return extract(carrier)


def metadata_with_context(span: Span, metadata: Sequence[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `span` as the parent of whatever the callee does."""
    carrier: dict[str, str] = {}
    inject(carrier, context=trace.set_span_in_context(span))
    return (*metadata, *carrier.items())


def traceparent(span: Span) -> str:
    """The W3C `traceparent` of `span` ('' when it is not sampled or tracing is off)."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_from_traceparent(value: str) -> otel_context.Context | None:
    """A parent context from a `traceparent` string; None for '' (nothing to trace)."""
    if not value:
        return None
    return extract({"traceparent": value})


def span_context_from_traceparent(value: str) -> trace.SpanContext | None:
    ctx = context_from_traceparent(value)
    if ctx is None:
        return None
    span_context = trace.get_current_span(ctx).get_span_context()
    return span_context if span_context.is_valid else None


def trace_id_hex(span: Span) -> str:
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else ""
