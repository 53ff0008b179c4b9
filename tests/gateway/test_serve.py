"""`ember serve` end to end over real HTTPS with certificate verification."""
import re
import time
from pathlib import Path

APPS = Path(__file__).parent / "apps"
COLD = re.compile(r"^node-warm; ms=\d+$")


def _live(status: dict, fn: str) -> list[dict]:
    return status["apps"]["quick"]["functions"][fn]["replicas"]


def test_scale_from_zero_to_zero_and_back(serve):
    served = serve(APPS / "quick.py")
    with served.client(served.key()) as http:
        assert _live(served.status(), "add") == []

        first = http.post("/quick/add", json={"a": 2, "b": 3})
        assert first.status_code == 200, first.text
        assert first.json()["result"]["sum"] == 5
        assert COLD.match(first.headers["x-ember-cold-start"])
        replica = first.headers["x-ember-replica"]
        assert "start=fork" in first.headers["x-ember-start-breakdown"]  # from the app's fork server

        warm = http.post("/quick/add", json={"a": 1, "b": 1})
        idle_from = time.monotonic()  # the replica went idle just before this reply arrived
        assert warm.headers["x-ember-replica"] == replica
        assert "x-ember-cold-start" not in warm.headers

        live = _live(served.status(), "add")
        assert [r["id"] for r in live] == [replica] and live[0]["state"] == "hot"

        while _live(served.status(), "add"):
            assert time.monotonic() - idle_from < 20, "replica never scaled down"
            time.sleep(0.3)
        assert time.monotonic() - idle_from >= 1.0  # not before its 1.5 s scaledown_window
        decisions = served.status()["apps"]["quick"]["functions"]["add"]["decisions"]
        assert [d["action"] for d in decisions] == ["start", "evict"]

        again = http.post("/quick/add", json={"a": 4, "b": 4})
        assert again.json()["result"]["sum"] == 8
        assert COLD.match(again.headers["x-ember-cold-start"])
        assert again.headers["x-ember-replica"] != replica
        assert again.json()["result"]["pid"] != first.json()["result"]["pid"]

    with served.client(None) as anonymous:
        metrics = anonymous.get("/metrics").text
    assert 'ember_cold_starts_total{app="quick",function="add",tier="node-warm"} 2' in metrics
    assert 'ember_replica_starts_total{app="quick",function="add",tier="node-warm",start="fork"} 2' in metrics
    assert 'ember_replica_start_phase_seconds_total{app="quick",function="add",phase="fork"}' in metrics


def _error(response, status: int, kind: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["type"] == kind
    assert response.json()["error"]["message"]


def test_errors_are_json(serve):
    served = serve(APPS / "quick.py")
    good = served.key("good")
    with served.client(None) as anonymous:
        _error(anonymous.post("/quick/add", json={"a": 1, "b": 2}), 401, "unauthorized")
    with served.client("ek_deadbeef_not-a-real-key") as wrong:
        _error(wrong.post("/quick/add", json={"a": 1, "b": 2}), 401, "unauthorized")
    with served.client(good) as http:
        _error(http.post("/nope/add", json={}), 404, "not_found")
        _error(http.post("/quick/nope", json={}), 404, "not_found")
        _error(http.post("/quick/add", content=b'{"a": 1,'), 400, "invalid_json")
        _error(http.post("/quick/add", json=[1, 2]), 422, "invalid_arguments")
        _error(http.post("/quick/add", json={"a": 1}), 422, "invalid_arguments")
        _error(http.get("/quick/add"), 405, "method_not_allowed")
        _error(http.post("/quick/sleepy", json={"seconds": 3}), 504, "timeout")
        _error(http.get("/admin/status"), 403, "forbidden")
        assert http.post("/quick/add", json={"a": 1, "b": 2}).status_code == 200

    assert "revoked key" in served.cli("keys", "revoke", "good").stdout
    with served.client(good) as revoked:
        _error(revoked.post("/quick/add", json={"a": 1, "b": 2}), 401, "unauthorized")
    listed = served.cli("keys", "list").stdout
    assert re.search(r"good .* revoked", listed)
