"""The worker process on its own: ready line, calls, timeouts, exit hooks on SIGTERM, a crash in enter."""
import gzip
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from ember.home import Home
from ember.package import build, load_app

APP = '''
import asyncio
import time
import ember

app = ember.App("w")


@app.function(timeout=0.5)
def slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@app.function(timeout=0.5, max_concurrency=2)
async def nap(seconds: float, marker: str = "") -> float:
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        if marker:
            open(marker, "w").write("cancelled")
        raise
    return seconds


@app.function()
def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


@app.cls()
class Counter:
    @ember.enter()
    def start(self):
        self.n = 0

    @ember.method()
    def bump(self) -> int:
        self.n += 1
        return self.n

    @ember.method()
    def bad(self) -> object:
        return object()

    @ember.method()
    def typed(self):
        import dataclasses
        import datetime

        @dataclasses.dataclass
        class Reading:
            at: datetime.date
            tags: frozenset

        return Reading(datetime.date(2026, 12, 1), frozenset({"a"}))

    @ember.exit()
    def close(self):
        print("EXIT HOOK n=%d" % self.n, flush=True)


@app.function(secrets=["db"], env={"MODE": "test"})
def settings() -> dict:
    import os
    return {"password": os.environ.get("DB_PASSWORD"), "mode": os.environ.get("MODE")}


@app.cls()
class Broken:
    @ember.enter()
    def start(self):
        raise RuntimeError("no weights")

    @ember.method()
    def m(self) -> int:
        return 1
'''


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    folder = tmp_path_factory.mktemp("worker")
    (folder / "w.py").write_text(textwrap.dedent(APP))
    return build(load_app(folder / "w.py"), Home(folder / "home"))


def start(package, target: str, log, env=None):
    process = subprocess.Popen(
        [sys.executable, "-m", "ember.runtime.worker", "--package", str(package), "--target", target],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )
    return process, json.loads(process.stdout.readline())


def control(ready: dict, timeout: float = 10) -> httpx.Client:
    """A client of the replica's /__ember__/ routes, with the secret its ready line gave."""
    return httpx.Client(base_url=f"http://127.0.0.1:{ready['port']}/__ember__", timeout=timeout,
                        headers={"x-ember-control": ready["control_secret"]})


def test_calls_timeouts_and_exit_hooks(package, tmp_path):
    with open(tmp_path / "log", "w") as log:
        process, ready = start(package, "Counter", log)
        try:
            assert ready["event"] == "ready" and set(ready["timings"]) == {"import_ms", "enter_ms"}
            http = control(ready)
            assert [http.post("/call/bump", json={}).json()["result"] for _ in range(2)] == [1, 2]
            bad = http.post("/call/bad", json={})
            assert bad.status_code == 500 and bad.json()["error"]["type"] == "result_not_json"
            assert "Object of type object is not JSON serializable: return plain data" in bad.json()["error"]["message"]
            assert http.post("/call/typed", json={}).json() == {"result": {"at": "2026-12-01", "tags": ["a"]}}
            wrong = http.post("/call/bump", json={"x": 1}).json()["error"]
            assert wrong["type"] == "invalid_arguments" and wrong["message"] == "unknown argument 'x'; it takes ()"
            assert http.post("/call/nope", json={}).status_code == 404
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(15) == 0
    assert "EXIT HOOK n=2" in (tmp_path / "log").read_text()


def test_function_timeout(package, tmp_path):
    with open(tmp_path / "log", "w") as log:
        process, ready = start(package, "slow", log)
        try:
            http = control(ready)
            assert http.post("/call/slow", json={"seconds": 0.01}).json() == {"result": 0.01}
            late = http.post("/call/slow", json={"seconds": 2})
            assert late.status_code == 504 and "timeout of 0.5 s" in late.json()["error"]["message"]
        finally:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


def test_crash_in_enter_is_reported_on_the_control_line(package, tmp_path):
    with open(tmp_path / "log", "w") as log:
        process, message = start(package, "Broken", log)
        assert process.wait(15) == 1
    assert message == {"event": "failed", "phase": "enter", "error": "RuntimeError: no weights"}
    assert 'raise RuntimeError("no weights")' in (tmp_path / "log").read_text()


def test_env_and_secrets(package, tmp_path):
    env = os.environ | {"EMBER_HOME": str(tmp_path)}
    with open(tmp_path / "log", "w") as log:
        process, message = start(package, "settings", log, env)
        assert process.wait(15) == 1
        assert message["error"].startswith("FileNotFoundError: secret 'db' not found: create ")
        (tmp_path / "secrets" / "db.env").write_text("# the test database\nDB_PASSWORD=hunter2\n")
        process, ready = start(package, "settings", log, env)
        try:
            reply = control(ready).post("/call/settings", json={})
            assert reply.json()["result"] == {"password": "hunter2", "mode": "test"}
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(15)
    secret = tmp_path / "secrets" / "db.env"
    assert stat.S_IMODE((tmp_path / "secrets").stat().st_mode) == 0o700
    assert f"can be read by other users of this machine; make it private with `chmod 600 {secret}`" in \
        (tmp_path / "log").read_text()


def test_argument_problems_name_every_unknown_and_missing_argument():
    from ember.runtime.worker import argument_problem

    def add(a: int, b: int, *, scale: float = 1.0) -> float:
        return (a + b) * scale

    assert argument_problem(add, {"a": 1, "b": 2}) is None
    assert argument_problem(add, {"a": 1, "y": 2, "z": 3}) == \
        "unknown arguments 'y', 'z'; missing required argument 'b'; it takes (a, b, scale)"
    assert argument_problem(add, {}) == "missing required arguments 'a', 'b'; it takes (a, b, scale)"
    assert argument_problem(lambda **kw: kw, {"anything": 1}) is None


def test_parking_runs_the_park_and_wake_hooks_and_a_call_during_a_park_waits_then_wakes():
    import asyncio
    import threading

    from ember.runtime.worker import Parking

    events: list[str] = []
    parking_started = threading.Event()

    class Model:
        def release(self):
            parking_started.set()
            events.append("park")
            threading.Event().wait(0.2)  # a slow park: the call below arrives in the middle of it

        def restore(self):
            events.append("wake")

    async def scenario():
        parking = Parking(Model(), ["release"], ["restore"])
        park = asyncio.create_task(parking.park())
        await asyncio.to_thread(parking_started.wait)
        await parking.ready()  # what the worker awaits before a call
        events.append("call")
        assert (await park)["parked"] and not parking.parked
        await parking.ready()  # awake and idle: nothing to do
        assert (await parking.wake())["parked"] is False

    asyncio.run(scenario())
    assert events == ["park", "wake", "call"]


def test_park_and_wake_hooks_are_found_on_the_class():
    import ember

    app = ember.App("hooks")

    @app.cls()
    class Model:
        @ember.park()
        def release(self):
            pass

        @ember.wake()
        def restore(self):
            pass

        @ember.method()
        def predict(self) -> int:
            return 1

    assert (Model.park_hooks, Model.wake_hooks) == (["release"], ["restore"])
    with pytest.raises(TypeError, match="parentheses"):
        ember.park(lambda self: None)


def test_control_routes_answer_only_the_replica_secret(package, tmp_path):
    with open(tmp_path / "log", "w") as log:
        process, ready = start(package, "Counter", log)
        try:
            base = f"http://127.0.0.1:{ready['port']}"
            for headers in ({}, {"x-ember-control": "guess"}, {"x-ember-control": ready["control_secret"][:-1]}):
                for path in ("/__ember__/park", "/__ember__/call/bump", "/__ember__/%5f%5fx"):
                    refused = httpx.post(base + path, json={}, headers=headers)
                    assert refused.status_code == 404 and refused.json()["error"]["type"] == "not_found", path
            assert httpx.get(base + "/__ember__/health").status_code == 404
            assert control(ready).get("/health").json() == {"ok": True, "parked": False}
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(15)


def test_a_thread_past_its_timeout_recycles_the_replica_and_a_coroutine_is_cancelled(package, tmp_path):
    """The thread cannot be stopped: the 504 says the replica will go, new calls are refused before they start (so
    the gateway may send them elsewhere), and the process exits 3 without waiting for the thread."""
    with open(tmp_path / "log", "w") as log:
        process, ready = start(package, "slow", log)
        http = control(ready)
        late = http.post("/call/slow", json={"seconds": 30})
        assert late.status_code == 504 and late.headers["x-ember-recycling"] == "1"
        try:
            refused = http.post("/call/slow", json={"seconds": 0})
            assert refused.status_code == 503 and refused.headers["x-ember-not-started"] == "1"
        except httpx.TransportError:
            pass  # already gone
        assert process.wait(15) == 3
    assert "replica unhealthy" in (tmp_path / "log").read_text()

    with open(tmp_path / "log2", "w") as log:
        process, ready = start(package, "nap", log)
        try:
            http = control(ready)
            marker = tmp_path / "cancelled"
            late = http.post("/call/nap", json={"seconds": 30, "marker": str(marker)})
            assert late.status_code == 504 and "x-ember-recycling" not in late.headers
            assert marker.read_text() == "cancelled"
            assert http.post("/call/nap", json={"seconds": 0.01}).json() == {"result": 0.01}
            assert http.get("/health").json()["ok"] is True
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(15) == 0


def test_a_client_that_hangs_up_cancels_its_call(package, tmp_path):
    with open(tmp_path / "log", "w") as log:
        process, ready = start(package, "nap", log)
        try:
            marker = tmp_path / "cancelled"
            with pytest.raises(httpx.ReadTimeout):
                control(ready, timeout=0.2).post("/call/nap", json={"seconds": 0.45, "marker": str(marker)})
            time.sleep(0.1)
            assert marker.read_text() == "cancelled"  # well before its 0.45 s sleep would have ended
            assert control(ready).post("/call/nap", json={"seconds": 0}).json() == {"result": 0}
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(15)


def test_arguments_are_checked_against_type_hints_and_results_must_be_strict_json(package, tmp_path):
    with open(tmp_path / "log", "w") as log:
        process, ready = start(package, "ratio", log)
        try:
            http = control(ready)
            wrong = http.post("/call/ratio", json={"a": "two", "b": [1]})
            assert wrong.status_code == 422
            message = wrong.json()["error"]["message"]
            assert message.startswith("a: Input should be a valid number") and "(got \"two\")" in message
            assert "; b: Input should be a valid number" in message
            assert http.post("/call/ratio", json={"a": "3", "b": 2}).json() == {"result": 1.5}  # as pydantic coerces
            nan = http.post("/call/ratio", json={"a": 1, "b": 0})
            assert nan.status_code == 500 and nan.json()["error"]["type"] == "result_not_json"
            assert "NaN" in nan.json()["error"]["message"]
            deep = http.post("/call/ratio", content=b"[" * 5000 + b"]" * 5000)
            assert deep.status_code == 400 and deep.json()["error"]["type"] == "invalid_json"
            # a compressed body failed as JSON that does not parse ("can't decode byte 0x8b"): now refused by name
            packed = http.post("/call/ratio", content=gzip.compress(b'{"a": 1, "b": 2}'),
                               headers={"Content-Encoding": "gzip"})
            assert packed.status_code == 415 and "send the call's JSON body uncompressed" in packed.text
            assert http.post("/call/ratio", json={"a": 1, "b": 2}, headers={"Content-Encoding": "identity"}).json() \
                == {"result": 0.5}
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(15)


def test_parking_with_the_driver_checkpoint_names_what_is_missing_on_a_machine_without_it():
    import asyncio
    import ctypes.util

    from ember.runtime.cuda_checkpoint import main
    from ember.runtime.worker import Parking, ParkRefused

    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has a CUDA driver; tests/gpu covers the checkpoint itself")
    class Model:
        loaded = True

        def release(self):
            self.loaded = False

        def restore(self):
            self.loaded = True

    model = Model()
    parking = Parking(model, park_hooks=["release"], wake_hooks=["restore"], checkpoint=True)
    with pytest.raises(ParkRefused, match="park_with='cuda-checkpoint' needs an NVIDIA GPU"):
        asyncio.run(parking.park())
    assert not parking.parked and model.loaded  # a park that failed leaves the replica serving, its hooks undone
    assert main(["nap", "1"]) == 2


def test_park_with_is_checked_when_the_app_loads():
    import ember

    with pytest.raises(ember.SpecError, match="park_with"):
        ember.App("x").cls(park_with="criu")


def test_ember_profile_start_writes_where_the_enter_hooks_spent_their_time(package, tmp_path):
    import os

    folder = tmp_path / "profiles"
    with open(tmp_path / "log", "w") as log:
        process, ready = start(package, "Counter", log, env=os.environ | {"EMBER_PROFILE_START": str(folder)})
        try:
            assert ready["event"] == "ready" and control(ready).post("/call/bump", json={}).json()["result"] == 1
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(15) == 0
    text = (folder / f"start-{process.pid}.txt").read_text()
    assert "Ordered by: cumulative time" in text and "w.py" in text and "(start)" in text  # Counter's enter hook
    assert (folder / f"start-{process.pid}.prof").stat().st_size > 0


def test_a_stop_right_after_the_ready_line_still_runs_the_exit_hooks(package, tmp_path):
    with open(tmp_path / "log", "w") as log:
        process, ready = start(package, "Counter", log)
        assert ready["event"] == "ready"
        process.send_signal(signal.SIGTERM)  # before the HTTP server has set up its own handlers
        assert process.wait(15) == 0
    assert "EXIT HOOK n=0" in (tmp_path / "log").read_text()
