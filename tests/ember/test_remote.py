"""The SDK's calls against a served gateway: .map and .starmap fan out (the autoscaler starts replicas for them),
.spawn returns a handle whose .get works from another client, .cancel stops the call, and .aio twins of each."""
import asyncio
import time
from pathlib import Path

import pytest

from ember.client import RemoteError
from ember.remote import FunctionCall

APPS = Path(__file__).parent / "apps"


@pytest.fixture(scope="module")
def served(serve_module):
    return serve_module(APPS / "fanout.py")


@pytest.fixture
def fanout(served, monkeypatch):
    """The app's SDK objects, reaching the served gateway as `ember serve`'s user does (through EMBER_HOME)."""
    monkeypatch.setenv("EMBER_HOME", str(served.home))
    for name in ("EMBER_URL", "EMBER_KEY", "EMBER_CA"):
        monkeypatch.delenv(name, raising=False)
    from ember.package import load_app

    return load_app(str(APPS / "fanout.py")).units


def test_map_over_200_inputs_scales_out_and_keeps_order(fanout, served):
    results = list(fanout["square"].map(range(200)))
    assert [r["square"] for r in results] == [x * x for x in range(200)]
    pids = {r["pid"] for r in results}
    assert len(pids) > 1, "the map's queued calls did not make the autoscaler start a second replica"
    decisions = served.status()["apps"]["fanout"]["functions"]["square"]["decisions"]
    assert sum(d["count"] or 0 for d in decisions if d["action"] == "start") >= 2


def test_starmap_unordered_outputs_and_exceptions(fanout):
    assert list(fanout["add"].starmap([(1, 2), (3, 4), (5, 6)])) == [3, 7, 11]
    assert list(fanout["add"].map([1, 2, 3], [10, 20, 30])) == [11, 22, 33]
    assert list(fanout["add"].map([1, 2], kwargs={"b": 100})) == [101, 102]
    assert sorted(fanout["add"].map(range(20), order_outputs=False)) == list(range(20))

    outcomes = list(fanout["picky"].map(range(1, 7), return_exceptions=True))
    assert [o for o in outcomes if not isinstance(o, RemoteError)] == [1, 2, 4, 5]
    errors = [o for o in outcomes if isinstance(o, RemoteError)]
    assert [e.message for e in errors] == ["ValueError: no multiples of 3: 3", "ValueError: no multiples of 3: 6"]
    with pytest.raises(RemoteError, match="no multiples of 3: 3"):
        list(fanout["picky"].map(range(1, 7)))


def test_aio_twins(fanout):
    async def main():
        one = await fanout["add"].remote.aio(2, b=3)
        many = [v async for v in fanout["add"].map.aio([1, 2, 3], [1, 1, 1])]
        call = await fanout["add"].spawn.aio(40, 2)
        return one, many, await call.get.aio(timeout=30)

    assert asyncio.run(main()) == (5, [2, 3, 4], 42)


def test_spawn_then_get_from_another_client(fanout, served):
    call = fanout["wait"].spawn(0.5)
    assert isinstance(call, FunctionCall) and call.call_id.startswith("fc-")
    assert call.get(timeout=30) == 0.5
    # Another process knows only the id: a plain HTTPS client with its own key reads the same record.
    with served.client(served.key("other")) as http:
        record = http.get(f"/calls/{call.call_id}").json()
    assert record["state"] == "succeeded" and record["result"] == 0.5 and record["function"] == "wait"
    assert FunctionCall.from_id(call.call_id).get() == 0.5

    pending = fanout["wait"].spawn(2)
    with pytest.raises(TimeoutError):
        pending.get(timeout=0.2)
    assert pending.get(timeout=30) == 2

    failing = fanout["picky"].spawn(3)
    with pytest.raises(RemoteError) as failed:
        failing.get(timeout=30)
    assert failed.value.status == 500 and failed.value.type == "function_error"


def test_cancel_stops_a_running_call(fanout, served, tmp_path):
    marker = tmp_path / "marker"
    call = fanout["wait"].spawn(60, marker=str(marker))
    deadline = time.monotonic() + 30
    while served.status()["apps"]["fanout"]["functions"]["wait"]["in_flight"] == 0:
        assert time.monotonic() < deadline, "the spawned call never reached a replica"
        time.sleep(0.05)
    call.cancel()
    deadline = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < deadline, "the call was not cancelled in its replica"
        time.sleep(0.05)
    assert marker.read_text() == "cancelled"
    with pytest.raises(RemoteError) as cancelled:
        call.get(timeout=5)
    assert cancelled.value.type == "cancelled"
    assert served.in_flight_after_settling("fanout", "wait") == 0


def test_a_class_methods_map_and_spawn(fanout, served):
    doubler = fanout["Doubler"]()
    assert list(doubler.double.map([1, 2, 3])) == [2, 4, 6]
    call = doubler.double.spawn(x=21)
    assert call.get(timeout=30) == 42
    scoped = served.cli("keys", "create", "--quiet", "--name", "doubler-only", "--scope", "fn:fanout/Doubler").stdout
    with served.client(scoped.strip()) as http:
        record = http.get(f"/calls/{call.call_id}").json()  # a key for the class may read its methods' calls
    assert record["function"] == "Doubler.double" and record["result"] == 42


def test_cancel_of_a_queued_call_means_it_never_runs(fanout, served, tmp_path):
    running, queued = tmp_path / "running", tmp_path / "queued"
    first = fanout["one_at_a_time"].spawn(60, str(running))
    deadline = time.monotonic() + 30
    while not running.exists():
        assert time.monotonic() < deadline, "the first call never started"
        time.sleep(0.05)
    second = fanout["one_at_a_time"].spawn(0, str(queued))  # max_replicas=1, max_concurrency=1: it waits
    second.cancel()
    first.cancel()
    time.sleep(0.5)  # the slot the first call held is free now: a queued call that survived would start
    assert not queued.exists()
    for call in (first, second):
        with pytest.raises(RemoteError) as cancelled:
            call.get(timeout=5)
        assert cancelled.value.type == "cancelled"
    assert served.status()["apps"]["fanout"]["functions"]["one_at_a_time"]["queue_depth"] == 0


def test_a_map_sharing_a_queue_with_another_key_resubmits_the_calls_that_gave_way(fanout, served):
    """One slot, a queue of 4, and another key calling the same function meanwhile: the map's queued calls give
    their places to the other key's (429 queue_share, gateway/queue.py) and the SDK sends them again."""
    import threading

    import httpx

    other, stop, statuses = served.key("other"), threading.Event(), []

    def other_key():
        with served.client(other, timeout=60) as http:
            while not stop.is_set():
                statuses.append(http.post("/fanout/narrow", json={"x": -1}).status_code)

    threads = [threading.Thread(target=other_key) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        # the other key's calls are coming before the map starts (on a loaded machine, connecting alone took long
        # enough for the map to pass without ever meeting them)
        deadline = time.monotonic() + 30
        while len(statuses) < 4:
            assert time.monotonic() < deadline, f"the other key's calls did not get through: {statuses}"
            time.sleep(0.01)
        assert list(fanout["narrow"].map(range(20))) == list(range(20))
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert 200 in statuses
    with httpx.Client(verify=served.tls()) as http:
        metrics = http.get(f"{served.url}/metrics").text
    assert 'ember_requests_total{app="fanout",function="narrow",code="429"}' in metrics  # places were given up


def test_an_argument_json_cannot_carry_is_named_with_what_to_send(fanout):
    """bytes, a set or NaN failed inside httpx with "Object of type bytes is not JSON serializable", naming neither
    the argument nor a way out; .map with return_exceptions keeps the other inputs going."""
    with pytest.raises(TypeError, match=r"argument 'b' of add cannot be sent .*send bytes as base64 text"):
        fanout["add"].remote(1, b=b"\x00")
    with pytest.raises(ValueError, match=r"argument 'a' of add cannot be sent \(Out of range float"):
        fanout["add"].remote(float("nan"))
    with pytest.raises(TypeError, match=r"argument 'x' of Doubler.double cannot be sent .*a set as a list"):
        fanout["Doubler"]().double.remote({1, 2})
    results = list(fanout["add"].map([1, {2}, 3], return_exceptions=True))
    assert results[0] == 1 and results[2] == 3 and "argument 'a' of add" in str(results[1])
    assert asyncio.run(fanout["add"].remote.aio(2, b=3)) == 5


def test_a_large_result_is_relayed_and_a_spawned_one_kept_up_to_its_limit(fanout):
    """The gateway read a call's whole result into its memory before sending it (a gigabyte result: a gigabyte
    held per call); past 256 KiB it now relays it as it comes. A spawned call's result is kept in the gateway's
    database for its caller, up to 64 MiB; a larger one fails by name rather than being written there whole."""
    from ember.gateway.calls import MAX_STORED_RESULT

    assert fanout["blob"].remote(3_000_000) == "x" * 3_000_000
    assert fanout["blob"].spawn(1_000_000).get(timeout=60) == "x" * 1_000_000
    with pytest.raises(RemoteError, match="result_too_large"):
        fanout["blob"].spawn(MAX_STORED_RESULT + 1).get(timeout=60)
    assert fanout["blob"].remote(10) == "x" * 10   # the replica's slot came back
