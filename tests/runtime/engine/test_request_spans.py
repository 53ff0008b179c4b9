"""The engine's `llm.request` spans, in a fresh process with EMBER_TRACE_FILE (tracing is per process): one per
request under its caller's span, children from its timestamps, an event per preemption."""
import json
import os
import subprocess
import sys

SCRIPT = """
import sys
from opentelemetry import trace
from ember.runtime import tracing
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.sampling import SamplingParams
from ember.runtime.engine.tiny import build_tiny_model

assert tracing.setup("engine-test")
model = build_tiny_model(sys.argv[1])
# Six 16-token blocks for four requests of up to 56 tokens: the cache runs out and requests are preempted.
engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=6, max_model_len=96, max_num_batched_tokens=96))
params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
with tracing.tracer().start_as_current_span("caller"):
    for i, n in enumerate([20, 14, 26, 9]):
        engine.add_request(f"r{i}", [(7 * i + j) % 200 + 3 for j in range(n)], params, tracing.current_context())
while engine.has_unfinished_requests():
    engine.step()
assert engine.stats.num_preemptions > 0
"""


def test_each_request_gets_its_spans_and_preemptions(tmp_path):
    path = tmp_path / "spans.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | {"EMBER_TRACE_FILE": str(path)}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "model")], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    [caller] = [s for s in spans if s["name"] == "caller"]
    requests = {s["attributes"]["gen_ai.request.id"]: s for s in spans if s["name"] == "llm.request"}
    assert sorted(requests) == ["r0", "r1", "r2", "r3"]
    for request in requests.values():
        assert request["trace_id"] == caller["trace_id"] and request["parent_span_id"] == caller["span_id"]
        attributes = request["attributes"]
        assert attributes["gen_ai.usage.output_tokens"] == 30 and attributes["gen_ai.response.finish_reasons"] == [
            "length"
        ]
        preempted = [e for e in request["events"] if e["name"] == "llm.preempted"]
        assert len(preempted) == attributes["ember.preemptions"]
        assert all(request["start_ns"] <= e["time_ns"] <= request["end_ns"] for e in preempted)
        children = sorted((s for s in spans if s["parent_span_id"] == request["span_id"]), key=lambda s: s["start_ns"])
        assert [s["name"] for s in children] == ["llm.queued", "llm.prefill", "llm.decode"]
        assert children[0]["start_ns"] == request["start_ns"] and children[-1]["end_ns"] == request["end_ns"]
        assert children[0]["end_ns"] == children[1]["start_ns"] and children[1]["end_ns"] == children[2]["start_ns"]
    assert sum(r["attributes"]["ember.preemptions"] for r in requests.values()) > 0
