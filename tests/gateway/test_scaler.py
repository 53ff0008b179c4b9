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


def test_the_autoscaler_counts_an_llm_request_by_its_sequences(serve):
    """Llm: target_concurrency=4. One completion of n=8 asks for 8 slots, so the autoscaler starts two replicas for
    it (one, were it counted as one call); the request itself runs on one, which can hold all 8."""
    served = serve(APPS / "scaling.py")
    llm = {"prompt": "hi", "n": 8, "max_tokens": 200, "delay": 0.05, "stream": True}
    with served.client(served.key(), timeout=60) as http, \
            http.stream("POST", "/scaling/v1/completions", json=llm) as reply:
        lines = reply.iter_lines()   # held: a dropped iterator closes the stream
        assert next(lines).startswith("data:")
        deadline = time.monotonic() + 20
        while len(hot := [r for r in served.status()["apps"]["scaling"]["functions"]["Llm"]["replicas"]
                          if r["state"] == "hot"]) < 2:
            assert time.monotonic() < deadline, "a second replica never started for the request's 8 sequences"
            time.sleep(0.2)
        assert sorted(r["load"] for r in hot) == [0, 8]
    decisions = served.status()["apps"]["scaling"]["functions"]["Llm"]["decisions"]
    assert sum(d["count"] or 0 for d in decisions if d["action"] == "start") == 2
