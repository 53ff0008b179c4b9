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


def test_a_log_over_its_size_is_rotated_and_its_followers_start_it_afresh(tmp_path):
    """Replica logs grew without end (a replica printing what its callers send could fill the disk that the
    gateway's database shares); past LOG_MAX_BYTES a log is copied to NAME.log.1 and cut, and its writer's next
    line, appended, starts it afresh."""
    import os

    from ember.gateway.log_budget import rotate_large
    from ember.gateway.logfeed import LogFile

    big, small = tmp_path / "app.f-1.log", tmp_path / "gateway.log"
    small.write_text("quiet\n")
    writer = os.open(big, os.O_WRONLY | os.O_APPEND | os.O_CREAT)   # as the supervisor opens a replica's log
    os.write(writer, b"old line\n" * 1000)
    follower = LogFile(big, {"app": "app"}, 0)
    assert len(follower.read()) == 1000
    assert rotate_large(tmp_path, limit=4096) == [big]
    assert big.stat().st_size == 0 and (tmp_path / "app.f-1.log.1").read_bytes() == b"old line\n" * 1000
    assert small.read_text() == "quiet\n" and not (tmp_path / "gateway.log.1").exists()
    os.write(writer, b"new line\n")
    os.close(writer)
    assert big.read_bytes() == b"new line\n"   # appended at the new end: no hole where the old bytes were
    assert [r["msg"] for r in follower.read()] == ["new line"]
    assert rotate_large(tmp_path, limit=4096) == []


def test_ended_replicas_logs_are_kept_a_week_and_the_newest_500_and_live_ones_always(tmp_path):
    """Every replica start writes a new log, so a function that scaled to zero and back left one more file each
    time, for ever (and `ember logs -f` opened every one of them at each poll)."""
    import os

    from ember.gateway.log_budget import prune_ended
    from ember.gateway.logfeed import LogFile

    now = 1_000_000_000.0
    day = 86400.0

    def log(name: str, age_days: float) -> Path:
        path = tmp_path / name
        path.write_text("line\n")
        os.utime(path, (now - age_days * day,) * 2)
        return path

    old, recent, live, gateway = (log("a.f-old.log", 8), log("a.f-new.log", 6), log("a.f-live.log", 30),
                                  log("gateway.log", 30))
    (tmp_path / "a.f-old.log.1").write_text("its rotated part\n")
    follower = LogFile(old, {"app": "a"}, 0)
    assert prune_ended(tmp_path, {live}, now) == [old]
    assert not old.exists() and not (tmp_path / "a.f-old.log.1").exists()
    assert recent.exists() and live.exists() and gateway.exists()   # young, running, the gateway's own
    assert follower.read() == [] and follower.gone   # a follower lets it go
    many = [log(f"b.f-{i}.log", 1 + i / 1000) for i in range(6)]   # by count: the newest kept
    assert prune_ended(tmp_path, {live}, now, keep_files=4) == [many[4], many[5], recent]
    assert {p.name for p in tmp_path.iterdir()} == {p.name for p in [live, gateway, *many[:4]]}
    fresh = log("c.f-starting.log", 0.01)   # written in the last hour (a replica starting): kept whatever the count
    assert prune_ended(tmp_path, set(), now, keep_files=0) != [] and fresh.exists() and gateway.exists()


def test_a_gateway_deletes_an_ended_replicas_old_log_and_keeps_a_live_ones(serve):
    import os

    served = serve(ROOT / "tests" / "gateway" / "apps" / "quick.py")
    with served.client(served.key("k")) as http:   # sleepy's replica stays 30 s after its call
        assert http.post("/quick/sleepy", json={"seconds": 0}).status_code == 200
    logs = served.home / "logs"
    live = list(logs.glob("quick.*.log"))   # the replica's, and its app's fork server's
    assert {path.name.split("-")[0] for path in live} == {"quick.sleepy", "quick.forkserver"}, live
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
