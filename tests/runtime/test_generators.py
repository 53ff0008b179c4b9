"""Generator functions behind a served gateway: values arrive as they are produced, errors end the stream as an
event, the SDK iterates them (sync and asyncio), and a client that leaves closes the generator in its replica."""
import asyncio
import json
import time
from pathlib import Path

import pytest

from ember.client import RemoteError

APPS = Path(__file__).parent / "apps"


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return tmp_path_factory.mktemp("traces") / "spans.jsonl"


@pytest.fixture(scope="module")
def served(serve_module, trace_file):
    """One gateway for the module, tracing to `trace_file` (the gateway and its replicas inherit the setting)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EMBER_TRACE_FILE", str(trace_file))
        return serve_module(APPS / "generators.py")


@pytest.fixture
def sdk(served, monkeypatch):
    """The SDK's functions of the served app, reaching its gateway the way `ember serve`'s user does."""
    monkeypatch.setenv("EMBER_HOME", str(served.home))
    for name in ("EMBER_URL", "EMBER_KEY", "EMBER_CA"):
        monkeypatch.delenv(name, raising=False)
    from ember.package import load_app

    return load_app(str(APPS / "generators.py"))


def events(lines) -> list[tuple[str | None, object]]:
    """(event name, parsed data) of each server-sent event."""
    out, name = [], None
    for line in lines:
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            out.append((name, json.loads(line[5:])))
            name = None
    return out


def test_values_stream_as_they_are_produced(served, tmp_path):
    gate = tmp_path / "gate"
    with served.client(served.key()) as http:
        with http.stream("POST", "/generators/count", json={"n": 1000, "gate": str(gate)}) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            assert reply.headers["x-ember-replica"].startswith("count-")
            lines = reply.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            # The generator is blocked on the gate until here: the first value reached us before the rest existed.
            assert json.loads(first[5:])["i"] == 0
            gate.touch()
            rest = events(lines)
    values = [data["i"] for name, data in rest if name is None]
    assert values == list(range(1, 1000))
    assert rest[-1] == ("done", {})


def test_an_error_mid_stream_ends_it_with_an_error_event(served):
    with served.client(served.key()) as http:
        with http.stream("POST", "/generators/fails_after", json={"n": 3}) as reply:
            assert reply.status_code == 200
            got = events(reply.iter_lines())
    assert got[:3] == [(None, 0), (None, 1), (None, 2)]
    assert got[3] == ("error", {"error": {"type": "function_error", "message": "ValueError: ran out after 3"}})
    assert len(got) == 4  # no `done` after an error
    with served.client(served.key()) as http:
        early = http.post("/generators/fails_after", json={"n": 0})  # before any value: a plain error reply
    assert early.status_code == 500
    assert early.json() == {"error": {"type": "function_error", "message": "ValueError: ran out after 0"}}
    assert "Traceback" not in early.text


def test_the_sdk_iterates_values_sync_and_async(sdk):
    assert [v["i"] for v in sdk.units["count"].remote_gen(5)] == [0, 1, 2, 3, 4]

    async def collect():
        return [v async for v in sdk.units["acount"].remote_gen.aio(n=300)]

    assert asyncio.run(collect()) == list(range(300))
    with pytest.raises(RemoteError) as failed:
        list(sdk.units["fails_after"].remote_gen(2))
    assert failed.value.type == "function_error" and "ran out after 2" in failed.value.message
    with pytest.raises(RemoteError, match="not a generator function"):
        list(sdk.units["plain"].remote_gen())
    with pytest.raises(RemoteError, match="is a generator function"):
        sdk.units["count"].remote(3)
    with pytest.raises(RemoteError) as bad:
        list(sdk.units["count"].remote_gen(n="many"))
    assert bad.value.status == 422


def test_a_client_that_leaves_closes_the_generator_and_frees_its_slot(served, tmp_path):
    marker = tmp_path / "closed"
    with served.client(served.key()) as http:
        with http.stream("POST", "/generators/endless", json={"marker": str(marker)}) as reply:
            lines = reply.iter_lines()
            assert [next(lines) for _ in range(3)][0] == "data: 0"
        deadline = time.monotonic() + 10
        while not marker.exists():
            assert time.monotonic() < deadline, "the generator was not closed after its client left"
            time.sleep(0.05)
        assert marker.read_text().startswith("closed after")
        # max_concurrency=1 and max_replicas=1: a second stream runs only if the first one's slot was freed.
        with http.stream("POST", "/generators/endless", json={"marker": str(tmp_path / "second")}) as again:
            assert again.status_code == 200
            again_lines = again.iter_lines()
            assert next(again_lines) == "data: 0"
    assert served.in_flight_after_settling("generators", "endless") == 0


def test_a_stream_past_its_timeout_ends_with_a_timeout_event(served):
    with served.client(served.key()) as http:
        with http.stream("POST", "/generators/slow_ticks", json={"n": 100}) as reply:
            got = events(reply.iter_lines())
    values = [data for name, data in got if name is None]
    assert 2 <= len(values) <= 5 and values == list(range(len(values)))
    assert got[-1] == ("error", {"error": {"type": "timeout",
                                           "message": "call exceeded the function's timeout of 1 s"}})


def test_a_stream_holds_its_keys_concurrency_until_it_ends(served, tmp_path):
    key = served.cli("keys", "create", "--quiet", "--name", "one-at-a-time", "--concurrency", "1").stdout.strip()
    gate = tmp_path / "gate"
    with served.client(key) as http:
        with http.stream("POST", "/generators/count", json={"n": 5, "gate": str(gate)}) as reply:
            lines = reply.iter_lines()  # kept: a dropped line iterator closes the stream
            assert next(lines).startswith("data:")
            refused = http.post("/generators/plain", json={})
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_exceeded"
            gate.touch()
            assert events(lines)[-1] == ("done", {})
        assert http.post("/generators/plain", json={}).json() == {"result": 1}


def test_a_stream_is_one_trace_whose_replica_span_lasts_to_its_end(served, trace_file):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with served.client(served.key()) as http:
        with http.stream("POST", "/generators/slow_ticks", json={"n": 3},
                         headers={"traceparent": f"00-{trace_id}-{parent}-01"}) as reply:
            got = events(reply.iter_lines())
    assert got[-1] == ("done", {})
    deadline = time.monotonic() + 20
    while True:
        text = trace_file.read_text() if trace_file.exists() else ""   # whole lines: a span may be mid-write
        spans = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
        mine = {(s["service"], s["kind"]): s for s in spans if s["trace_id"] == trace_id}
        if len(mine) >= 3:
            break
        assert time.monotonic() < deadline, f"spans never arrived: {sorted(mine)}"
        time.sleep(0.05)
    gateway, hop = mine["ember-gateway", "SERVER"], mine["ember-gateway", "CLIENT"]
    worker = mine["ember-worker", "SERVER"]
    assert gateway["parent_span_id"] == parent and hop["parent_span_id"] == gateway["span_id"]
    assert worker["parent_span_id"] == hop["span_id"]
    assert gateway["attributes"]["ember.function"] == "slow_ticks"
    assert worker["attributes"]["ember.function"] == "slow_ticks"
    # Three values 0.3 s apart: the replica's span covers the whole stream, not just its first reply.
    assert worker["end_ns"] - worker["start_ns"] >= 0.6e9


def test_the_sdk_hands_over_each_value_as_it_arrives(sdk, tmp_path):
    gate = tmp_path / "gate"
    values = sdk.units["count"].remote_gen(1000, gate=str(gate))
    assert next(values)["i"] == 0  # the generator waits on the gate: this value was not held back for the rest
    gate.touch()
    assert [v["i"] for v in values] == list(range(1, 1000))

    async_gate = tmp_path / "async-gate"

    async def first_then_rest():
        stream = sdk.units["count"].remote_gen.aio(50, gate=str(async_gate))
        first = await anext(stream)
        async_gate.touch()
        return first["i"], [v["i"] async for v in stream]

    assert asyncio.run(first_then_rest()) == (0, list(range(1, 50)))
