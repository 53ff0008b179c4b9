"""runtime/tracing.py in fresh processes: off unless the environment asks, and what its span file holds."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

CLEAN = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "EMBER_TRACE"))}


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", code], env=CLEAN | env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result


OFF = """
from opentelemetry import trace
from ember.runtime import tracing
assert tracing.setup("svc") is False and tracing.enabled is False
with trace.get_tracer("t").start_as_current_span("s") as span:
    assert not span.is_recording()
"""
UNTOUCHED = """
import sys
assert "opentelemetry.sdk.trace" not in sys.modules, "the SDK was imported with tracing off"
"""


def test_without_configuration_tracing_stays_off(tmp_path):
    _run(OFF + UNTOUCHED)
    # OTEL_SDK_DISABLED wins over a trace file.
    _run(OFF + UNTOUCHED, EMBER_TRACE_FILE=str(tmp_path / "spans.jsonl"), OTEL_SDK_DISABLED="true")
    assert not (tmp_path / "spans.jsonl").exists()


def test_the_trace_file_holds_one_json_line_per_span(tmp_path):
    path = tmp_path / "spans.jsonl"
    _run("""
from opentelemetry import trace
from ember.runtime import tracing
assert tracing.setup("svc") and tracing.enabled
with tracing.tracer().start_as_current_span("outer", attributes={"k": 1}) as outer:
    outer.add_event("e", {"n": 2})
    headers = tracing.inject({})
with tracing.tracer().start_as_current_span("inner", tracing.extract(headers)):
    pass
""", EMBER_TRACE_FILE=str(path), OTEL_SERVICE_NAME="named")
    outer, inner = [json.loads(line) for line in path.read_text().splitlines()]
    assert outer["name"] == "outer" and outer["service"] == "named" and outer["parent_span_id"] is None
    assert outer["attributes"] == {"k": 1} and outer["events"][0]["name"] == "e"
    assert outer["kind"] == "INTERNAL" and outer["status"]["code"] == "UNSET" and outer["start_ns"] <= outer["end_ns"]
    assert inner["trace_id"] == outer["trace_id"] and inner["parent_span_id"] == outer["span_id"]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(_installed("opentelemetry.exporter.otlp.proto.http"), reason="the OTLP exporter is installed here")
def test_otlp_without_its_exporter_warns_and_goes_on():
    result = _run("""
from ember.runtime import tracing
assert tracing.setup("svc") is False and tracing.enabled is False
""", OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4318")
    assert "pip install opentelemetry-exporter-otlp-proto-http" in result.stderr


def test_an_unwritable_trace_file_warns_and_goes_on(tmp_path):
    result = _run(OFF, EMBER_TRACE_FILE=str(tmp_path / "missing" / "spans.jsonl"))
    assert "EMBER_TRACE_FILE" in result.stderr and "writable path" in result.stderr
