"""Fixtures that run the real system: `ember serve` as a subprocess over HTTPS, with a temp EMBER_HOME."""
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# One torch (OpenMP) thread per process, here and in the replicas and servers the tests start (they inherit it):
# the tests run in several processes per core, and OpenMP's threads spin while they wait for one another, so on the
# 2-core CI machine three processes of test_engine.py side by side took 114 s of CPU each with torch's default
# threads and 28 s with one. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import httpx  # noqa: E402
import pytest  # noqa: E402

from ember.gateway.banner import LAST_LINE  # noqa: E402
from ember.gateway.keys import KeyStore  # noqa: E402
from ember.home import Home  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Served:
    """A running `ember serve`: its URL, CA, home, and helpers that talk to it the way users do."""

    url: str
    ca: Path
    home: Path
    process: subprocess.Popen
    stdout: list[str]

    @property
    def env(self) -> dict[str, str]:
        return os.environ | {"EMBER_HOME": str(self.home)}

    def tls(self) -> ssl.SSLContext:
        """Verifies the gateway's certificate against the dev CA only (what `curl --cacert` does)."""
        return ssl.create_default_context(cafile=str(self.ca))

    def key(self, name: str = "test", admin: bool = False) -> str:
        return KeyStore(self.home / "ember.db").create(name, admin=admin)[1]

    def client(self, key: str | None, timeout: float = 60.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, verify=self.tls(), headers=headers, timeout=timeout)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [sys.executable, "-m", "ember.cli", *args], env=self.env, capture_output=True, text=True, timeout=60
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"ember {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def status(self) -> dict:
        """GET /admin/status, the report `ember status --json` prints (tests/ember/test_cli.py checks that the CLI
        prints it): asked in-process, since tests poll it and a CLI process per poll costs ~1 s of a busy CPU."""
        with self.client(Home(self.home).cli_key_file.read_text().strip(), timeout=30) as http:  # the CLI's key
            reply = http.get("/admin/status")
        assert reply.status_code == 200, reply.text
        return reply.json()

    def in_flight_after_settling(self, app: str, function: str, seconds: float = 10.0) -> int:
        """The function's calls in flight once they drop to 0, or after `seconds`: the gateway frees a call's slot
        just after its client has the whole response (or left), so a read at that moment can still count it."""
        deadline = time.monotonic() + seconds
        while (count := self.status()["apps"][app]["functions"][function]["in_flight"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return count


def stop_serve(process: subprocess.Popen) -> None:
    """Stop the gateway and its replicas (one process group); SIGKILL whatever outlives the grace period."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(5)


def launch(home: Path, app_path: str | Path, *args: str, timeout: float = 60.0,
           started: list[subprocess.Popen] | None = None) -> Served:
    """Start `ember serve APP.py --port 0 ARGS` with EMBER_HOME=home; a Served once its banner is out and /readyz
    answers. The process is appended to `started` before anything can fail, for the caller to stop."""
    process = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "serve", str(app_path), "--port", "0", *args],
        env=os.environ | {"EMBER_HOME": str(home)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True, cwd=ROOT,
    )
    if started is not None:
        started.append(process)
    lines: list[str] = []
    url = None
    deadline = time.monotonic() + timeout
    while url is None:
        line = process.stdout.readline()
        if not line:
            raise AssertionError("ember serve exited early:\n" + "".join(lines))
        lines.append(line)
        if line.startswith("Ember is serving"):
            url = line.split(" at ")[-1].strip()
        assert time.monotonic() < deadline, "ember serve printed no URL:\n" + "".join(lines)
    served = Served(url, home / "tls" / "ca.pem", home, process, lines)
    while not lines[-1].startswith(LAST_LINE):  # the rest of the banner: key, curl, client settings
        line = process.stdout.readline()
        if not line:
            raise AssertionError("ember serve exited early:\n" + "".join(lines))
        lines.append(line)
    # Keep draining its output (gateway log lines) so a full pipe never blocks the server.
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    recorded = json.loads((home / "gateway.json").read_text())  # the address the CLI uses, and its CA
    verify = served.tls() if recorded["ca"] else False  # a certificate of one's own (--tls-cert): only waiting here
    while True:
        try:
            if httpx.get(f"{recorded['url']}/readyz", verify=verify).status_code == 200:
                return served
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "ember serve never became ready"
        time.sleep(0.1)


@pytest.fixture
def serve(tmp_path):
    """serve(APP.py) starts `ember serve` on a free port and returns a Served once /readyz answers."""
    yield from _serving(tmp_path)


@pytest.fixture(scope="module")
def serve_module(tmp_path_factory):
    """`serve`, for a gateway that every test of one module shares (start it in a module-scoped fixture)."""
    yield from _serving(tmp_path_factory.mktemp("served"))


def _serving(tmp_path: Path):
    started: list[subprocess.Popen] = []

    def start(app_path: str | Path, *args: str, timeout: float = 60.0) -> Served:
        return launch(tmp_path / "ember-home", app_path, *args, timeout=timeout, started=started)

    yield start
    for process in started:
        stop_serve(process)


# Each test file's seconds in a clean run of scripts/test.sh on the 2-core CI machine (pytest --record-durations)
DURATIONS = ROOT / "tests" / "durations.json"
UNRECORDED_SLOW_SECONDS = 30.0   # a file not in it yet that holds a test marked `slow`


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH", type=Path,
                     help="write each test file's total seconds (setup, call, teardown) into PATH as JSON (over "
                          "what it holds), e.g. tests/durations.json, which orders the files of later runs")


def pytest_collection_modifyitems(config, items):
    """Test files longest first, by tests/durations.json (a file missing there: UNRECORDED_SLOW_SECONDS if it holds
    a test marked `slow`, else 0), equal ones in their usual order: scripts/test.sh hands whole files to its worker
    processes in this order (pytest-xdist's --dist loadfile, with its own reordering by test count turned off), so
    the longest start first rather than finish last."""
    recorded = json.loads(DURATIONS.read_text())["files"] if DURATIONS.exists() else {}
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def seconds(item) -> float:
        path = item.nodeid.split("::")[0]
        return recorded.get(path, UNRECORDED_SLOW_SECONDS if path in slow else 0.0)

    items.sort(key=lambda item: -seconds(item))  # stable: a file's tests stay together and in order


class DurationRecorder:
    """Sums each test file's reported durations and CPU seconds (CpuMeter's); in a run across worker processes it
    runs in the one that reports."""

    def __init__(self, path: Path):
        self.path, self.files, self.cpu = path, {}, {}

    def pytest_runtest_logreport(self, report) -> None:
        path = report.nodeid.split("::")[0]
        self.files[path] = self.files.get(path, 0.0) + report.duration
        cpu = dict(report.user_properties).get("cpu_s", 0.0)
        self.cpu[path] = self.cpu.get(path, 0.0) + cpu

    def pytest_sessionfinish(self, session) -> None:
        """Merged over what PATH holds (scripts/test.sh's second run, of the serial tests, adds its files)."""
        held = json.loads(self.path.read_text()) if self.path.exists() else {}
        files = held.get("files", {}) | {path: round(total, 1) for path, total in self.files.items()}
        cpu = held.get("cpu_seconds", {}) | {path: round(total, 1) for path, total in self.cpu.items()}
        self.path.write_text(json.dumps({
            "note": "per test file in one run of scripts/test.sh, written by pytest --record-durations: files, its "
                    "seconds (setup, call and teardown); cpu_seconds, the CPU its worker process and the processes "
                    "it waited for used meanwhile (a server is counted where it was stopped)",
            "files": dict(sorted(files.items(), key=lambda kv: -kv[1])),
            "cpu_seconds": dict(sorted(cpu.items(), key=lambda kv: -kv[1]))}, indent=1) + "\n")


class CpuMeter:
    """Adds to each test phase's report the CPU seconds this process and its reaped children used since the last."""

    def __init__(self):
        self.mark = self.used()

    def pytest_collection_finish(self, session) -> None:
        self.mark = self.used()   # the imports of collection are nobody's test

    @staticmethod
    def used() -> float:
        import resource
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        now = self.used()
        report.user_properties.append(("cpu_s", now - self.mark))
        self.mark = now
        return report


def pytest_configure(config):
    path = config.getoption("--record-durations")
    if path is None:
        return
    config.pluginmanager.register(CpuMeter(), "cpu-meter")   # in each process that runs tests
    if not hasattr(config, "workerinput"):   # the main process, not an xdist worker
        config.pluginmanager.register(DurationRecorder(path), "duration-recorder")
