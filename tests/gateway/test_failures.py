"""A replica that crashes in `enter` is reported, and its callers get a 503 instead of hanging."""
import time
from pathlib import Path

APPS = Path(__file__).parent / "apps"


def test_crash_in_enter_is_reported_and_answered_503(serve):
    served = serve(APPS / "broken.py")
    with served.client(served.key(), timeout=30) as http:
        began = time.monotonic()
        reply = http.post("/broken/Model.predict", json={"x": 1})
        assert time.monotonic() - began < 30
    assert reply.status_code == 503
    assert reply.json()["error"]["type"] == "replica_failed"
    assert "ZeroDivisionError: weights are missing" in reply.json()["error"]["message"]
    assert int(reply.headers["retry-after"]) >= 1

    model = served.status()["apps"]["broken"]["functions"]["Model"]
    assert model["replicas"] == []
    [failure] = model["failed"]
    assert "enter failed: ZeroDivisionError: weights are missing" in failure["error"]

    text = served.cli("status").stdout
    assert "FAILED" in text and "ZeroDivisionError" in text
    logs = served.cli("logs").stdout
    assert f"replica {failure['id']} of broken/Model failed" in logs
    assert "raise ZeroDivisionError" in logs  # the traceback from the replica's log
    replica_log = served.cli("logs", "--replica", failure["id"]).stdout
    assert "Traceback" in replica_log


def test_a_crashing_replica_is_not_restarted_without_a_new_call(serve):
    served = serve(APPS / "broken.py")
    with served.client(served.key(), timeout=30) as http:
        assert http.post("/broken/Model.predict", json={"x": 1}).status_code == 503
        time.sleep(2)  # several autoscaler ticks with the failed call still in its demand window
        assert len(served.status()["apps"]["broken"]["functions"]["Model"]["failed"]) == 1
        assert http.post("/broken/Model.predict", json={"x": 1}).status_code == 503
    model = served.status()["apps"]["broken"]["functions"]["Model"]
    assert len(model["failed"]) == 2 and [d["action"] for d in model["decisions"]] == ["start", "start"]
