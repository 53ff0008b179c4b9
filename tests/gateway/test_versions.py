"""Versions of an app through the CLI against a real gateway: each deploy a version, a failing one never replacing
the live one, rollbacks, and the live versions served again after a restart."""
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import stop_serve

APPS = Path(__file__).resolve().parent / "apps"
SOURCE = '''import ember

app = ember.App("versioned")


@app.cls(scaledown_window=30)
class Greeter:
    @ember.enter()
    def load(self):
        {enter}

    @ember.method()
    def greet(self, name: str) -> str:
        return self.greeting + " " + name
'''


def write(folder: Path, name: str, enter: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(SOURCE.format(enter=enter))
    return path


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("versions")
    return {"hello": write(folder, "hello", 'self.greeting = "hello"'),
            "howdy": write(folder, "howdy", 'self.greeting = "howdy"'),
            "broken": write(folder, "broken", 'raise RuntimeError("weights file missing")')}


@pytest.fixture(scope="module")
def served(serve_module):
    return serve_module(APPS / "quick.py", "--no-watch")


def greet(served) -> str:
    with served.client(served.key()) as http:
        reply = http.post("/versioned/Greeter.greet", json={"name": "ada"})
    assert reply.status_code == 200, reply.text
    return reply.json()["result"]


def history(served) -> list[tuple[int, str, str | None]]:
    rows = json.loads(served.cli("apps", "history", "versioned", "--json").stdout)
    return [(row["version"], row["state"], row["note"]) for row in rows]


def test_a_failing_version_never_replaces_the_live_one_and_rollbacks_go_back(served, versions):
    assert "version 1 (Greeter)" in served.cli("deploy", str(versions["hello"])).stdout
    with served.client(served.key()) as http:
        first = http.post("/versioned/Greeter.greet", json={"name": "ada"})
    assert first.json()["result"] == "hello ada"
    assert "x-ember-cold-start" not in first.headers  # the replica the deploy's check started serves it, warm
    assert "version 2 (Greeter)" in served.cli("deploy", str(versions["howdy"])).stdout
    assert greet(served) == "howdy ada"

    failed = served.cli("deploy", str(versions["broken"]), check=False)
    assert failed.returncode == 1, failed.stdout
    first_line = failed.stderr.splitlines()[0]
    assert first_line == ("error: 422 deploy_failed: version 3 of app 'versioned' failed to start (version 2 keeps "
                          "serving): Greeter: enter failed: RuntimeError: weights file missing")
    user_line = f'File "{versions["broken"]}", line 10, in load\n        raise RuntimeError("weights file missing")'
    assert user_line in failed.stderr, failed.stderr  # the user's file and line
    assert greet(served) == "howdy ada"
    assert history(served) == [(3, "failed", None), (2, "live", None), (1, "retired", None)]
    assert served.status()["apps"]["versioned"]["version"] == 2

    assert "version 4 (Greeter) now serves" in served.cli("deploy", "--rollback", "versioned").stdout
    assert greet(served) == "hello ada"
    served.cli("deploy", "--rollback", "versioned", "--to", "2")
    assert greet(served) == "howdy ada"
    assert history(served)[:2] == [(5, "live", "rollback to version 2"), (4, "retired", "rollback to version 1")]

    to_failed = served.cli("deploy", "--rollback", "versioned", "--to", "3", check=False)
    assert to_failed.returncode == 1 and "version 3 of app 'versioned' failed its check" in to_failed.stderr
    assert "409" in served.cli("deploy", "--rollback", "versioned", "--to", "9", check=False).stderr

    listed = served.cli("apps", "list").stdout.splitlines()
    assert [line.split()[:2] for line in listed[1:]] == [["quick", "1"], ["versioned", "5"]]
    assert listed[1].endswith("add, sleepy") and listed[2].endswith("Greeter")


def test_deploying_the_live_code_again_adds_no_version(served, versions):
    before = history(served)
    again = served.cli("deploy", str(versions["howdy"])).stdout
    assert f"version {before[0][0]}" in again and history(served) == before


def test_a_call_that_found_the_old_version_before_a_deploy_is_served_by_the_new_one(served, versions):
    """A call resolved to the live version, whose body arrives after a deploy replaced that version, reaches the
    queue of a version with no replicas: it goes to the new version (nothing was sent anywhere yet) instead of
    waiting out the queue's 300 s for a replica that never comes."""
    served.cli("deploy", str(versions["hello"]))
    assert greet(served) == "hello ada"
    key = served.key()
    host, port = served.url.removeprefix("https://").rsplit(":", 1)
    body = b'{"name": "ada"}'
    with served.tls().wrap_socket(socket.create_connection((host, int(port))), server_hostname=host) as late:
        late.sendall(b"POST /versioned/Greeter.greet HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer " +
                     key.encode() + b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(0.5)  # the gateway has the headers: it found the function of the live version, and reads the body
        served.cli("deploy", str(versions["howdy"]))  # returns once the new version is live and the old one drained
        late.sendall(body)
        late.settimeout(20)
        reply = b""
        while chunk := late.recv(1 << 16):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), reply[:500]
    assert json.loads(payload) == {"result": "howdy ada"}
    assert greet(served) == "howdy ada"


DRAINING = '''import os
import time

import ember

app = ember.App("draining")


@app.function(scaledown_window=30, timeout=60)
def slow(seconds: float) -> str:
    time.sleep(seconds)
    return f"{version} {{os.getpid()}}"
'''


def test_a_redeploy_lets_the_old_versions_calls_finish_however_long_they_run(served, tmp_path):
    """A call on the replaced version runs to its end (here 20 s, well past a replica's 5 s graceful stop), the deploy
    does not wait for it, and the old replica stops once it is done."""
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text(DRAINING.format(version="one"))
    second.write_text(DRAINING.format(version="two"))
    served.cli("deploy", str(first))
    with served.client(served.key(), timeout=60) as http:
        reply: dict = {}
        call = threading.Thread(target=lambda: reply.update(r=http.post("/draining/slow", json={"seconds": 20})))
        call.start()
        time.sleep(1.0)  # the call runs on version 1's replica
        served.cli("deploy", str(second))
        assert call.is_alive(), "the deploy waited for the old version's call"
        assert http.post("/draining/slow", json={"seconds": 0}).json()["result"].startswith("two ")
        retiring = served.status()["apps"]["draining"]["retiring"]
        assert [(r["function"], r["in_flight"]) for r in retiring] == [("slow", 1)], retiring
        assert f"replaced: slow {retiring[0]['id']} of version {retiring[0]['version']}, finishing 1 call" in \
            served.cli("status").stdout
        call.join(30)
    assert reply["r"].status_code == 200, reply["r"].text
    version, pid = reply["r"].json()["result"].split()
    assert version == "one"
    assert gone(int(pid), 15), f"version 1's replica (pid {pid}) still runs after its last call"
    assert served.status()["apps"]["draining"]["retiring"] == []
    assert int(pid) == retiring[0]["pid"]


def gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_stopping_gateway_stops_the_replaced_versions_replicas_too(serve, tmp_path):
    """A replaced version's replica still running a call when the gateway stops is stopped with it, not left
    behind: the call is cut at the stop's grace period like any other."""
    served = serve(APPS / "quick.py", "--no-watch")
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text(DRAINING.format(version="one"))
    second.write_text(DRAINING.format(version="two"))
    served.cli("deploy", str(first))
    with served.client(served.key(), timeout=60) as http:
        pid = int(http.post("/draining/slow", json={"seconds": 0}).json()["result"].split()[1])
        reply: dict = {}
        call = threading.Thread(target=lambda: reply.update(r=http.post("/draining/slow", json={"seconds": 40})))
        call.start()
        time.sleep(1.0)
        served.cli("deploy", str(second))
        os.kill(served.process.pid, signal.SIGTERM)  # the gateway alone: what it stops, it stops itself
        assert served.process.wait(30) == 0
        call.join(10)
    assert reply["r"].status_code == 503 and reply["r"].json()["error"]["type"] == "shutting_down", reply["r"].text
    assert gone(pid, 5), f"version 1's replica (pid {pid}) outlived the gateway"


def test_deployed_apps_are_served_again_after_a_restart(serve, versions):
    served = serve(APPS / "quick.py", "--no-watch")
    served.cli("deploy", str(versions["hello"]))
    served.cli("deploy", str(versions["broken"]), check=False)
    stop_serve(served.process)

    again = serve(APPS / "quick.py", "--no-watch")
    assert any("Restored apps deployed before: versioned" in line for line in again.stdout), again.stdout
    assert greet(again) == "hello ada"
    assert [line.split()[:2] for line in again.cli("apps", "list").stdout.splitlines()[1:]] == [
        ["quick", "1"], ["versioned", "1"]]  # the same quick.py served again is the same version


@pytest.mark.parametrize("args, message", [
    (["deploy"], "give the app file"),
    (["deploy", "--rollback", "nothing-here"], "no app named 'nothing-here' was ever deployed"),
    (["deploy", "--rollback", "Bad..Name"], "--rollback takes an app name"),
    (["apps", "history", "nothing-here"], "no app named 'nothing-here'"),
])
def test_bad_requests_say_what_to_do(served, args, message):
    result = served.cli(*args, check=False)
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
