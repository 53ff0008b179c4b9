"""Spawned calls over HTTP: `Prefer: respond-async` answers 202 with the call's id, GET /calls/{id} waits for and
reads its record, keys are held to the call's function, and records outlive the gateway process that ran them."""
from pathlib import Path

import pytest

from ember.gateway.calls import FAILED, PENDING, CallStore
from ember.gateway.keys import KeyStore

APPS = Path(__file__).parents[1] / "runtime" / "apps"
SPAWN = {"Prefer": "respond-async"}


@pytest.fixture(scope="module")
def served(serve_module):
    return serve_module(APPS / "generators.py")


def test_spawn_answers_202_and_the_record_answers_the_result(served):
    with served.client(served.key()) as http:
        spawned = http.post("/generators/plain", json={}, headers=SPAWN)
        assert spawned.status_code == 202
        call_id = spawned.json()["call_id"]
        assert spawned.headers["location"] == f"/calls/{call_id}"
        record = http.get(f"/calls/{call_id}", params={"wait": 30}).json()
    assert record["state"] == "succeeded" and record["status"] == 200 and record["result"] == 1
    assert record["app"] == "generators" and record["function"] == "plain" and record["finished"] >= record["created"]


def test_a_generator_cannot_be_spawned_and_bad_ids_and_keys_are_refused(served):
    with served.client(served.key()) as http:
        call_id = http.post("/generators/count", json={"n": 3}, headers=SPAWN).json()["call_id"]
        record = http.get(f"/calls/{call_id}", params={"wait": 30}).json()
        assert record["state"] == "failed" and record["error"]["type"] == "is_generator"
        missing = http.get("/calls/fc-nothing")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
        assert http.delete("/calls/fc-nothing").status_code == 404
    scoped = KeyStore(served.home / "ember.db").create("other-fn", scopes=["fn:generators/count"])[1]
    with served.client(scoped) as http:
        refused = http.get(f"/calls/{call_id}")  # the call was to count: this key may read it
        assert refused.status_code == 200
    with served.client(served.key()) as http:
        plain_id = http.post("/generators/plain", json={}, headers=SPAWN).json()["call_id"]
    with served.client(scoped) as http:
        assert http.get(f"/calls/{plain_id}").status_code == 403
    with served.client(None) as http:
        assert http.get(f"/calls/{plain_id}").status_code == 401


def test_calls_a_stopped_gateway_left_pending_are_failed_when_it_starts_again(tmp_path):
    db = tmp_path / "ember.db"
    store = CallStore(db)
    pending = store.create("app", "fn")
    done = store.create("app", "fn")
    assert store.finish(done, "succeeded", 200, '{"result": 1}')
    assert not store.finish(done, "cancelled", 499, "{}")  # a finished call stays as it ended
    assert store.get(pending)["state"] == PENDING
    reopened = CallStore(db)
    assert reopened.get(pending)["state"] == FAILED and "gateway_restarted" in reopened.get(pending)["reply"]
    assert reopened.get(done)["state"] == "succeeded"


def test_spawned_calls_are_counted_by_how_they_ended(served):
    def counted(state: str, function: str) -> int:
        text = served.client(None).get("/metrics").text
        line = f'ember_spawned_calls_total{{app="generators",function="{function}",state="{state}"}} '
        return next((int(row[len(line):]) for row in text.splitlines() if row.startswith(line)), 0)

    before_ok, before_failed = counted("succeeded", "plain"), counted("failed", "fails_after")
    with served.client(served.key()) as http:
        for path, body in [("plain", {}), ("fails_after", {"n": 0})]:
            call_id = http.post(f"/generators/{path}", json=body, headers=SPAWN).json()["call_id"]
            assert http.get(f"/calls/{call_id}", params={"wait": 30}).json()["state"] != "pending"
    assert counted("succeeded", "plain") == before_ok + 1
    assert counted("failed", "fails_after") == before_failed + 1


def test_spawned_calls_past_the_gateways_bounds_are_429_and_free_their_room_when_done(tmp_path, monkeypatch):
    """Each spawned call holds its body until it runs, outside the budget of bodies being read: a client that
    spawned without end held them all in the gateway's memory."""
    import asyncio

    from ember.gateway import calls
    from ember.gateway.errors import ApiError

    monkeypatch.setattr(calls, "MAX_SPAWNED", 3)
    monkeypatch.setattr(calls, "MAX_SPAWNED_BYTES", 1000)
    spawned = calls.SpawnedCalls(CallStore(tmp_path / "calls.db"))

    async def scenario():
        go = asyncio.Event()

        async def run():
            await go.wait()
            from starlette.responses import Response
            return Response(b'{"result": 1}', 200)

        async def settle():
            pass

        await spawned.spawn("a", "f", run, settle, 400)
        await spawned.spawn("a", "f", run, settle, 400)
        with pytest.raises(ApiError) as bytes_over:
            await spawned.spawn("a", "f", run, settle, 400)
        await spawned.spawn("a", "f", run, settle, 100)
        with pytest.raises(ApiError) as count_over:
            await spawned.spawn("a", "f", run, settle, 0)
        go.set()
        while spawned.running:
            await asyncio.sleep(0.01)
        assert spawned.held == 0
        await spawned.spawn("a", "f", run, settle, 900)   # room again once they ended
        while spawned.running:
            await asyncio.sleep(0.01)
        return bytes_over.value, count_over.value

    bytes_over, count_over = asyncio.run(scenario())
    assert bytes_over.status == count_over.status == 429 and bytes_over.type == "too_many_spawned_calls"
    assert bytes_over.headers["Retry-After"] == "5"
