"""`ember serve` as a process a user starts and stops (gateway/serve.py, gateway/home_lock.py): one gateway per
EMBER_HOME, clean SIGTERM/SIGINT with calls in flight, no admin key or gateway.json left behind, a gateway killed
with kill -9 taken over by the next, and the client's error when the recorded gateway is gone."""
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.conftest import ROOT, launch, stop_serve

APP = Path(__file__).parent / "apps" / "slow.py"


def _keys(home: Path) -> list[dict]:
    with sqlite3.connect(home / "ember.db") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT id, name, admin, revoked FROM api_keys")]


def _ember(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.cli", *args], env=os.environ | {"EMBER_HOME": str(home)} | env,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def _banner_key(served) -> str:
    return next(line.split(": ")[-1].strip() for line in served.stdout if line.startswith("API key"))


def test_one_gateway_per_home_and_sigterm_with_a_call_in_flight(tmp_path):
    home, started = tmp_path / "home", []
    try:
        served = launch(home, APP, "--new-key", "me", started=started)
        second = _ember(home, "serve", str(APP), "--port", "0")
        assert second.returncode == 1 and "Traceback" not in second.stderr
        assert f"another `ember serve` (pid {served.process.pid}, {served.url})" in second.stderr
        assert "EMBER_HOME" in second.stderr and "stop it first" in second.stderr
        assert json.loads((home / "gateway.json").read_text())["pid"] == served.process.pid  # not taken over

        admin = [k for k in _keys(home) if k["admin"]]
        assert [(k["name"], k["revoked"]) for k in admin] == [("ember-cli", None)]
        replies = []
        with served.client(_banner_key(served), timeout=30) as http:
            http.post("/slow/wait", json={"seconds": 0}).raise_for_status()  # a replica is up
            caller = threading.Thread(target=lambda: replies.append(http.post("/slow/wait", json={"seconds": 30})))
            caller.start()
            while not served.status()["apps"]["slow"]["functions"]["wait"]["in_flight"]:
                pass
            served.process.send_signal(signal.SIGTERM)
            caller.join(20)
        assert served.process.wait(20) == 0  # a clean stop, not death by the signal
        reply = replies[0]
        assert reply.status_code == 503 and reply.headers["retry-after"]
        assert reply.json()["error"]["type"] == "shutting_down"
        output = "".join(served.stdout)
        assert "Traceback" not in output and "Exception" not in output, output
        assert not (home / "gateway.json").exists() and not (home / "cli.key").exists()
        assert [k for k in _keys(home) if k["admin"]] == []  # the CLI's admin key went with it
    finally:
        for process in started:
            stop_serve(process)


def test_killed_gateway_is_taken_over_and_reruns_keep_one_key_per_purpose(tmp_path):
    home, started = tmp_path / "home", []
    try:
        first = launch(home, APP, "--new-key", "me", started=started)
        old_key = _banner_key(first)
        first.process.kill()  # kill -9: nothing cleaned up
        first.process.wait(10)

        # What it left: a gateway.json naming a dead gateway. Calls say what happened and what to do.
        remote = subprocess.run([sys.executable, "-c", "from ember.package import load_app; "
                                 f"print(load_app({str(APP)!r}).units['wait'].remote(seconds=0))"],
                                env=os.environ | {"EMBER_HOME": str(home)}, capture_output=True, text=True, timeout=60)
        assert remote.returncode == 1
        last = remote.stderr.strip().splitlines()[-1]
        assert last.startswith("ember.client.GatewayUnreachable: no gateway answers at https://127.0.0.1:"), last
        assert "gateway.json" in last and "ember serve APP.py" in last and "ConnectError" not in remote.stderr
        status = _ember(home, "status")
        assert status.returncode == 1 and "ember serve" in status.stderr and "Traceback" not in status.stderr

        second = launch(home, APP, "--new-key", "me", started=started)  # the dead one's lock is taken over
        rows = _keys(home)
        assert [k["revoked"] for k in rows if k["name"] == "ember-cli"] == [None]  # one row, not one per run
        assert sorted(k["revoked"] is None for k in rows if k["name"] == "me") == [False, True]
        assert "replaces key" in "".join(second.stdout)
        with second.client(old_key) as http:
            assert http.post("/slow/wait", json={"seconds": 0}).status_code == 401
        secret = _banner_key(second)
        with second.client(secret) as http:
            assert http.post("/slow/wait", json={"seconds": 0.0314159}).json() == {"result": 0.0314159}
        _operator_sees_calls_and_deploys(home, secret)

        second.process.send_signal(signal.SIGINT)  # Ctrl-C
        assert second.process.wait(20) == 0
        assert "Traceback" not in "".join(second.stdout)
        assert not (home / "gateway.json").exists()
        assert [k for k in _keys(home) if k["admin"]] == []
    finally:
        for process in started:
            stop_serve(process)


def _operator_sees_calls_and_deploys(home: Path, secret: str) -> None:
    """The gateway log a day-one operator reads: one access line per call (who, what, how it went, how long; never
    the key or the body) and a line per deploy."""
    deadline = time.monotonic() + 10
    while True:  # a call's access line is written once its reply has gone out, so it may trail the reply a little
        text = (home / "logs" / "gateway.log").read_text()
        records = [json.loads(line) for line in text.splitlines()]
        calls = [r for r in records if r.get("kind") == "access" and r.get("path") == "/slow/wait"]
        ok = [r for r in calls if r["status"] == 200]
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert ok and {"method", "status", "ms", "app", "function", "key"} <= set(ok[-1])
    assert ok[-1]["app"] == "slow" and ok[-1]["function"] == "wait" and ok[-1]["method"] == "POST"
    assert ok[-1]["key"] == secret.split("_")[1]  # the key's id
    assert [r for r in calls if r["status"] == 401]  # the revoked key's refusal is logged too
    deploys = [r for r in records if r.get("kind") == "deploy" and r.get("app") == "slow"]
    assert deploys and deploys[-1]["version"] >= 1
    assert secret not in text and "0.0314159" not in text  # no key, no body


def test_remote_without_ember_ca_names_the_fix(serve, tmp_path):
    """EMBER_URL and EMBER_KEY from another machine (its own, empty EMBER_HOME): the dev CA is not trusted there."""
    served = serve(APP)
    key = served.key("remote")
    call = ("from ember.package import load_app; "
            f"print(load_app({str(APP)!r}).units['wait'].remote(seconds=0))")
    elsewhere = {"EMBER_HOME": str(tmp_path / "elsewhere"), "EMBER_URL": served.url, "EMBER_KEY": key}

    def remote(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", call], env=os.environ | elsewhere | env, capture_output=True,
                              text=True, timeout=60)

    untrusted = remote()
    assert untrusted.returncode == 1 and "FileNotFoundError" not in untrusted.stderr
    assert "is not trusted" in untrusted.stderr and "set EMBER_CA" in untrusted.stderr
    missing = remote(EMBER_CA=str(tmp_path / "nope.pem"))
    assert f"EMBER_CA={tmp_path / 'nope.pem'} is not a file" in missing.stderr
    assert remote(EMBER_CA=str(served.ca)).stdout.strip() == "0.0"
    with httpx.Client(verify=served.tls()) as http:  # and the server is fine
        assert http.get(f"{served.url}/healthz").status_code == 200


def test_a_stream_running_at_sigterm_ends_with_a_shutting_down_event(tmp_path):
    home, started = tmp_path / "home", []
    try:
        served = launch(home, Path(__file__).parent / "apps" / "streaming.py", "--new-key", "me", "--no-watch",
                        started=started)
        lines = []

        def read_stream() -> None:
            with served.client(_banner_key(served), timeout=30) as http:
                with http.stream("GET", "/streaming/v1/stream", params={"n": 400}) as reply:  # 20 s of events
                    lines.extend(reply.iter_lines())

        reader = threading.Thread(target=read_stream)
        reader.start()
        while not served.status()["apps"]["streaming"]["functions"]["Web"]["in_flight"]:
            pass
        served.process.send_signal(signal.SIGTERM)
        reader.join(30)
        assert served.process.wait(20) == 0
    finally:
        for process in started:
            stop_serve(process)
    assert "data: 0" in lines and "data: 399" not in lines  # it was streaming, and was cut short
    events = [line for line in lines if line]
    assert events[-2] == "event: error" and json.loads(events[-1][6:])["error"]["type"] == "shutting_down"
    assert "Traceback" not in "".join(served.stdout)


def test_log_followers_and_waits_on_spawned_calls_end_cleanly_at_sigterm(tmp_path):
    home, started = tmp_path / "home", []
    try:
        served = launch(home, APP, "--new-key", "me", "--no-watch", started=started)
        follower = subprocess.Popen([sys.executable, "-m", "ember.cli", "logs", "-f"], env=served.env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        waited = []
        with served.client(_banner_key(served), timeout=60) as http:
            spawned = http.post("/slow/wait", json={"seconds": 30}, headers={"Prefer": "respond-async"})
            assert spawned.status_code == 202
            waiter = threading.Thread(target=lambda: waited.append(
                http.get(f"/calls/{spawned.json()['call_id']}", params={"wait": 60})))
            waiter.start()
            while not served.status()["apps"]["slow"]["functions"]["wait"]["in_flight"]:
                pass
            # The follower is following once it printed its first lines (an interpreter start can take seconds on a
            # busy machine; stopped before it connects, it would find no gateway rather than see this one stop).
            first: list[str] = []
            reader = threading.Thread(target=lambda: first.append(follower.stdout.readline()), daemon=True)
            reader.start()
            reader.join(60)
            assert first and first[0], "ember logs -f printed nothing within 60 s"
            served.process.send_signal(signal.SIGTERM)
            waiter.join(30)
        assert served.process.wait(20) == 0
        out, err = follower.communicate(timeout=20)
    finally:
        for process in started:
            stop_serve(process)
    assert waited[0].status_code == 200 and waited[0].json()["state"] in (
        "pending",
        "failed",
        "cancelled",
    )  # answered, not cut
    assert follower.returncode == 0 and "the gateway stopped" in err and "Traceback" not in err
    assert "Traceback" not in "".join(served.stdout)
