"""retries= in the gateway: a call whose function raised runs again after its backoff until it succeeds or the
retries run out; a function without retries runs once; /metrics counts each retry."""
import re
from pathlib import Path

import pytest

APPS = Path(__file__).parent / "apps"


@pytest.fixture(scope="module")
def served(serve_module):
    return serve_module(APPS / "retrying.py")


def retries_counted(http, function: str) -> int:
    text = http.get("/metrics").text
    found = re.search(rf'ember_call_retries_total{{app="retrying",function="{function}",reason="function_error"}} '
                      r"(\d+)", text)
    return int(found.group(1)) if found else 0


def test_a_call_that_raises_twice_succeeds_on_its_third_attempt(served, tmp_path):
    attempts = tmp_path / "attempts"
    with served.client(served.key()) as http:
        before = retries_counted(http, "flaky")
        reply = http.post("/retrying/flaky", json={"path": str(attempts), "fail_times": 2})
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"result": 3}
        assert retries_counted(http, "flaky") == before + 2
    times = [float(t) for t in attempts.read_text().split()]
    assert len(times) == 3
    assert times[1] - times[0] >= 0.2 and times[2] - times[1] >= 0.4  # initial_delay, then doubled


def test_retries_run_out_and_the_last_error_is_answered(served, tmp_path):
    attempts = tmp_path / "attempts"
    with served.client(served.key()) as http:
        reply = http.post("/retrying/flaky", json={"path": str(attempts), "fail_times": 10})
    assert reply.status_code == 500
    assert reply.json()["error"] == {"type": "function_error", "message": "RuntimeError: attempt 4 fails"}
    assert len(attempts.read_text().split()) == 4  # the first attempt and max_retries=3


def test_a_function_without_retries_runs_once(served, tmp_path):
    attempts = tmp_path / "attempts"
    with served.client(served.key()) as http:
        reply = http.post("/retrying/once", json={"path": str(attempts)})
        assert reply.status_code == 500 and reply.json()["error"]["message"] == "RuntimeError: attempt 1 fails"
        assert retries_counted(http, "once") == 0
    assert len(attempts.read_text().split()) == 1
