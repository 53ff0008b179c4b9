"""OpenTelemetry tracing for every hop of a request: gateway, worker, engine. Off unless the environment asks.

    OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318 ember serve app.py   # OTLP/HTTP (needs the exporter package)
    EMBER_TRACE_FILE=/tmp/spans.jsonl ember serve app.py                   # one JSON object per finished span

Callers test `tracing.enabled` before touching anything else here, so a process without tracing pays one
attribute read per hop; the SDK (absent on GPU nodes that carry only the API) is imported only when configured.
"""
import json
import logging
import os

log = logging.getLogger("ember.tracing")

enabled = False  # read on hot paths: True once setup() installed a TracerProvider in this process
OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-http"


def setup(service_name: str) -> bool:
    """Install the process's TracerProvider when EMBER_TRACE_FILE or an OTLP endpoint is set; True when tracing is on.
    OTEL_SERVICE_NAME overrides `service_name`; OTEL_SDK_DISABLED=true turns it all off."""
    global enabled
    if enabled:
        return True
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    trace_file = os.environ.get("EMBER_TRACE_FILE")
    otlp = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not trace_file and not otlp:
        return False
    processors = []
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        log.warning("tracing asked for, but opentelemetry-sdk is not installed: pip install opentelemetry-sdk; "
                    "running without tracing")
        return False
    if otlp:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set, but the OTLP exporter is not installed: "
                        "pip install %s; running without OTLP export", OTLP_PACKAGE)
        else:
            processors.append(BatchSpanProcessor(OTLPSpanExporter()))  # it reads the endpoint from the env itself
    if trace_file:
        try:  # synchronous: a span is in the file when it ends, so a test (or a person) can read it right away
            processors.append(SimpleSpanProcessor(SpanFile(trace_file)))
        except OSError as exc:
            log.warning("EMBER_TRACE_FILE=%s cannot be opened (%s): point it at a writable path; "
                        "running without the trace file", trace_file, exc.strerror)
    if not processors:
        return False
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    for processor in processors:
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    enabled = True
    return True


def flush() -> None:
    """Export the spans still batched. A server stopped by SIGTERM must call this itself: uvicorn ends by re-raising
    the signal, so the provider's atexit hook never runs."""
    if enabled:
        from opentelemetry import trace

        trace.get_tracer_provider().force_flush()


def fastapi_options() -> dict:
    """FastAPI's arguments for Ember's own apps (gateway, engine API). Recent FastAPI traces every request itself once
    a TracerProvider is set; Ember's SERVER spans already cover those requests, with the names and attributes its
    traces promise, so its apps turn FastAPI's off rather than trace each request twice."""
    import inspect

    from fastapi import FastAPI

    return {"telemetry": {"tracing": False}} if "telemetry" in inspect.signature(FastAPI).parameters else {}


def tracer():
    from opentelemetry import trace

    return trace.get_tracer("ember")


def extract(headers):
    """The trace context a caller sent in W3C `traceparent`/`tracestate` headers (any mapping with .get)."""
    from opentelemetry import propagate

    return propagate.extract(headers)


def inject(headers: dict) -> dict:
    """Add the current span's context to outgoing `headers` as W3C trace context."""
    from opentelemetry import propagate

    propagate.inject(headers)
    return headers


def current_context():
    from opentelemetry import context

    return context.get_current()


class SpanFile:
    """A span exporter that appends one JSON line per span, each with one os.write on an O_APPEND descriptor,
    so the gateway and its worker processes (which inherit EMBER_TRACE_FILE) can share one file."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        for span in spans:
            os.write(self.fd, (json.dumps(span_record(span), default=str) + "\n").encode())
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def span_record(span) -> dict:
    """A finished SDK span as plain JSON: ids in hex, times in ns since the epoch."""
    parent = span.parent
    return {
        "service": span.resource.attributes.get("service.name"),
        "name": span.name,
        "trace_id": format(span.context.trace_id, "032x"),
        "span_id": format(span.context.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events],
    }
