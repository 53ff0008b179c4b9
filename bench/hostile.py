"""Hostile clients, injected faults and load against one `ember serve`, in one run (issue 10).

    python bench/hostile.py              # runs every scenario, prints the table
    python bench/hostile.py --record     # and writes bench/results/hostile.md
    python bench/hostile.py --calls 200 --slow 200   # a quick check of the harness
    python bench/hostile.py --only slow-headers,large-bodies   # some scenarios (not recorded)

Scenarios, in order, against the same gateway (its header timeout 5 s, connection cap 1,000):
  load           N calls, C at a time, to a function that logs one line per invocation: lost = calls never
                 answered 200, duplicated = calls that ran more than once
  slow-headers   S TLS connections that send a header byte every 0.5 s, while a normal client calls on
  slow-bodies    B uploads trickling a byte every 0.5 s into an ASGI unit with 2 slots; one normal upload
  large-bodies   32 concurrent 15 MB uploads (the gateway's body budget is 256 MiB)
  timeout-storm  10 calls that overrun a synchronous function's timeout, then a normal call
  kill-9         K calls whose replica is killed (SIGKILL) mid-call, 2 replicas: invocations per call
  stalled-readers  4 clients start a 1 GB streamed reply and read none of it for 12 s, holding all 4 slots of its
                 one replica; then a normal call of it (the gateway's send timeout here: 5 s)
  key-flood      one API key sends 200 calls at once to a function with 4 slots (0.2 s a call); meanwhile another
                 key calls it one at a time: how long the other key's calls wait
For each: requests sent, faults injected, lost, duplicated, the normal client's latency, and the gateway's resident
memory and open file descriptors before, at the peak during, and after.
"""
import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

APP = '''
import asyncio
import os
import time

import ember

app = ember.App("hostile")
LOG = os.environ["HOSTILE_LOG"]


def log(line: str) -> None:
    with open(LOG, "a") as f:
        f.write(line + "\\n")


@app.function(max_concurrency=16, target_concurrency=16, min_replicas=2, scaledown_window=600)
def tick(n: int) -> int:
    log(f"tick {n}")
    return n


@app.function(timeout=0.5, max_concurrency=1, scaledown_window=600)
def overrun(seconds: float) -> float:
    time.sleep(seconds)
    log("late")
    return seconds


@app.function(min_replicas=2, max_concurrency=1, timeout=60, scaledown_window=600)
def victim(n: int) -> int:
    log(f"victim {n} {os.getpid()}")
    time.sleep(30)
    return n


async def upload(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    received, more = 0, True
    while more:
        message = await receive()
        received += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(received).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@app.function(max_replicas=1, max_concurrency=4, scaledown_window=600, timeout=600)
def firehose(count: int):
    for _ in range(count):
        yield "x" * (1 << 20)


@app.function(max_replicas=1, max_concurrency=4, scaledown_window=600, timeout=600)
async def busy(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


@app.cls(max_concurrency=2, scaledown_window=600)
class Web:
    @ember.asgi_app()
    def web(self):
        return upload
'''


@dataclass
class Row:
    scenario: str
    sent: int = 0
    faults: int = 0
    lost: int = 0
    duplicated: int = 0
    outcome: str = ""
    normal_ms: str = "-"  # the normal client's latency meanwhile, p50 / max
    rss_mib: list[float] = field(default_factory=list)  # before, peak, after
    fds: list[int] = field(default_factory=list)


class Gateway:
    """`ember serve` of the bench app in a fresh EMBER_HOME, and what it costs (RSS, fds) while it runs."""

    def __init__(self, workdir: Path):
        self.workdir, self.log = workdir, workdir / "invocations.log"
        app = workdir / "hostile.py"
        app.write_text(textwrap.dedent(APP))
        self.env = os.environ | {"EMBER_HOME": str(workdir / "home"), "HOSTILE_LOG": str(self.log),
                                 "EMBER_HEADER_TIMEOUT": "5", "EMBER_MAX_CONNECTIONS": "1000",
                                 "EMBER_SEND_TIMEOUT": "5"}
        self.process = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", str(app), "--port", "0"],
                                        env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True, cwd=ROOT)
        for line in self.process.stdout:
            if line.startswith("Ember is serving"):
                self.url = line.split(" at ")[-1].strip()
                break
        else:
            raise RuntimeError("ember serve exited before it served")
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()
        self.tls = ssl.create_default_context(cafile=str(workdir / "home" / "tls" / "ca.pem"))
        self.host, port = self.url.removeprefix("https://").rsplit(":", 1)
        self.port = int(port)
        from ember.gateway.keys import KeyStore

        self.key = KeyStore(workdir / "home" / "ember.db").create("bench")[1]
        self.flooder = KeyStore(workdir / "home" / "ember.db").create("flooder")[1]
        self.peak_rss, self.peak_fds, self._sampling = 0.0, 0, None

    def rss(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def measure(self, row: Row):
        """A context for one scenario: before, peak (sampled every 50 ms) and after of RSS and fds."""
        gateway = self

        class Measured:
            def __enter__(self):
                self.before = (gateway.rss(), gateway.fds())
                self.peak = list(self.before)
                self.stop = threading.Event()
                self.thread = threading.Thread(target=self.sample, daemon=True)
                self.thread.start()

            def sample(self):
                while not self.stop.wait(0.05):
                    self.peak = [max(self.peak[0], gateway.rss()), max(self.peak[1], gateway.fds())]

            def __exit__(self, *exc):
                self.stop.set()
                self.thread.join()
                time.sleep(1)
                row.rss_mib = [round(self.before[0]), round(self.peak[0]), round(gateway.rss())]
                row.fds = [self.before[1], self.peak[1], gateway.fds()]

        return Measured()

    def client(self, timeout: float = 60, key: str | None = None, connections: int = 64) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, verify=self.tls, timeout=timeout,
                                 headers={"Authorization": f"Bearer {key or self.key}"},
                                 limits=httpx.Limits(max_connections=connections))

    def wait_ready(self) -> None:
        with httpx.Client(base_url=self.url, verify=self.tls, headers={"Authorization": f"Bearer {self.key}"},
                          timeout=120) as http:
            for path, body in (("/hostile/tick", {"n": -1}), ("/hostile/upload", None),
                               ("/hostile/firehose", {"count": 1}), ("/hostile/busy", {"seconds": 0})):
                http.post(path, json=body) if body else http.post(path, content=b"warm")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


def invocations(log: Path, prefix: str) -> Counter:
    if not log.exists():
        return Counter()
    return Counter(line.split()[1] for line in log.read_text().splitlines() if line.startswith(prefix + " "))


def summary(ms: list[float]) -> str:
    if not ms:
        return "-"
    ms = sorted(ms)
    return f"{ms[len(ms) // 2]:.0f} / {ms[-1]:.0f}"


async def normal_calls(gateway: Gateway, stop: asyncio.Event, into: list[float], failures: list[int]) -> None:
    async with gateway.client(timeout=30) as http:
        while not stop.is_set():
            began = time.perf_counter()
            reply = await http.post("/hostile/tick", json={"n": -2})
            (into if reply.status_code == 200 else failures).append((time.perf_counter() - began) * 1000)
            await asyncio.sleep(0.1)


async def load(gateway: Gateway, calls: int, concurrency: int) -> Row:
    row = Row("load", sent=calls)
    statuses: Counter = Counter()
    with gateway.measure(row):
        async with gateway.client() as http:
            queue = iter(range(calls))

            async def worker():
                for n in queue:
                    try:
                        statuses[(await http.post("/hostile/tick", json={"n": n})).status_code] += 1
                    except httpx.HTTPError:
                        statuses["error"] += 1

            await asyncio.gather(*(worker() for _ in range(concurrency)))
    ran = invocations(gateway.log, "tick")
    row.lost = calls - statuses[200]
    row.duplicated = sum(1 for n in range(calls) if ran[str(n)] > 1)
    row.outcome = f"{statuses[200]} answered 200; {sum(1 for n in range(calls) if ran[str(n)] == 1)} ran once"
    return row


async def slow_headers(gateway: Gateway, count: int) -> Row:
    row = Row("slow-headers", sent=count, faults=count)
    normal, failed, closed = [], [], []
    stop = asyncio.Event()

    async def slow(opened: asyncio.Semaphore):
        try:
            async with opened:
                reader, writer = await asyncio.open_connection(gateway.host, gateway.port, ssl=gateway.tls)
        except OSError:
            return
        writer.write(b"POST /hostile/tick HTTP/1.1\r\nHost: gateway\r\n")
        began = time.monotonic()
        try:
            while time.monotonic() - began < 30:
                writer.write(b"x")
                await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1), 0.5) == b"":
                        break
                except TimeoutError:
                    continue
            else:
                return
        except (ConnectionError, ssl.SSLError):
            pass
        closed.append(time.monotonic() - began)
        writer.close()

    with gateway.measure(row):
        calls = asyncio.ensure_future(normal_calls(gateway, stop, normal, failed))
        opened = asyncio.Semaphore(200)
        await asyncio.gather(*(slow(opened) for _ in range(count)))
        stop.set()
        await calls
    row.sent += len(normal) + len(failed)
    row.lost = len(failed)
    row.normal_ms = summary(normal)
    row.outcome = (f"{len(closed)} of {count} slow connections closed by the server (latest after "
                   f"{max(closed, default=0):.1f} s); {len(normal)} normal calls answered, {len(failed)} failed")
    return row


async def slow_bodies(gateway: Gateway, count: int) -> Row:
    row = Row("slow-bodies", sent=count + 1, faults=count)
    statuses: Counter = Counter()

    async def trickle():
        reader, writer = await asyncio.open_connection(gateway.host, gateway.port, ssl=gateway.tls)
        writer.write(f"POST /hostile/upload HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer {gateway.key}\r\n"
                     "Content-Length: 1000\r\nConnection: close\r\n\r\n".encode())
        try:
            for _ in range(1000):
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.5)
        except ConnectionError:
            pass
        reply = await asyncio.wait_for(reader.read(), 30)
        statuses[int(reply.split()[1]) if reply else "closed"] += 1
        writer.close()

    with gateway.measure(row):
        slow = [asyncio.ensure_future(trickle()) for _ in range(count)]
        await asyncio.sleep(2)
        async with gateway.client() as http:
            began = time.perf_counter()
            reply = await http.post("/hostile/upload", content=b"x" * 1000)
            took = (time.perf_counter() - began) * 1000
        await asyncio.gather(*slow)
    row.normal_ms = f"{took:.0f}"
    row.lost = int(reply.status_code != 200)
    row.outcome = f"normal upload {reply.status_code}; slow ones: {dict(statuses)} (408 = body timeout, 60 s)"
    return row


async def large_bodies(gateway: Gateway, count: int, size: int) -> Row:
    row = Row("large-bodies", sent=count)
    statuses: Counter = Counter()
    body = b"x" * size
    with gateway.measure(row):
        async with gateway.client() as http:
            replies = await asyncio.gather(*(http.post("/hostile/upload", content=body) for _ in range(count)),
                                           return_exceptions=True)
    for reply in replies:
        statuses[reply.status_code if isinstance(reply, httpx.Response) else type(reply).__name__] += 1
    row.lost = count - statuses[200] - statuses[503]
    row.outcome = f"{dict(statuses)} (503 = no room in the body budget within 10 s, with Retry-After)"
    return row


async def timeout_storm(gateway: Gateway, overruns: int) -> Row:
    row = Row("timeout-storm", sent=overruns + 1, faults=overruns)
    statuses: Counter = Counter()
    with gateway.measure(row):
        async with gateway.client() as http:
            for _ in range(overruns):
                statuses[(await http.post("/hostile/overrun", json={"seconds": 3})).status_code] += 1
            began = time.perf_counter()
            after = await http.post("/hostile/overrun", json={"seconds": 0})
            took = (time.perf_counter() - began) * 1000
        await asyncio.sleep(3)
    late = gateway.log.read_text().splitlines().count("late")
    row.lost = int(after.status_code != 200)
    row.normal_ms = f"{took:.0f}"
    row.outcome = (f"overruns answered {dict(statuses)}; the next call {after.status_code}; side effects of "
                   f"overruns that landed: {late - (after.status_code == 200)}")
    return row


async def kill_mid_call(gateway: Gateway, rounds: int) -> Row:
    row = Row("kill-9", sent=rounds, faults=rounds)
    statuses: Counter = Counter()
    with gateway.measure(row):
        async with gateway.client(timeout=120) as http:
            for n in range(rounds):
                call = asyncio.ensure_future(http.post("/hostile/victim", json={"n": n}))
                deadline = time.monotonic() + 120
                while not (pids := [line.split()[2] for line in gateway.log.read_text().splitlines()
                                    if line.startswith(f"victim {n} ")]) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if not pids:  # no replica took it within the deadline (the autoscaler holds starts after failures)
                    call.cancel()
                    statuses["not started in 120 s"] += 1
                    continue
                os.kill(int(pids[0]), signal.SIGKILL)
                statuses[(await call).status_code] += 1
        await asyncio.sleep(1)
    ran = invocations(gateway.log, "victim")
    row.duplicated = sum(1 for n in range(rounds) if ran[str(n)] > 1)
    row.outcome = (
        f"replies {dict(statuses)} (502 = replica_failed, not retried); invocations per call {sorted(ran.values())}"
    )
    return row


async def stalled_readers(gateway: Gateway, count: int) -> Row:
    row = Row("stalled-readers", sent=count + 1, faults=count)
    body = b'{"count": 1000}'
    request = (f"POST /hostile/firehose HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer {gateway.key}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body

    async def stall() -> float:
        """Sends the request and reads nothing for 12 s (past the send timeout), then what the kernel and TLS
        buffered before the gateway closed the connection: seconds until it was closed, roughly."""
        reader, writer = await asyncio.open_connection(gateway.host, gateway.port, ssl=gateway.tls)
        began = time.monotonic()
        writer.write(request)
        await writer.drain()
        await asyncio.sleep(12)
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            while await asyncio.wait_for(reader.read(1 << 20), 60):
                pass
        writer.close()
        return time.monotonic() - began

    with gateway.measure(row):
        stalled = [asyncio.ensure_future(stall()) for _ in range(count)]
        await asyncio.sleep(1)  # every slot is held
        async with gateway.client(timeout=120) as http:
            began = time.perf_counter()
            reply = await http.post("/hostile/firehose", json={"count": 1})
            took = (time.perf_counter() - began) * 1000
        closed = await asyncio.gather(*stalled)
    row.normal_ms = f"{took:.0f}"
    row.lost = int(reply.status_code != 200)
    row.outcome = (f"normal call {reply.status_code} after {took / 1000:.1f} s (send timeout 5 s); the {count} "
                   f"stalled readers, reading again after 12 s, found their connections closed after "
                   f"{min(closed):.1f}-{max(closed):.1f} s")
    return row


async def key_flood(gateway: Gateway, flood: int) -> Row:
    row = Row("key-flood", sent=flood)
    statuses: Counter = Counter()
    waits: list[float] = []
    with gateway.measure(row):
        async with gateway.client(timeout=300, key=gateway.flooder, connections=flood) as flooder, \
                gateway.client(timeout=300) as other:
            backlog = asyncio.ensure_future(asyncio.gather(
                *(flooder.post("/hostile/busy", json={"seconds": 0.2}) for _ in range(flood)), return_exceptions=True))
            await asyncio.sleep(1)  # the backlog is queued
            while not backlog.done():
                began = time.perf_counter()
                reply = await other.post("/hostile/busy", json={"seconds": 0.2})
                waits.append((time.perf_counter() - began) * 1000)
                row.sent += 1
                row.lost += int(reply.status_code != 200)
            for reply in await backlog:
                statuses[reply.status_code if isinstance(reply, httpx.Response) else type(reply).__name__] += 1
    ms = sorted(waits)
    row.normal_ms = summary(waits)
    row.lost += flood - statuses[200]
    row.outcome = (f"the flooding key's {flood} calls: {dict(statuses)} over {len(waits) * 0.2:.0f}+ s; the other "
                   f"key's {len(waits)} calls, one at a time, took p50 {ms[len(ms) // 2]:.0f} ms, max {ms[-1]:.0f} "
                   f"ms (a call is 200 ms; queued behind the whole backlog it would wait ~{flood * 0.2 / 4:.0f} s)")
    return row


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def markdown(rows: list[Row], args) -> str:
    lines = [
        "# Hostile clients, faults and load against one `ember serve`",
        "",
        f"Machine: {machine()}. Command: `python bench/hostile.py {' '.join(sys.argv[1:])}`. "
        "Gateway: header timeout 5 s (also the TLS handshake's), connection cap 1,000, body budget 256 MiB, body "
        "timeout 60 s, send timeout 5 s. "
        "Lost: requests that should have been answered and were not (or, for load, not with 200). "
        "Duplicated: calls whose function ran more than once. RSS and fds are the gateway process's: "
        "before / peak during / 1 s after.",
        "",
        "| scenario | sent | faults | lost | duplicated | normal client ms (p50 / max) | gateway RSS MiB "
        "| gateway fds | outcome |",
        "|---|---:|---:|---:|---:|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.scenario} | {r.sent} | {r.faults} | {r.lost} | {r.duplicated} | {r.normal_ms} | "
                     f"{' / '.join(map(str, r.rss_mib))} | {' / '.join(map(str, r.fds))} | {r.outcome} |")
    return "\n".join(lines) + "\n"


async def scenarios(gateway: Gateway, args) -> list[Row]:
    rows = []
    for name, run in [("load", lambda: load(gateway, args.calls, args.concurrency)),
                      ("slow-headers", lambda: slow_headers(gateway, args.slow)),
                      ("slow-bodies", lambda: slow_bodies(gateway, 20)),
                      ("large-bodies", lambda: large_bodies(gateway, 32, 15 << 20)),
                      ("timeout-storm", lambda: timeout_storm(gateway, 10)),
                      ("kill-9", lambda: kill_mid_call(gateway, args.kills)),
                      ("stalled-readers", lambda: stalled_readers(gateway, 4)),
                      ("key-flood", lambda: key_flood(gateway, 200))]:
        if args.only and name not in args.only:
            continue
        print(f"{name} ...", flush=True)
        rows.append(await run())
        print(f"  {rows[-1]}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls in the load scenario (default 5000)")
    parser.add_argument("--concurrency", type=int, default=32, help="calls in flight in the load scenario")
    parser.add_argument("--slow", type=int, default=2000, help="slow-header connections (default 2000)")
    parser.add_argument("--kills", type=int, default=5, help="calls killed mid-call (default 5)")
    parser.add_argument("--only", type=lambda text: text.split(","), metavar="NAME,...",
                        help="run only these scenarios (load, slow-headers, slow-bodies, large-bodies, timeout-storm, "
                             "kill-9, stalled-readers, key-flood)")
    parser.add_argument("--record", action="store_true", help="write bench/results/hostile.md (every scenario)")
    args = parser.parse_args()
    if args.only and args.record:
        parser.error("--record writes every scenario's row: leave out --only")
    workdir = Path(tempfile.mkdtemp(prefix="ember-hostile-"))
    gateway = Gateway(workdir)
    try:
        gateway.wait_ready()
        rows = asyncio.run(scenarios(gateway, args))
    finally:
        gateway.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report = markdown(rows, args)
    print("\n" + report)
    if args.record:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "hostile.md").write_text(report)
        (RESULTS / "hostile.json").write_text(json.dumps([r.__dict__ for r in rows], indent=2) + "\n")
        print(f"wrote {RESULTS / 'hostile.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
