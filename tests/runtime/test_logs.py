"""Structured logs (runtime/logs.py): which ids a request gets from its headers, and what a JSON line carries."""
import io
import json
import logging
import re

from ember.runtime import logs

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_a_request_keeps_valid_ids_and_gets_new_ones_for_bad_ones():
    kept = logs.context_from({"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01", "x-request-id": "req-42.a:b"})
    assert (kept.trace_id, kept.request_id) == (TRACE, "req-42.a:b")
    for traceparent in ("", "garbage", f"00-{'0' * 32}-00f067aa0ba902b7-01", f"00-{TRACE.upper()}-00f067aa0ba902b7-01",
                        f"00-{TRACE}-00f067aa0ba902b7-01; x"):
        fresh = logs.context_from({"traceparent": traceparent})
        assert re.fullmatch(r"[0-9a-f]{32}", fresh.trace_id) and fresh.trace_id not in (TRACE, "0" * 32)
    for request_id in ("has space", "x" * 129, "quote\"", "new\nline"):
        assert logs.context_from({"x-request-id": request_id}).request_id != request_id
    assert logs.context_from({}).request_id != logs.context_from({}).request_id


def test_json_lines_carry_the_current_requests_ids_and_fields():
    stream = io.StringIO()
    logger = logging.getLogger("ember.test-logs")
    logger.addHandler(logs.json_handler(stream, source="gateway"))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.info("outside %s", "any request")
    context = logs.context_from({"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"})
    token = logs.current.set(context)
    try:
        logs.annotate(app="chat", usage=object())
        assert logs.outgoing_headers()["traceparent"].startswith(f"00-{TRACE}-")
        assert logs.outgoing_headers()["x-request-id"] == context.request_id
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed", extra={"fields": logs.public(context.fields)})
    finally:
        logs.current.reset(token)
    assert logs.outgoing_headers() is None
    outside, inside = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert outside["msg"] == "outside any request" and "trace_id" not in outside and outside["source"] == "gateway"
    assert inside | {"level": "error", "msg": "failed", "trace_id": TRACE, "request_id": context.request_id,
                     "app": "chat"} == inside
    assert "usage" not in inside and "ValueError: boom" in inside["exc"]
