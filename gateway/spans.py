"""What the gateway's SERVER span of a call says (runtime/tracing.py's `ServerSpans` wraps the invoke route):
named after the app when it starts, after the function when the request's `CallRecord` knows it, with the replica,
the cold start, the queue wait (a child span when the call waited in line) and the retries."""
from ember.gateway.record import record_of
from ember.runtime import tracing

INVOKE_ROUTE = "/{app_name}/{rest:path}"
QUEUED = 0.0005  # a free slot is handed over without awaiting (microseconds): a longer acquire waited in the queue


def describe(scope) -> tuple[str, dict]:
    app = scope["path_params"]["app_name"]
    return f"{scope['method']} /{app}", {"http.request.method": scope["method"], "http.route": INVOKE_ROUTE,
                                         "url.path": scope["path"], "ember.app": app, "ember.retries": 0}


def finish(scope, span) -> None:
    record = record_of(scope)
    if record is None:
        return
    if record.function is not None:
        span.update_name(f"{scope['method']} /{record.app}/{record.function}")
        span.set_attribute("ember.function", record.function)
    if record.error is not None:
        span.set_attribute("error.type", record.error)
    lease = record.lease
    if lease is None:
        return
    span.set_attributes({"ember.replica.id": lease.replica.id, "ember.retries": lease.attempt - 1,
                         "ember.queue.wait_ms": round(lease.waited_s * 1000, 3)})
    if lease.cold_start:
        span.set_attributes(
            {"ember.cold_start.tier": lease.cold_start.tier, "ember.cold_start.ms": lease.cold_start.ms}
        )
    if lease.waited_s >= QUEUED:
        attributes = {"ember.replica.id": lease.replica.id}
        if lease.cold_start:
            attributes["ember.cold_start"] = lease.cold_start.header()
        tracing.interval(
            "ember.queue", span, lease.granted_ns - int(lease.waited_s * 1e9), lease.granted_ns, attributes
        )
