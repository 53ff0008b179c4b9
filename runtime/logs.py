"""Structured logs for the gateway and replicas: one JSON object per line, each carrying the trace and request ids
of the request it was written for, and an access line per request.

A request's ids come from its headers (W3C `traceparent`, `X-Request-ID`) or are made here; they ride to the
replica in the same headers, so one `trace_id` finds a call's lines in the gateway's log and its replica's. With
tracing on (runtime/tracing.py) a request's trace id is its SERVER span's, which continues the same `traceparent`.
"""
import contextvars
import json
import logging
import os
import re
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ACCESS = "ember.access"


@dataclass(eq=False)
class RequestContext:
    """What the log lines of one request share; `fields` gathers what the request path learns (app, replica...)."""

    request_id: str
    trace_id: str
    started: float = field(default_factory=time.monotonic)
    fields: dict = field(default_factory=dict)
    traced: bool = False  # the trace id is the request's first span's (tracing on)


current: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("ember_request", default=None)


def annotate(**fields) -> None:
    """Add fields to the current request's access line (and what observes it when it ends)."""
    context = current.get()
    if context is not None:
        context.fields.update(fields)


def outgoing_headers() -> dict[str, str] | None:
    """The current request's ids as headers for the hop to a replica; None outside a request."""
    context = current.get()
    if context is None:
        return None
    return {"traceparent": f"00-{context.trace_id}-{secrets.token_hex(8)}-00", "x-request-id": context.request_id}


def request_id_header() -> dict[str, str]:
    """The current request's id for a hop whose trace context tracing writes itself."""
    context = current.get()
    return {"x-request-id": context.request_id} if context is not None else {}


def context_from(headers: dict[str, str]) -> RequestContext:
    """The ids a caller sent, or new ones: a malformed or all-zero trace id is replaced, never trusted."""
    match = TRACEPARENT.fullmatch(headers.get("traceparent", "").strip())
    trace_id = match[1] if match and match[1] != "0" * 32 else secrets.token_hex(16)
    request_id = headers.get("x-request-id", "").strip()
    return RequestContext(request_id if REQUEST_ID.fullmatch(request_id) else secrets.token_hex(8), trace_id)


def follow_spans() -> None:
    """With tracing on, a request's trace id is the one its first span has: the SERVER span continues the caller's
    `traceparent` or, when there was none, starts a trace of its own whose id the log lines must carry."""
    from opentelemetry.sdk.trace import SpanProcessor

    from ember.runtime import tracing

    class FirstSpan(SpanProcessor):
        def on_start(self, span, parent_context=None) -> None:
            context = current.get()
            if context is not None and not context.traced:
                context.trace_id, context.traced = format(span.context.trace_id, "032x"), True

    if tracing.sdk_provider is not None:
        tracing.sdk_provider.add_span_processor(FirstSpan())


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", ...static, trace_id, request_id, ...extra fields}` on one line."""

    def __init__(self, **static):
        super().__init__()
        self.static = static

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()} | self.static
        context = current.get()
        if context is not None:
            line |= {"trace_id": context.trace_id, "request_id": context.request_id}
        line |= getattr(record, "fields", {})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def json_handler(stream_or_path, **static) -> logging.Handler:
    handler = logging.FileHandler(stream_or_path) if isinstance(stream_or_path, (str, os.PathLike)) \
        else logging.StreamHandler(stream_or_path)
    handler.setFormatter(JsonFormatter(**static))
    return handler


def setup_replica(function: str) -> None:
    """A replica's `ember.*` loggers (its access lines among them) write JSON to stderr, which is its log file."""
    logger = logging.getLogger("ember")
    logger.addHandler(json_handler(sys.stderr, function=function))
    logger.setLevel(logging.INFO)
    logger.propagate = False


class AccessLog:
    """ASGI middleware: sets the request's context for everything under it, answers with `X-Request-ID`, and
    writes one access line when the response has ended (a stream: at its end). `on_start(context)` and
    `on_end(context, status, seconds)` let the gateway observe the same request in its metrics. Paths under `quiet`
    (health checks, dashboard polls) get ids but no access line."""

    def __init__(self, app, on_start: Callable[[RequestContext], None] | None = None,
                 on_end: Callable[[RequestContext, int, float], None] | None = None, quiet: tuple[str, ...] = ()):
        self.app, self.on_start, self.on_end, self.quiet = app, on_start, on_end, quiet
        self.log = logging.getLogger(ACCESS)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        context = context_from({k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                                if k in (b"traceparent", b"x-request-id")})
        status, sent = 500, 0

        async def sending(message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                named = [v for k, v in headers if k.lower() == b"x-ember-replica"]
                if named:  # the gateway names the replica that answered, after any header the replica sent
                    context.fields["replica"] = named[-1].decode("latin-1")
                message = message | {"headers": headers + [(b"x-request-id", context.request_id.encode())]}
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        token = current.set(context)
        if self.on_start is not None:
            self.on_start(context)
        try:
            await self.app(scope, receive, sending)
        finally:
            seconds = time.monotonic() - context.started
            if self.on_end is not None:
                self.on_end(context, status, seconds)
            if not scope["path"].startswith(self.quiet):
                self.log.info("%s %s %d", scope["method"], scope["path"], status, extra={"fields": {
                    "kind": "access", "method": scope["method"], "path": scope["path"], "status": status,
                    "ms": round(seconds * 1000, 2), "bytes": sent, **public(context.fields)}})
            current.reset(token)


def public(fields: dict) -> dict:
    """The fields that belong in a log line: plain values, not the objects the request path passes along."""
    return {k: v for k, v in fields.items() if isinstance(v, (str, int, float, bool)) or v is None}
