"""OpenTelemetry tracing for every hop of a request: gateway, worker, engine. Off unless the environment asks.

    OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318 ember serve app.py   # OTLP/HTTP (needs the exporter package)
    EMBER_TRACE_FILE=/tmp/spans.jsonl ember serve app.py                   # one JSON object per finished span

Requests are traced by one ASGI middleware, `ServerSpans`, which the gateway and the worker both wrap around their
apps; an outgoing hop is a `client_span`. Both test `enabled` first, so a process without tracing pays one
attribute read per hop; the SDK (absent on GPU nodes that carry only the API) is imported only when configured.
"""
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the worker imports this module before anything heavy
    from opentelemetry.sdk.trace import TracerProvider
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("ember.tracing")

enabled = False  # read on hot paths: True once setup() installed a TracerProvider in this process
sdk_provider: "TracerProvider | None" = None  # the provider setup() installed
OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-http"


def setup(service_name: str) -> bool:
    """Install the process's TracerProvider when EMBER_TRACE_FILE or an OTLP endpoint is set; True when tracing is on.
    OTEL_SERVICE_NAME overrides `service_name`; OTEL_SDK_DISABLED=true turns it all off."""
    global enabled, sdk_provider
    if enabled:
        return True
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    trace_file = os.environ.get("EMBER_TRACE_FILE")
    otlp = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not trace_file and not otlp:
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        from ember.runtime.span_file import SpanFile
    except ImportError:
        log.warning("tracing asked for, but opentelemetry-sdk is not installed: pip install opentelemetry-sdk; "
                    "running without tracing")
        return False
    processors: list[SpanProcessor] = []
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
    sdk_provider, enabled = provider, True
    return True


def flush() -> None:
    """Export the spans still batched. A server stopped by SIGTERM must call this itself: uvicorn ends by re-raising
    the signal, so the provider's atexit hook never runs."""
    if sdk_provider is not None:
        sdk_provider.force_flush()


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


def inject(headers: dict, context=None) -> dict:
    """Add `context` (by default the current one) to outgoing `headers` as W3C trace context."""
    from opentelemetry import propagate

    propagate.inject(headers, context)
    return headers


class ServerSpans:
    """ASGI middleware: each HTTP request that `describe` names is served inside a SERVER span that continues the
    caller's `traceparent` and is the current context while the app runs, so the app's own spans (and its
    outgoing hops) become its children. The status comes from the `http.response.start` the app sends; 5xx or an
    exception marks the span an error (OpenTelemetry's HTTP server conventions). The span ends as the reply's last
    message goes out (a streamed reply: when the stream has ended); `finish(scope, span)` adds, just before, what
    only the app knows."""

    def __init__(self, app: "ASGIApp", describe: "Callable[[Scope], tuple[str, dict] | None]",
                 finish: "Callable[[Scope, Any], None] | None" = None):
        self.app, self.describe, self.finish = app, describe, finish

    async def __call__(self, scope: "Scope", receive: "Receive", send: "Send") -> None:
        described = self.describe(scope) if enabled and scope["type"] == "http" else None
        if described is None:
            return await self.app(scope, receive, send)
        from opentelemetry import context, trace
        from opentelemetry.trace import SpanKind

        name, attributes = described
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        span = tracer().start_span(name, extract(headers), SpanKind.SERVER, attributes=attributes)
        status, ended = 500, False

        def end(error_type: str | None = None) -> None:
            nonlocal ended
            if not ended:
                ended = True
                if self.finish is not None:
                    self.finish(scope, span)
                end_span(span, status, error_type)

        async def sending(message: "Message") -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                end()  # before the last byte leaves, so the span ends before the caller's does
            await send(message)

        token = context.attach(trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, sending)
        except BaseException as exc:
            if not ended:
                span.record_exception(exc)
                end(type(exc).__name__)
            raise
        finally:
            context.detach(token)
            end()


def end_span(span, status: int, error_type: str | None = None) -> None:
    from opentelemetry.trace import StatusCode

    span.set_attribute("http.response.status_code", status)
    if error_type is not None and not span.attributes.get("error.type"):
        span.set_attribute("error.type", error_type)
    if status >= 500:
        span.set_status(StatusCode.ERROR, span.attributes.get("error.type") or f"HTTP {status}")
    span.end()


class ClientSpan:
    """One outgoing hop as a CLIENT span, child of the current span. `headers` carry its context upstream as W3C
    trace context (plus `carry`, what the next hop's span should know); `reply(status)` records the answer.
    With tracing off it is inert and `headers` is None."""

    def __init__(self, name: str, attributes: Mapping[str, Any], carry: Mapping[str, str] = {}):
        self.name, self.attributes, self.carry = name, attributes, carry
        self.span: Any = None
        self.headers: dict[str, str] | None = None

    def __enter__(self) -> "ClientSpan":
        if enabled:
            from opentelemetry import trace
            from opentelemetry.trace import SpanKind

            self.span = tracer().start_span(self.name, kind=SpanKind.CLIENT, attributes=self.attributes)
            self.headers = inject(dict(self.carry), trace.set_span_in_context(self.span))
        return self

    def reply(self, status: int) -> None:
        if self.span is not None:
            self.span.set_attribute("http.response.status_code", status)
            if status >= 500:
                from opentelemetry.trace import StatusCode

                self.span.set_status(StatusCode.ERROR, f"HTTP {status}")

    def __exit__(self, kind, exc, traceback) -> None:
        if self.span is not None:
            if exc is not None:
                from opentelemetry.trace import StatusCode

                self.span.record_exception(exc)
                self.span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
            self.span.end()


def interval(name: str, parent, start_ns: int, end_ns: int, attributes: Mapping[str, Any]) -> None:
    """A span for something already over (a wait measured by the caller), child of `parent`."""
    from opentelemetry import trace

    span = tracer().start_span(name, trace.set_span_in_context(parent), start_time=start_ns, attributes=attributes)
    span.end(end_ns)


def current_context():
    from opentelemetry import context

    return context.get_current()
