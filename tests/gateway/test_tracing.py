"""One request, one trace: `ember serve` with EMBER_TRACE_FILE, spans read back from the file that the gateway and
its worker processes share (runtime/tracing.py)."""
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def _spans(path: Path, done, timeout: float = 20.0) -> list[dict]:
    """The file's spans once `done(spans)` holds: processes write a span when it ends, so wait for the last ones."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        # whole lines only: a process may be writing a span as the file is read
        spans = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
        if done(spans):
            return spans
        assert time.monotonic() < deadline, f"spans never arrived; the file holds {[s['name'] for s in spans]}"
        time.sleep(0.05)


def _one(spans: list[dict], **match) -> dict:
    found = [s for s in spans if all(s[k] == v for k, v in match.items())]
    assert len(found) == 1, f"{match}: {len(found)} spans among {[(s['service'], s['name']) for s in spans]}"
    return found[0]


def test_a_call_is_one_trace_from_gateway_to_worker(serve, tmp_path, monkeypatch):
    trace_file = tmp_path / "spans.jsonl"
    monkeypatch.setenv("EMBER_TRACE_FILE", str(trace_file))
    served = serve(ROOT / "examples" / "hello.py")
    key = served.key()
    with served.client(key) as http:
        reply = http.post("/hello/square", json={"x": 7}, headers={"traceparent": TRACEPARENT})
        assert reply.json() == {"result": 49}
        failed = http.post("/hello/square", json={"x": 1e200})  # its square is infinite, which JSON cannot carry: a 500
        assert failed.status_code == 500

    def complete(spans):
        return sum(s["kind"] == "SERVER" for s in spans) == 4
    spans = _spans(trace_file, complete)
    mine = [s for s in spans if s["trace_id"] == CLIENT_TRACE]
    gateway = _one(mine, service="ember-gateway", kind="SERVER")
    hop = _one(mine, service="ember-gateway", kind="CLIENT")
    worker = _one(mine, service="ember-worker", kind="SERVER")

    assert gateway["name"] == "POST /hello/square" and gateway["parent_span_id"] == CLIENT_SPAN
    assert hop["parent_span_id"] == gateway["span_id"]
    assert worker["parent_span_id"] == hop["span_id"]
    replica = reply.headers["x-ember-replica"]
    assert gateway["attributes"] | {"ember.app": "hello", "ember.function": "square", "http.response.status_code": 200,
                                    "ember.replica.id": replica, "ember.retries": 0} == gateway["attributes"]
    assert gateway["attributes"]["ember.cold_start.tier"] == "node-warm"  # the first call waited for the start
    assert gateway["attributes"]["ember.cold_start.ms"] > 0 and gateway["attributes"]["ember.queue.wait_ms"] > 0
    queue = _one(mine, service="ember-gateway", name="ember.queue")
    assert queue["parent_span_id"] == gateway["span_id"]
    assert hop["attributes"]["ember.replica.id"] == replica and hop["attributes"]["http.response.status_code"] == 200
    assert worker["attributes"] | {"ember.function": "square", "ember.replica.id": replica,
                                   "http.response.status_code": 200} == worker["attributes"]
    assert (
        gateway["start_ns"]
        <= hop["start_ns"]
        <= worker["start_ns"]
        <= worker["end_ns"]
        <= hop["end_ns"]
        <= gateway["end_ns"]
    )

    # The call without a traceparent starts its own trace; the function's error marks both SERVER spans.
    other = [s for s in spans if s["trace_id"] != CLIENT_TRACE and s["kind"] == "SERVER"]
    assert {s["service"] for s in other} == {"ember-gateway", "ember-worker"}
    assert len({s["trace_id"] for s in other}) == 1
    assert all(s["status"]["code"] == "ERROR" and s["attributes"]["http.response.status_code"] == 500 for s in other)
    assert gateway["status"]["code"] == worker["status"]["code"] == "UNSET"

    text = trace_file.read_text()
    assert key not in text and key.split("_", 2)[2] not in text  # neither the API key nor its secret part
    assert "1e200" not in text and "1e+200" not in text  # nor a body


def test_llm_request_spans_sit_under_the_worker_span(serve, tmp_path, monkeypatch):
    trace_file = tmp_path / "spans.jsonl"
    monkeypatch.setenv("EMBER_TRACE_FILE", str(trace_file))
    served = serve(ROOT / "examples" / "chat.py", timeout=120)
    with served.client(served.key(), timeout=120) as http:
        reply = http.post("/chat/v1/completions", headers={"traceparent": TRACEPARENT},
                          json={"model": "tiny-qwen3", "prompt": "The sea", "max_tokens": 4, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]

    # The worker's SERVER span ends just after the reply's last byte leaves it: wait for both ends.
    spans = _spans(trace_file, lambda spans: {"POST /chat/Chat", "POST /v1/completions"} <= {s["name"] for s in spans})
    mine = [s for s in spans if s["trace_id"] == CLIENT_TRACE]
    gateway = _one(mine, service="ember-gateway", kind="SERVER")
    hop = _one(mine, service="ember-gateway", kind="CLIENT")
    worker = _one(mine, service="ember-worker", kind="SERVER")
    request = _one(mine, name="llm.request")
    assert gateway["parent_span_id"] == CLIENT_SPAN and hop["parent_span_id"] == gateway["span_id"]
    assert worker["parent_span_id"] == hop["span_id"] and worker["name"] == "POST /v1/completions"
    assert request["service"] == "ember-worker" and request["parent_span_id"] == worker["span_id"]
    attributes = request["attributes"]
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 4
    assert attributes["gen_ai.request.max_tokens"] == 4 and attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["gen_ai.request.model"] == "tiny-qwen3"
    assert 0 < attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]
    children = {s["name"]: s for s in mine if s["parent_span_id"] == request["span_id"]}
    assert set(children) == {"llm.queued", "llm.prefill", "llm.decode"}
    queued, prefill, decode = children["llm.queued"], children["llm.prefill"], children["llm.decode"]
    assert request["start_ns"] == queued["start_ns"] <= queued["end_ns"] == prefill["start_ns"]
    assert prefill["start_ns"] < prefill["end_ns"] == decode["start_ns"] < decode["end_ns"] == request["end_ns"]
    assert worker["start_ns"] <= request["start_ns"] and request["end_ns"] <= worker["end_ns"]
