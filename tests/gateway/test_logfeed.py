"""`ember logs -f` follows the gateway's and the replicas' JSON logs while calls run (gateway/logfeed.py, the CLI,
runtime/logs.py): each call's trace id is found in the gateway's access line and in its replica's, the filters
keep other functions out, and a call that sent no trace context still has one id across both logs."""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ember.cli.status import log_line

ROOT = Path(__file__).resolve().parents[2]
TRACES = ["4bf92f3577b34da6a3ce929d0e0e4736", "5bf92f3577b34da6a3ce929d0e0e4736", "6bf92f3577b34da6a3ce929d0e0e4736"]


class Follower:
    """`ember logs -f ...` as a user runs it, its output lines collected as they come."""

    def __init__(self, served, *args: str):
        self.process = subprocess.Popen([sys.executable, "-m", "ember.cli", "logs", "-f", *args], env=served.env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True).start()

    def records(self) -> list[dict]:
        return [json.loads(line) for line in list(self.lines) if line.startswith("{")]

    def wait(self, done, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while not done(self.records()):
            assert self.process.poll() is None, "ember logs -f exited:\n" + "".join(self.lines)
            assert time.monotonic() < deadline, "never seen; it printed:\n" + "".join(self.lines)
            time.sleep(0.1)
        return self.records()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture
def follow():
    started: list[Follower] = []

    def start(served, *args: str) -> Follower:
        started.append(Follower(served, *args))
        return started[-1]

    yield start
    for follower in started:
        follower.stop()


def access(records: list[dict], source: str, trace_id: str) -> list[dict]:
    return [r for r in records if r.get("kind") == "access" and r["source"] == source and r.get("trace_id") == trace_id]


def test_logs_follow_finds_each_calls_trace_in_the_gateway_and_its_replica(serve, follow):
    served = serve(ROOT / "examples" / "hello.py")
    key = served.key()
    # -n 1000: a follower that connects after the calls (a slow interpreter start) still has their lines
    square = follow(served, "--app", "hello", "--function", "square", "--json", "-n", "1000")
    everything = follow(served, "--json", "-n", "1000")
    with served.client(key) as http:
        assert http.post("/hello/Greeter.greet", json={"name": "Ada"}).status_code == 200  # another function
        replies = [http.post("/hello/square", json={"x": i}, headers={"traceparent": f"00-{trace}-b7ad6b7169203331-01"})
                   for i, trace in enumerate(TRACES)]
        untraced = http.post("/hello/square", json={"x": 9})
    assert all(r.status_code == 200 for r in replies + [untraced])

    def found_all(records):
        return all(access(records, "gateway", t) and access(records, "replica", t) for t in TRACES)

    records = square.wait(found_all)
    for trace, reply in zip(TRACES, replies):
        (gateway,), (replica,) = access(records, "gateway", trace), access(records, "replica", trace)
        assert gateway["request_id"] == replica["request_id"] == reply.headers["x-request-id"]
        assert gateway | {"app": "hello", "function": "square", "status": 200, "path": "/hello/square",
                          "replica": reply.headers["x-ember-replica"], "key_name": "test"} == gateway
        assert replica | {"app": "hello", "function": "square", "replica": reply.headers["x-ember-replica"],
                          "path": "/__ember__/call/square", "status": 200} == replica
        # The gateway's time spans the replica's, but the replica's clock stops only once its last byte is handed
        # to its socket, which on a busy machine can come after the gateway read that byte and finished: 250 ms slack.
        assert gateway["ms"] > 0 and 0 < replica["ms"] < gateway["ms"] + 250, (gateway["ms"], replica["ms"])
        assert "trace_id=" + trace in log_line(gateway) and "[gateway]" in log_line(gateway)
        assert log_line(replica).count(f"[hello/square {reply.headers['x-ember-replica']}]") == 1

    # A call without trace context gets an id at the gateway, and the replica's line carries the same one.
    request_id = untraced.headers["x-request-id"]
    records = square.wait(lambda rs: sum(r.get("request_id") == request_id and r.get("kind") == "access"
                                         for r in rs) == 2)
    gateway, replica = sorted((r for r in records if r.get("request_id") == request_id and r.get("kind") == "access"),
                              key=lambda r: r["source"])
    assert gateway["trace_id"] == replica["trace_id"] and len(gateway["trace_id"]) == 32

    assert not [r for r in records if r.get("function") not in (None, "square") or r.get("app") not in (None, "hello")]
    assert not [r for r in records if r.get("path") == "/hello/Greeter.greet"]
    # Unfiltered, the other function's lines are there too.
    everything.wait(lambda rs: any(r.get("path") == "/hello/Greeter.greet" and r.get("kind") == "access" for r in rs))


def test_logs_follow_needs_an_admin_key_and_rejects_a_bad_filter_without_a_traceback(serve):
    served = serve(ROOT / "examples" / "hello.py")
    for key, status in ((None, 401), (served.key("caller"), 403)):
        with served.client(key) as http:
            refused = http.get("/admin/logs/follow")
        assert refused.status_code == status and refused.json()["error"]["type"] in ("unauthorized", "forbidden")
    result = served.cli("logs", "-f", "--app", "no/such", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "422" in result.stderr and "app" in result.stderr
    result = served.cli("logs", "--function", "square", check=False)
    assert result.returncode == 1 and "-f" in result.stderr and "Traceback" not in result.stderr


def test_a_line_without_end_is_passed_on_cut_and_a_fast_writer_read_in_parts(tmp_path):
    """A replica printing a progress bar with no newline held it all in the gateway's memory for every follower,
    and one poll read everything written since the last, however much."""
    from ember.gateway.logfeed import MAX_LINE, READ_AT_ONCE, LogFile

    log = tmp_path / "app.r1.log"
    log.write_bytes(b"first\n" + b"#" * (3 * MAX_LINE))
    feed = LogFile(log, {"app": "app"}, 0)
    records = feed.read()
    assert [r["msg"] for r in records][0] == "first"
    assert records[1]["msg"].endswith(f"[line cut at {MAX_LINE} bytes]") and len(records[1]["msg"]) < MAX_LINE + 40
    assert feed.partial == b""
    with log.open("ab") as f:
        f.write(b"#" * MAX_LINE + b"\nafter\n" + (b"y" * 65_535 + b"\n") * (2 * READ_AT_ONCE // 65_536))
    assert [r["msg"] for r in feed.read()][0] == "after"   # the long line's rest is not a record of its own
    assert feed.offset <= 4 * MAX_LINE + 7 + READ_AT_ONCE + 10   # at most READ_AT_ONCE a poll
    total = sum(len(feed.read()) for _ in range(4))
    assert feed.offset == log.stat().st_size and total > 0


def test_the_logs_tail_reads_only_the_end_of_a_file(tmp_path):
    """GET /admin/logs (`ember logs`) read the whole file into memory for its last lines: a log of gigabytes, all
    of it, on the gateway's event loop."""
    from ember.gateway.admin import TAIL_WINDOW, tail

    log = tmp_path / "gateway.log"
    assert tail(log, 10) == ""
    log.write_text("".join(f"line {i}\n" for i in range(1000)) + "partial")
    assert tail(log, 3) == "line 998\nline 999\npartial"
    assert tail(log, 5000).startswith("line 0\n")
    with log.open("a") as f:   # past the window: its end only, from a whole line
        f.write("\n" + ("y" * 99 + "\n") * (2 * TAIL_WINDOW // 100))
    shown = tail(log, 1_000_000)   # more lines than the window holds
    assert len(shown) <= TAIL_WINDOW and shown.startswith("y" * 99 + "\n") and shown.endswith("y\n")


def test_a_gateway_deletes_an_ended_replicas_old_log_and_keeps_a_live_ones(serve):
    import os

    served = serve(ROOT / "tests" / "gateway" / "apps" / "quick.py")
    with served.client(served.key("k")) as http:   # sleepy's replica stays 30 s after its call
        assert http.post("/quick/sleepy", json={"seconds": 0}).status_code == 200
    logs = served.home / "logs"
    live = list(logs.glob("quick.*.log"))   # the replica's, and its app's fork server's
    assert {path.name.split("-")[0] for path in live} == {"quick.sleepy", "quick.forkserver"}, live
    live.append(logs / "gateway.log")
    ended = logs / "quick.sleepy-ended.log"
    ended.write_text("a replica that ended long ago\n")
    week_ago = time.time() - 8 * 86400
    for path in (*live, ended):
        os.utime(path, (week_ago, week_ago))
    deadline = time.monotonic() + 30   # the gateway looks every 10 s
    while ended.exists():
        assert time.monotonic() < deadline, "the ended replica's log was never deleted"
        time.sleep(0.2)
    assert all(path.exists() for path in live)
