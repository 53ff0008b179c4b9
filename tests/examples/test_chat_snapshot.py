"""examples/chat.py (snapshot=True) under `ember serve`: the first cold start writes the weight snapshot, the next
restores it."""

import json
import time
from pathlib import Path

import boto3
import pytest

from tests.snapshot.conftest import s3_endpoint, s3_env  # noqa: F401  (moto_server fixtures)

APP = Path(__file__).resolve().parents[2] / "examples" / "chat.py"
REQUEST = {"model": "tiny-qwen3", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}


@pytest.fixture(autouse=True)
def short_window(monkeypatch):
    monkeypatch.setenv("EMBER_CHAT_SCALEDOWN_WINDOW", "1")  # so a test sees two cold starts


def breakdown(response) -> dict[str, str]:
    assert "x-ember-cold-start" in response.headers, "the call did not wait for a cold start"
    return dict(part.split("=", 1) for part in response.headers["x-ember-start-breakdown"].split(", "))


def replicas(served) -> list[dict]:
    return [r for fn in served.status()["apps"]["chat"]["functions"].values() for r in fn["replicas"]]


def test_second_cold_start_restores_the_snapshot_the_first_wrote(serve):
    served = serve(APP, timeout=120)
    with served.client(served.key(), timeout=120) as http:
        first = http.post("/chat/v1/completions", json=REQUEST)
        assert first.status_code == 200, first.text
        assert breakdown(first)["weights"] == "full"
        (snapshot,) = json.loads(served.cli("snapshot", "ls", "--json").stdout)
        assert snapshot["names"][0].startswith("tiny-qwen3.float32.") and snapshot["tensors"] > 0

        deadline = time.monotonic() + 30  # 1 s scale-down window, then the replica stops
        while replicas(served):
            assert time.monotonic() < deadline, f"the replica never scaled down: {replicas(served)}"
            time.sleep(0.2)

        second = http.post("/chat/v1/completions", json=REQUEST)
        assert second.status_code == 200, second.text
        assert second.headers["x-ember-replica"] != first.headers["x-ember-replica"]
        start = breakdown(second)
        assert start["weights"] == "snapshot" and int(start["weights_ms"]) < int(start["enter_ms"])
        assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert [s["id"] for s in json.loads(served.cli("snapshot", "ls", "--json").stdout)] == [snapshot["id"]]


def test_the_gateway_environment_picks_the_store(serve, s3_env, monkeypatch):  # noqa: F811
    boto3.client("s3").create_bucket(Bucket="fleet")
    monkeypatch.setenv("EMBER_SNAPSHOT_STORE", "s3://fleet/snapshots")
    served = serve(APP, timeout=120)
    with served.client(served.key(), timeout=120) as http:
        reply = http.post("/chat/v1/completions", json=REQUEST)
        assert reply.status_code == 200, reply.text
        assert breakdown(reply)["weights"] == "full"
    (snapshot,) = json.loads(served.cli("snapshot", "ls", "--json", "--store", "s3://fleet/snapshots").stdout)
    assert snapshot["names"][0].startswith("tiny-qwen3.float32.")
    assert json.loads(served.cli("snapshot", "ls", "--json").stdout) == []  # nothing in the local store
