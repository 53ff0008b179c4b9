"""End to end: a burst at zero replicas scales out, every call succeeds, and it all goes back to zero;
a full queue answers 503 with Retry-After (the bound is the function's `queue_bound`)."""
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

APPS = Path(__file__).parent / "apps"


def test_burst_at_zero_scales_out_then_back_to_zero_and_a_full_queue_gets_503(serve):
    served = serve(APPS / "burst.py")
    functions = lambda: served.status()["apps"]["burst"]["functions"]  # noqa: E731
    assert functions()["work"]["replicas"] == []
    with served.client(served.key()) as http, ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda _: http.post("/burst/work", json={"seconds": 1.0}), range(10)))
        assert [r.status_code for r in replies] == [200] * 10
        replicas = {r.headers["x-ember-replica"] for r in replies}
        assert 2 <= len(replicas) <= 3  # max_replicas=3
        assert len({r.json()["result"] for r in replies}) == len(replicas)  # one process per replica
        work = functions()["work"]
        assert sum(d["count"] for d in work["decisions"] if d["action"] == "start") == len(replicas)
        assert all(d["reason"] for d in work["decisions"])
        text = served.cli("status").stdout
        assert "work: replicas 0 starting, " in text and "decision at " in text

        # scaledown_window=2 s makes a 20 s stable window: the burst leaves it, and its panic hold ends, 20 s on
        deadline = time.monotonic() + 40
        while functions()["work"]["replicas"]:
            assert time.monotonic() < deadline, "the burst's replicas never went back to zero"
            time.sleep(0.3)
        assert [d["action"] for d in functions()["work"]["decisions"]].count("evict") == len(replicas)

        running = pool.submit(http.post, "/burst/slow", json={"seconds": 8.0})  # outlasts slow status polls under load
        deadline = time.monotonic() + 20
        while functions()["slow"]["in_flight"] == 0:
            assert time.monotonic() < deadline, "the slow call never started"
            time.sleep(0.1)
        queued = [pool.submit(http.post, "/burst/slow", json={"seconds": 0.1}) for _ in range(2)]
        while functions()["slow"]["queue_depth"] < 2:
            time.sleep(0.1)
        overflow = http.post("/burst/slow", json={"seconds": 0.1})
        assert overflow.status_code == 503 and int(overflow.headers["retry-after"]) >= 1
        assert overflow.json()["error"]["type"] == "overloaded" and "bound 2" in overflow.json()["error"]["message"]
        assert [f.result().status_code for f in [running, *queued]] == [200, 200, 200]
