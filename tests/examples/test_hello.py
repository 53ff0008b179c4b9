"""examples/hello.py: served over HTTPS, run once with `ember run`, and called locally."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember.client import RemoteError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hello.py"


def _load_hello(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    hello = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hello)
    return hello


def test_hello_remote(serve, monkeypatch):
    served = serve(EXAMPLE)
    monkeypatch.setenv("EMBER_URL", served.url)
    monkeypatch.setenv("EMBER_KEY", served.key())
    monkeypatch.setenv("EMBER_CA", str(served.ca))
    hello = _load_hello("hello_remote")
    assert hello.square.remote(5) == 25
    assert hello.Greeter().greet.remote("Ada", lang="de")["greeting"] == "Hallo, Ada!"
    monkeypatch.setenv("EMBER_KEY", "ek_0_wrong")
    with pytest.raises(RemoteError) as error:
        hello.square.remote(x=5)
    assert error.value.status == 401


def test_hello_served(serve):
    served = serve(EXAMPLE)
    with served.client(served.key()) as http:
        square = http.post("/hello/square", json={"x": 7})
        assert square.json() == {"result": 49}
        greeted = http.post("/hello/Greeter.greet", json={"name": "Ada", "lang": "fr"})
        first = greeted.json()["result"]
        second = http.post("/hello/Greeter.greet", json={"name": "Bob"}).json()["result"]
        bad = http.post("/hello/Greeter.greet", json={"name": "Ada", "lang": "xx"})
    assert first["greeting"] == "Bonjour, Ada!" and second["greeting"] == "Hello, Bob!"
    assert first["pid"] == second["pid"] != os.getpid()  # one replica, its enter hooks ran once
    for started in (square, greeted):  # both forked from the app's fork server, Greeter after its snap=True hook ran
        assert "start=fork" in started.headers["x-ember-start-breakdown"], started.headers["x-ember-start-breakdown"]
    assert bad.status_code == 500 and bad.json()["error"] == {
        "type": "function_error",
        "message": "ValueError: unknown lang 'xx'; one of ['de', 'en', 'fr']",
    }


def test_hello_run_once(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "ember.cli", "run", f"{EXAMPLE}::Greeter.greet", "name=Ada", "lang=de"],
        env=os.environ | {"EMBER_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert '"greeting": "Hallo, Ada!"' in result.stdout
    [log] = (tmp_path / "logs").glob("hello.greeter-*.log")
    assert "shutting down" in log.read_text()  # the exit hook ran when the replica was stopped


def test_hello_local():
    hello = _load_hello("hello_local")
    assert hello.square.local(3) == 9
    greeter = hello.Greeter()
    assert greeter.greet.local("Ada")["pid"] == os.getpid()
    assert greeter.greet.local(name="Ada", lang="fr")["greeting"] == "Bonjour, Ada!"
