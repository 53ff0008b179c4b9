"""The autoscaler loop carries out the policy on real replicas: min_replicas pre-warms, load adds replicas up to max."""
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

APPS = Path(__file__).parent / "apps"


def test_min_replicas_and_scale_out_to_max(serve):
    served = serve(APPS / "scaling.py")
    deadline = time.monotonic() + 30
    while not [r for r in served.status()["apps"]["scaling"]["functions"]["warm"]["replicas"] if r["state"] == "hot"]:
        assert time.monotonic() < deadline, "min_replicas=1 never started a replica"
        time.sleep(0.2)
    time.sleep(1.5)  # past its scaledown_window: min_replicas keeps it
    with served.client(served.key()) as http:
        warm = http.post("/scaling/warm", json={})
        assert warm.status_code == 200 and "x-ember-cold-start" not in warm.headers

        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda _: http.post("/scaling/busy", json={"seconds": 1.0}), range(6)))
    assert all(r.status_code == 200 for r in replies)
    replicas = {r.headers["x-ember-replica"] for r in replies}
    assert len(replicas) == 2  # six 1 s calls at max_concurrency=1 brought a second replica, and no more
    assert len({r.json()["result"] for r in replies}) == 2
    busy = served.status()["apps"]["scaling"]["functions"]["busy"]
    assert sum(d["count"] or 0 for d in busy["decisions"] if d["action"] == "start") == 2
