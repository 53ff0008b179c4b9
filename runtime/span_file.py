"""The trace file exporter: one JSON line per finished span, in EMBER_TRACE_FILE. Imported only when tracing is on
(it needs the OpenTelemetry SDK)."""
import json
import os
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class SpanFile(SpanExporter):
    """A span exporter that appends one JSON line per span, each with one os.write on an O_APPEND descriptor,
    so the gateway and its worker processes (which inherit EMBER_TRACE_FILE) can share one file."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            os.write(self.fd, (json.dumps(span_record(span), default=str) + "\n").encode())
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def span_record(span: ReadableSpan) -> dict:
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
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
        ],
    }
