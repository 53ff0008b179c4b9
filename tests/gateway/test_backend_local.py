"""The local backend: GPUs handed out by CUDA_VISIBLE_DEVICES, a CPU fallback, parking with a host-RAM budget."""
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ember.gateway.backends.local import parked_over_budget, parse_size
from ember.spec import FunctionSpec, SpecError, build_spec

APPS = Path(__file__).parent / "apps"


def wait_for(check, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def test_sizes_and_budget_pick_the_oldest_parked():
    assert parse_size("8GiB") == 8 * 2**30 and parse_size("512M") == 512 * 2**20 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match="write it like 8GiB"):
        parse_size("eight gigs")
    parked = [("new", 100, 3.0), ("old", 100, 1.0), ("mid", 100, 2.0)]
    assert parked_over_budget(parked, 300) == []
    assert parked_over_budget(parked, 250) == ["old"]
    assert parked_over_budget(parked, 0) == ["old", "mid", "new"]


def test_park_after_is_checked_against_the_window():
    assert FunctionSpec(park_after=2, scaledown_window=10).park_after == 2
    with pytest.raises(SpecError, match=r"park_after \(10\) must be < scaledown_window \(10\)"):
        build_spec("@app.function", {"park_after": 10, "scaledown_window": 10})
    with pytest.raises(SpecError, match="park_after: Input should be greater than 0"):
        build_spec("@app.function", {"park_after": 0})


def test_each_gpu_replica_gets_its_own_device_and_a_third_waits(serve, monkeypatch):
    monkeypatch.setenv("EMBER_GPUS", "0,1")
    served = serve(APPS / "gpus.py")
    with served.client(served.key()) as http:
        assert http.post("/gpus/cpu", json={}).json()["result"] == ""  # no gpu= -> no GPU
    # three replicas kept (min_replicas=3), whatever the load: the third waits for one of the two GPUs
    served.cli("deploy", str(APPS / "gpu_trio.py"))
    replicas = lambda: served.status()["apps"]["trio"]["functions"]["devices"]["replicas"]  # noqa: E731

    def waiting():
        return [r for r in replicas() if r["note"] and "waiting for 1 free GPU(s): 0 of 2 free" in r["note"]]

    wait_for(waiting, 20, "a third replica to wait for a GPU")
    def two_hot():
        hot = [r for r in replicas() if r["state"] == "hot"]
        return hot if len(hot) == 2 else None

    hot = wait_for(two_hot, 20, "two replicas to start")
    assert sorted(g for r in hot for g in r["gpus"]) == ["0", "1"]  # never the same GPU twice
    with served.client(served.key()) as http, ThreadPoolExecutor(4) as pool:
        calls = [pool.submit(http.post, "/trio/devices", json={"seconds": 0.5}) for _ in range(4)]
        replies = [c.result() for c in calls]
    assert all(r.status_code == 200 for r in replies)
    assert {r.json()["result"] for r in replies} <= {"0", "1"}


def test_a_start_waiting_for_a_gpu_evicts_the_parked_replica_holding_it(serve, monkeypatch):
    monkeypatch.setenv("EMBER_GPUS", "0")
    served = serve(APPS / "gpus.py")
    functions = lambda: served.status()["apps"]["gpus"]["functions"]  # noqa: E731
    with served.client(served.key()) as http:
        assert http.post("/gpus/parks", json={}).json()["result"] == "0"
        wait_for(lambda: [r for r in functions()["parks"]["replicas"] if r["state"] == "parked"], 10, "a park")
        assert http.post("/gpus/devices", json={}).json()["result"] == "0"  # the only GPU, freed for it
    [evict] = [d for d in functions()["parks"]["decisions"] if d["action"] == "evict"]
    assert evict["reason"] == "a start waits for a GPU: parked replica frees GPU 0"


def test_gpu_function_runs_on_a_cpu_machine_with_a_warning(serve, monkeypatch):
    monkeypatch.setenv("EMBER_GPUS", "")
    served = serve(APPS / "gpus.py")
    with served.client(served.key()) as http:
        assert http.post("/gpus/devices", json={}).json()["result"] == ""
    [replica] = served.status()["apps"]["gpus"]["functions"]["devices"]["replicas"]
    assert "this machine has no GPU: running on CPU" in replica["note"]
    assert "note: gpu='H200' asked for, but this machine has no GPU: running on CPU" in served.cli("status").stdout


def test_required_gpu_on_a_cpu_machine_fails_the_start_with_the_fix(serve, monkeypatch):
    monkeypatch.setenv("EMBER_GPUS", "")
    monkeypatch.setenv("EMBER_REQUIRE_GPU", "1")
    served = serve(APPS / "gpus.py")
    with served.client(served.key()) as http:
        reply = http.post("/gpus/devices", json={})
    assert reply.status_code == 503 and reply.headers["retry-after"]
    assert "has no GPU (EMBER_REQUIRE_GPU=1); unset it to run on CPU" in reply.json()["error"]["message"]


def test_idle_replica_parks_wakes_on_a_call_and_is_evicted_after_the_window(serve):
    served = serve(APPS / "parking.py")
    model = lambda: served.status()["apps"]["parking"]["functions"]["Model"]  # noqa: E731
    with served.client(served.key()) as http:
        first = http.post("/parking/Model.predict", json={})
        assert first.json()["result"]["parks"] == 0
        [parked] = wait_for(
            lambda: [r for r in model()["replicas"] if r["state"] == "parked" and r["parked_bytes"]], 10, "a park"
        )
        assert parked["parked_bytes"] > 10 * 2**20  # the worker's resident host RAM, what parking it costs the node
        second = http.post("/parking/Model.predict", json={})
    assert second.headers["x-ember-replica"] == first.headers["x-ember-replica"] == parked["id"]
    assert second.headers["x-ember-cold-start"].startswith("parked; ms=")
    assert second.json()["result"] == {"pid": first.json()["result"]["pid"], "parks": 1, "wakes": 1}
    assert any(d["action"] == "park" for d in model()["decisions"])
    wait_for(lambda: model()["replicas"] == [], 15, "eviction after scaledown_window")
    assert any(d["action"] == "evict" and "scaledown_window" in d["reason"] for d in model()["decisions"])


def test_a_park_over_the_host_ram_budget_evicts_instead(serve):
    served = serve(APPS / "parking.py", "--parked-ram", "1MiB")
    model = lambda: served.status()["apps"]["parking"]["functions"]["Model"]  # noqa: E731
    with served.client(served.key()) as http:
        assert http.post("/parking/Model.predict", json={}).status_code == 200
    wait_for(lambda: model()["replicas"] == [], 10, "the over-budget park to evict")
    [evict] = [d for d in model()["decisions"] if d["action"] == "evict"]
    assert "> budget 1048576: oldest parked goes" in evict["reason"]


def test_a_function_whose_parks_fail_twice_in_a_row_parks_no_more(serve):
    """A park that fails other than by a refusal (here the app's park hook raises) stops the replica, to free its
    GPU; each such park turned a wake into a start, so after two in a row the policy parks the function no more and
    its replica stays hot while idle."""
    served = serve(APPS / "parking.py")
    unparkable = lambda: served.status()["apps"]["parking"]["functions"]["Unparkable"]  # noqa: E731
    parks = lambda: sum(d["action"] == "park" for d in unparkable()["decisions"])  # noqa: E731
    with served.client(served.key()) as http:
        replicas = []
        for attempt in (1, 2):
            reply = http.post("/parking/Unparkable.predict", json={})
            assert reply.status_code == 200 and reply.json()["result"]["parks"] == 0
            replicas.append(reply.headers["x-ember-replica"])
            wait_for(lambda n=attempt: parks() == n and unparkable()["replicas"] == [], 15,
                     f"park {attempt} to fail and stop its replica")
        third = http.post("/parking/Unparkable.predict", json={})
        assert third.status_code == 200 and third.headers["x-ember-replica"] not in replicas
        time.sleep(3)   # idle past park_after (0.5 s) six times over: no third park
        assert parks() == 2
        [replica] = unparkable()["replicas"]
        assert replica["state"] == "hot" and replica["id"] == third.headers["x-ember-replica"]


@pytest.mark.gpu
def test_worker_park_releases_cuda_memory_and_wake_restores_the_weights():
    import asyncio

    import torch

    from ember.runtime.worker import Parking

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    class Model:
        def __init__(self):
            self.net = torch.nn.Sequential(torch.nn.Linear(8192, 8192), torch.nn.Linear(8192, 8)).cuda().half()

    with torch.no_grad():  # a graph kept for backward would hold the weights on the GPU
        model = Model()
        before = [p.detach().cpu() for p in model.net.parameters()]
        x = torch.randn(2, 8192, device="cuda", dtype=torch.half)
        expected = model.net(x)
        reserved = torch.cuda.memory_reserved()
        parking = Parking(model)
        parked = asyncio.run(parking.park())
        weights = sum(p.numel() * 2 for p in before)
        assert parked["device_bytes_released"] >= weights > 128 * 2**20  # as the driver counts: given back to it
        assert torch.cuda.memory_reserved() <= reserved - weights + 2**21
        assert all(p.device.type == "cpu" and p.is_pinned() for p in model.net.parameters())
        assert asyncio.run(parking.wake())["parked"] is False
        assert all(torch.equal(p.cpu(), b) for p, b in zip(model.net.parameters(), before))
        assert torch.equal(model.net(x), expected)


def test_a_start_stopped_while_it_waits_for_a_gpu_never_spawns(tmp_path):
    import asyncio

    from ember.gateway.backends.local import LocalBackend
    async def scenario():
        backend = LocalBackend(tmp_path, gpus=["0"])
        holder, waiter = backend.new_replica("a", "f"), backend.new_replica("a", "f")
        await backend.gpus.acquire(holder, 1)
        start = asyncio.create_task(backend.start(waiter, tmp_path / "unused.pkg", FunctionSpec(gpu="H200")))
        while not backend.gpus.waiting:
            await asyncio.sleep(0.01)
        assert "waiting for 1 free GPU(s): 0 of 1 free" in waiter.note
        waiter.stop()
        await backend.stop(waiter)  # nothing to signal yet
        await backend.gpus.release(holder)
        await asyncio.wait_for(start, 5)
        return waiter, backend

    waiter, backend = asyncio.run(scenario())
    assert waiter.process is None and backend.gpus.holders == {}


def test_a_deployed_app_gets_a_warm_fork_server_before_its_first_call(serve):
    served = serve(APPS / "quick.py")
    gateway_log = served.home / "logs" / "gateway.log"
    wait_for(lambda: gateway_log.exists() and "fork server of quick ready" in gateway_log.read_text(), 30,
             "the fork server to warm up at deploy")
    with served.client(served.key()) as http:
        first = http.post("/quick/add", json={"a": 1, "b": 2})
    breakdown = first.headers["x-ember-start-breakdown"]
    assert "start=fork" in breakdown and "forkserver_wait_ms" not in breakdown, breakdown


def test_a_replica_that_cannot_park_stays_hot_and_its_function_parks_no_more(serve):
    """park_with="cuda-checkpoint" where no driver can checkpoint (this CPU machine; an H100 whose driver answers
    801): the worker undoes its park hooks and answers 409 park_refused. The replica serves on, hot, in the same
    process, and the policy parks the function no more, whatever its park_after says: its replicas scale down as
    those of a function that does not park do (a stop, once the stable window's average says so)."""
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has a CUDA driver, which may checkpoint; tests/gpu covers that")
    served = serve(APPS / "parking.py")
    opaque = lambda: served.status()["apps"]["parking"]["functions"]["Opaque"]  # noqa: E731
    with served.client(served.key()) as http:
        first = http.post("/parking/Opaque.predict", json={})
        assert first.status_code == 200 and first.json()["result"]["parks"] == 0
        wait_for(lambda: any(d["action"] == "park" for d in opaque()["decisions"]), 10, "a park attempt")
        [replica] = wait_for(lambda: [r for r in opaque()["replicas"] if r["state"] == "hot"], 10,
                             "the refused park to leave the replica hot")
        second = http.post("/parking/Opaque.predict", json={})
        assert replica["id"] == first.headers["x-ember-replica"] == second.headers["x-ember-replica"]
        assert second.json()["result"] == {"pid": first.json()["result"]["pid"], "parks": 1, "wakes": 1}
        assert "x-ember-cold-start" not in second.headers
        time.sleep(3)   # idle past park_after (0.5 s) six times over: no second park
        assert sum(d["action"] == "park" for d in opaque()["decisions"]) == 1
        third = http.post("/parking/Opaque.predict", json={})
        assert third.json()["result"] == second.json()["result"] and "x-ember-cold-start" not in third.headers
