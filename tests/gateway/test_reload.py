"""`ember serve` redeploys on edits to the app file and its local imports (gateway/reload.py)."""
import threading
import time

import pytest

from ember.gateway.reload import describe_failure, fingerprint

APP = '''
import time

import ember
import greeting

app = ember.App("watched")


@app.function(max_concurrency=4, target_concurrency=2, scaledown_window=30)
def greet(name: str) -> str:
    return greeting.WORD + " " + name


@app.function(max_concurrency=4, scaledown_window=30)
def slow(seconds: float) -> str:
    time.sleep(seconds)
    return greeting.WORD
'''


def _wait_for(predicate, within: float, what: str):
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_an_edit_redeploys_in_flight_calls_finish_on_the_old_version_and_a_broken_edit_keeps_serving(serve, tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "greeting.py").write_text('WORD = "hello"\n')
    (folder / "app.py").write_text(APP)
    served = serve(folder / "app.py")
    assert any("Watching app.py, greeting.py" in line for line in served.stdout), served.stdout

    with served.client(served.key(), timeout=30) as http:
        assert http.post("/watched/greet", json={"name": "ada"}).json() == {"result": "hello ada"}
        in_flight: dict = {}
        slow = threading.Thread(target=lambda: in_flight.update(
            reply=http.post("/watched/slow", json={"seconds": 2.5})))
        slow.start()
        time.sleep(0.8)  # the slow call is on a replica of the first version

        (folder / "greeting.py").write_text('WORD = "howdy"\n')  # a local import, not the app file

        def answer() -> str:
            return http.post("/watched/greet", json={"name": "ada"}).json()["result"]

        # Seen within a poll (0.2 s) and a reload (~0.3 s idle); 10 s leaves room for a busy 2-core machine.
        _wait_for(lambda: any("reloaded app 'watched'" in line for line in served.stdout), 10,
                  "the edit was not redeployed within 10 s")
        # The new version takes calls once its fork server and replica have started (~0.5 s on an idle machine, a
        # few seconds on a busy 2-core one); until then the old version answers.
        _wait_for(lambda: answer() == "howdy ada", 15, "the edit was never served")
        slow.join(10)
        assert in_flight["reply"].status_code == 200, in_flight["reply"].text
        assert in_flight["reply"].json() == {"result": "hello"}  # finished on the version it started on

        # A syntax error: the old version keeps serving and the error names the file and line.
        source = (folder / "app.py").read_text()
        (folder / "app.py").write_text(source.replace("return greeting.WORD + \" \" + name", "return greeting.WORD +"))
        failed = _wait_for(lambda: [line for line in served.stdout if "reload failed" in line], 5,
                           "the broken edit was not reported")
        line = source.splitlines().index('    return greeting.WORD + " " + name') + 1
        assert f"{folder / 'app.py'}:{line}: SyntaxError" in failed[0], failed
        assert answer() == "howdy ada"

        # Fixed again: served again.
        (folder / "app.py").write_text(source.replace('" " + name', '", " + name'))
        _wait_for(lambda: answer() == "howdy, ada", 15, "the fixed edit was never served")
    assert sum("reloaded app 'watched'" in line for line in served.stdout) == 2


def test_no_watch_keeps_the_first_version(serve, tmp_path):
    (tmp_path / "greeting.py").write_text('WORD = "hello"\n')
    (tmp_path / "app.py").write_text(APP)
    served = serve(tmp_path / "app.py", "--no-watch")
    with served.client(served.key(), timeout=30) as http:
        assert http.post("/watched/greet", json={"name": "ada"}).json() == {"result": "hello ada"}
        (tmp_path / "greeting.py").write_text('WORD = "howdy"\n')
        time.sleep(1.0)
        assert http.post("/watched/greet", json={"name": "ada"}).json() == {"result": "hello ada"}
    assert not any("Watching" in line for line in served.stdout)


def test_fingerprint_sees_edits_and_removals(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("x = 1\n")
    first = fingerprint([path])
    path.write_text("x = 22\n")
    assert fingerprint([path]) != first
    path.unlink()
    assert fingerprint([path]) == {path: None}


def test_a_failure_is_described_at_the_users_line(tmp_path):
    app = tmp_path / "app.py"
    app.write_text("x = 1\n\ndef f():\n    raise KeyError('missing')\n\nf()\n")
    with pytest.raises(KeyError) as raised:
        exec(compile(app.read_text(), str(app), "exec"), {})
    assert describe_failure(raised.value, tmp_path) == f"{app}:4: KeyError: 'missing'"
    with pytest.raises(SyntaxError) as bad:
        compile("def f(:\n", str(app), "exec")
    assert describe_failure(bad.value, tmp_path).startswith(f"{app}:1: SyntaxError:")
