"""Gateway load: Ember's gateway vs direct vs LiteLLM's proxy, on loopback, in one run.

    python bench/gateway_load.py                 # full run, writes bench/results/gateway_load.{md,json}
    python bench/gateway_load.py --duration 2 --rates 100,500 --no-write   # quick harness check

One upstream (bench/gateway_upstream.py, one Ember replica answering /v1/chat/completions
at once) is reached three ways with the same OpenAI-style request:
  direct   plain HTTP to the replica's own port (the floor: the upstream's own cost);
  ember    HTTPS through `ember serve` with an API key (routing to that replica as usual);
  litellm  HTTPS through `litellm --config` with a master key, its model's api_base pointing
           at the same replica (TLS with the same certificate, so both gateways pay it).

Fixed rates are open loop: request i is due at t0 + i/rate whether or not earlier ones
returned, and its latency runs from that due time, so queueing counts (no coordinated
omission). Saturation is closed loop with wrk (N keep-alive connections, as fast as the
server answers). A target stops being offered higher rates once it falls behind (OVERLOAD_*).
Added latency is a row's percentile minus the direct row's at the same rate. Sustainable: achieved >= 99% of offered and p99 <= 50 ms (SUSTAIN_* below).
"""
import argparse
import asyncio
import gc
import json
import os
import platform
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent
UPSTREAM_APP = ROOT / "gateway_upstream.py"
RESULTS = ROOT / "results"
RATES = [100, 250, 500, 750, 1000, 1500, 2000]
SUSTAIN_ACHIEVED = 0.99  # fraction of the offered rate that must come back 200
SUSTAIN_P99_MS = 50.0
# A target is offered no higher rate after a point this far behind: its queue only grows from there.
OVERLOAD_ACHIEVED, OVERLOAD_P99_MS = 0.95, 1000.0
GOAL_RATE, GOAL_P50_MS, GOAL_P99_MS, GOAL_VS_LITELLM = 500, 1.0, 5.0, 2.0
PREOPEN = 32  # keep-alive connections opened (and TLS-handshaken) before a fixed-rate run starts
MAX_CONNECTIONS = 256  # more concurrent requests than this wait in the client's own queue (latency still counts)
MAX_OUTSTANDING = 2000  # beyond this the client drops the request and counts it as an error, bounding memory and time
DRAIN_S = 5.0  # after the last request is due, how long answers are awaited before the rest count as timeouts
START_TIMEOUT_S = 90.0
BODY = json.dumps({"model": "bench-model", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}).encode()


@dataclass
class Target:
    name: str
    host: str
    port: int
    path: str
    tls: bool
    key: str | None
    pid: int  # the process whose CPU time is this row's own cost: the replica (direct) or the proxy in front of it

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}{self.path}"

    def request(self) -> bytes:
        auth = f"Authorization: Bearer {self.key}\r\n" if self.key else ""
        return (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{auth}"
                f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n").encode() + BODY


# ---------------------------------------------------------------- open-loop client

now = time.perf_counter  # not loop.time(): uvloop's clock ticks in whole milliseconds

def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time; parses just enough of a response
    (status, Content-Length or chunked end) to know when it is complete."""

    def __init__(self, on_done):
        self.on_done, self.transport, self.buffer, self.busy, self.alive = on_done, None, bytearray(), False, True

    def connection_made(self, transport):
        self.transport = transport

    def send(self, data: bytes) -> None:
        self.busy = True
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower()
        length = re.search(rb"\r\ncontent-length: *(\d+)", head)
        if length:
            total = end + 4 + int(length.group(1))
            if len(self.buffer) < total:
                return
        elif self.buffer.endswith(b"0\r\n\r\n"):  # chunked: the last chunk has arrived
            total = len(self.buffer)
        else:
            return
        del self.buffer[:total]
        self.busy = False
        if b"\r\nconnection: close" in head:
            self.alive = False
            self.transport.close()
        self.on_done(self, int(head[9:12]))

    def connection_lost(self, exc):
        self.alive = False
        if self.busy:
            self.busy = False
            self.on_done(self, 0)


@dataclass
class RateResult:
    target: str
    offered: float
    sent: int
    ok: int
    errors: int
    achieved: float
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    send_lag_p99_ms: float  # how late the client itself sent (timer granularity, its own CPU)
    cpu_ms_per_request: float | None  # CPU time of the row's own process per completed request
    statuses: dict = field(default_factory=dict)

    @property
    def sustainable(self) -> bool:
        return self.achieved >= SUSTAIN_ACHIEVED * self.offered and self.p99_ms is not None and self.p99_ms <= SUSTAIN_P99_MS

    @property
    def overloaded(self) -> bool:
        return self.achieved < OVERLOAD_ACHIEVED * self.offered or self.p99_ms is None or self.p99_ms > OVERLOAD_P99_MS


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class OpenLoop:
    """Sends `rate` requests per second for `duration` seconds, each at its due time, over a pool of
    keep-alive connections; a request finding no free connection opens one (up to MAX_CONNECTIONS) or waits."""

    def __init__(self, target: Target, ssl_context: ssl.SSLContext | None):
        self.target, self.ssl = target, ssl_context if target.tls else None
        self.payload = target.request()
        self.idle: list[Connection] = []
        self.opened = 0
        self.backlog: list[float] = []
        self.inflight: dict[Connection, tuple[float, float]] = {}
        self.closed = False

    async def _open(self) -> Connection:
        self.opened += 1
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: Connection(self._done), self.target.host, self.target.port, ssl=self.ssl)
        except BaseException:
            self.opened -= 1
            raise
        return conn

    def _send(self, conn: Connection, due: float) -> None:
        self.inflight[conn] = (due, now())
        conn.send(self.payload)

    def _done(self, conn: Connection, status: int) -> None:
        entry = self.inflight.pop(conn, None)
        if entry is None:  # a connection closed by `close` after its run
            return
        due, sent = entry
        self.samples.append((due, sent, now(), status))
        if not conn.alive:
            self.opened -= 1
            if self.backlog:
                asyncio.ensure_future(self._fresh(self.backlog.pop(0)))
        elif self.backlog:
            self._send(conn, self.backlog.pop(0))
        else:
            self.idle.append(conn)

    async def _fresh(self, due: float) -> None:
        try:
            conn = await self._open()
        except OSError:
            self.samples.append((due, due, now(), 0))
            return
        if self.closed:  # connected only after the run gave up waiting
            conn.transport.close()
            return
        self._send(conn, due)

    def _issue(self, due: float) -> None:
        while self.idle and not self.idle[-1].alive:  # the server closed it while it sat idle
            self.idle.pop()
            self.opened -= 1
        if len(self.inflight) + len(self.backlog) >= MAX_OUTSTANDING:
            self.samples.append((due, due, due, -1))  # dropped by the client: the target is far behind
        elif self.idle:
            self._send(self.idle.pop(), due)
        elif self.opened < MAX_CONNECTIONS:
            asyncio.ensure_future(self._fresh(due))
        else:
            self.backlog.append(due)

    async def run(self, rate: float, duration: float) -> RateResult:
        self.samples: list[tuple[float, float, float, int]] = []
        while self.opened < PREOPEN:
            self.idle.append(await self._open())
        count = max(1, int(rate * duration))
        cpu_before = cpu_seconds(self.target.pid)
        t0 = now() + 0.01
        for i in range(count):
            due = t0 + i / rate
            if due > now():
                await asyncio.sleep(due - now())
            self._issue(due)
        deadline = now() + DRAIN_S
        while (self.inflight or self.backlog or len(self.samples) < count) and now() < deadline:
            await asyncio.sleep(0.005)
        return self._summarize(rate, count, cpu_seconds(self.target.pid) - cpu_before)

    def _summarize(self, rate: float, count: int, cpu: float) -> RateResult:
        statuses: dict[str, int] = {}
        for *_, status in self.samples:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        if count > len(self.samples):
            statuses["timeout"] = count - len(self.samples)
        good = [(due, sent, done) for due, sent, done, status in self.samples if status == 200]
        latencies = [(done - due) * 1000 for due, _, done in good]
        lags = [(sent - due) * 1000 for due, sent, _ in good]
        finished = sorted(done for *_, done in good)
        # Successes over the span they arrived in (at least the sending span): a fixed latency does not lower it, falling behind does.
        achieved = len(finished) / max(count / rate, finished[-1] - finished[0] if finished else 0.0)
        rounded = lambda v: None if v is None else round(v, 3)  # noqa: E731
        return RateResult(
            self.target.name, rate, count, len(good), count - len(good), round(achieved, 1),
            rounded(percentile(latencies, 0.50)), rounded(percentile(latencies, 0.99)), rounded(max(latencies, default=None)),
            round(percentile(lags, 0.99) or 0.0, 3), round(1000 * cpu / len(good), 3) if good else None, statuses,
        )

    def close(self) -> None:
        self.closed = True
        for conn in self.idle + list(self.inflight):
            conn.busy = False
            conn.transport.close()
        self.idle, self.inflight, self.opened = [], {}, 0


async def fixed_rate(target: Target, ssl_context, rate: float, duration: float) -> RateResult:
    client = OpenLoop(target, ssl_context)
    gc.disable()  # a collection pause in the client would show up as the target's latency
    try:
        return await client.run(rate, duration)
    finally:
        gc.enable()
        client.close()


# ---------------------------------------------------------------- closed-loop saturation (wrk)

@dataclass
class Saturation:
    target: str
    connections: int
    requests_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    non_2xx: int
    socket_errors: int
    cpu_ms_per_request: float


WRK_SCRIPT = """wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
{auth}
"""


def _wrk_ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def saturate(target: Target, workdir: Path, connections: int, duration: float, cpus: str | None) -> Saturation:
    script = workdir / f"wrk_{target.name}.lua"
    auth = f'wrk.headers["Authorization"] = "Bearer {target.key}"' if target.key else ""
    script.write_text(WRK_SCRIPT.format(body=json.dumps(BODY.decode()), auth=auth))
    command = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency", "-s", str(script), target.url]
    cpu_before = cpu_seconds(target.pid)
    out = subprocess.run(_pinned(command, cpus), capture_output=True, text=True, timeout=duration + 30).stdout
    cpu = cpu_seconds(target.pid) - cpu_before
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    p50, p99 = re.search(r"\n\s+50%\s+(\S+)", out), re.search(r"\n\s+99%\s+(\S+)", out)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if rps is None:
        raise RuntimeError(f"wrk printed no Requests/sec for {target.name}:\n{out}")
    return Saturation(target.name, connections, float(rps.group(1)), _wrk_ms(p50.group(1)) if p50 else None,
                      _wrk_ms(p99.group(1)) if p99 else None, int(non_2xx.group(1)) if non_2xx else 0,
                      sum(map(int, sock.groups())) if sock else 0, round(1000 * cpu / max(1, int(total.group(1))), 3))


# ---------------------------------------------------------------- the servers

def _pinned(command: list[str], cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus, *command] if cpus else command


class Processes:
    """Every server this benchmark starts, each in its own process group so its children (Ember's replica)
    go with it; `stop` ends them SIGTERM first, SIGKILL after a grace period."""

    def __init__(self, workdir: Path):
        self.workdir, self.started = workdir, []

    def start(self, name: str, command: list[str], env: dict) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env, start_new_session=True, cwd=self.workdir)
        self.started.append(process)
        return process, log

    def stop(self) -> None:
        for process in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.started:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                pass
            try:  # the group may outlive its leader (a replica whose gateway was killed)
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_for(what: str, log: Path, process: subprocess.Popen, ready) -> object:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}; its log {log}:\n{log.read_text()[-3000:]}")
        try:
            value = ready()
        except (httpx.HTTPError, OSError, ValueError, KeyError, IndexError):
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"{what} was not ready within {START_TIMEOUT_S:g} s; its log {log}:\n{log.read_text()[-3000:]}")


KEY_RPM = 100_000_000  # a per-key limit that is checked on every request but never reached


def serve_upstream(procs: Processes, home: Path, command: list[str], name: str, app: str,
                   function: str) -> tuple[subprocess.Popen, str, Path, dict, str]:
    """`command` (an `ember serve APP.py --port 0` line) with EMBER_HOME=home, once `app`'s `function` has a hot
    replica, and a key with a per-key rpm limit: (process, URL, dev CA path, the replica's status entry, key)."""
    env = os.environ | {"EMBER_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    process, log = procs.start(name, command, env)
    printed = lambda: re.search(r"at (https://\S+)", log.read_text())  # noqa: E731
    url = _wait_for("ember serve", log, process, printed).group(1)
    ca = home / "tls" / "ca.pem"
    admin = {"Authorization": f"Bearer {(home / 'cli.key').read_text().strip()}"}

    def hot_replica() -> dict | None:
        status = httpx.get(f"{url}/admin/status", headers=admin, verify=str(ca), timeout=5).json()
        replicas = status["apps"][app]["functions"][function]["replicas"]
        return next((r for r in replicas if r["state"] == "hot"), None)

    replica = _wait_for("the upstream replica", log, process, hot_replica)
    created = subprocess.run([sys.executable, "-m", "ember.cli", "keys", "create", "--name", "bench", "--rpm", str(KEY_RPM), "--quiet"],
                             env=env, capture_output=True, text=True, timeout=60)
    if created.returncode != 0:
        raise RuntimeError(f"ember keys create failed: {created.stderr.strip()}")
    return process, url, ca, replica, created.stdout.strip()


def start_ember(procs: Processes, home: Path, cpus: str | None) -> tuple[Target, Target, Path]:
    """`ember serve` on the upstream app and a key with a per-key rpm limit; returns the ember and direct
    targets and the dev CA path."""
    command = _pinned([sys.executable, "-m", "ember.cli", "serve", str(UPSTREAM_APP), "--port", "0"], cpus)
    process, url, ca, replica, key = serve_upstream(procs, home, command, "ember", "upstream", "Upstream")
    host, _, port = replica["address"].rpartition(":")
    path = "/v1/chat/completions"
    return (Target("ember", "127.0.0.1", int(url.rsplit(":", 1)[1]), "/upstream" + path, True, key, process.pid),
            Target("direct", host, int(port), path, False, None, replica["pid"]), ca)


LITELLM_CONFIG = """model_list:
  - model_name: bench-model
    litellm_params:
      model: openai/bench-model
      api_base: http://127.0.0.1:{port}/v1
      api_key: unused-by-the-upstream
      rpm: 100000000
router_settings:
  enable_pre_call_checks: true
litellm_settings:
  telemetry: false
  num_retries: 0
  request_timeout: 30
general_settings:
  master_key: {master_key}
"""


def start_litellm(procs: Processes, workdir: Path, upstream_port: int, cert_dir: Path, cpus: str | None) -> Target:
    """LiteLLM's proxy, one uvicorn worker like Ember's gateway, HTTPS with the same certificate as Ember's."""
    master_key = "sk-bench-" + os.urandom(12).hex()
    config = workdir / "litellm.yaml"
    config.write_text(LITELLM_CONFIG.format(port=upstream_port, master_key=master_key))
    port = _free_port()
    env = os.environ | {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "PYTHONUNBUFFERED": "1",
                        "DISABLE_SCHEMA_UPDATE": "True", "LITELLM_MODE": "PRODUCTION"}
    env.pop("DATABASE_URL", None)
    command = _pinned([shutil.which("litellm") or "litellm", "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                       "--num_workers", "1", "--ssl_certfile_path", str(cert_dir / "server.pem"),
                       "--ssl_keyfile_path", str(cert_dir / "server-key.pem")], cpus)
    process, log = procs.start("litellm", command, env)
    target = Target("litellm", "127.0.0.1", port, "/v1/chat/completions", True, master_key, process.pid)
    _wait_for("litellm", log, process, lambda: httpx.get(f"https://127.0.0.1:{port}/health/liveliness",
                                                         verify=str(cert_dir / "ca.pem"), timeout=5).status_code == 200)
    return target


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def probe(target: Target, ca: Path) -> dict:
    """One request by an ordinary client: the reply must be the upstream's completion; returns its headers."""
    headers = {"Authorization": f"Bearer {target.key}"} if target.key else {}
    reply = httpx.post(target.url, content=BODY, headers=headers | {"Content-Type": "application/json"}, verify=str(ca), timeout=30)
    if reply.status_code != 200 or reply.json()["choices"][0]["message"]["content"] != "pong":
        raise RuntimeError(f"{target.name} answered {reply.status_code}: {reply.text[:500]}")
    return dict(reply.headers)


# ---------------------------------------------------------------- the run

def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s+(.+)", lscpu)
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    version = lambda name: metadata.version(name)  # noqa: E731
    return {
        "cpu": model.group(1).strip() if model else platform.processor(), "cores": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "kernel": platform.release(),
        "python": platform.python_version(), "uvicorn": version("uvicorn"), "uvloop": version("uvloop"),
        "httpx": version("httpx"), "litellm": version("litellm"), "wrk": (wrk.stdout + wrk.stderr).split("\n")[0].split(" Copyright")[0].strip(),
    }


def commit() -> str:
    """The git commit measured, marked dirty when the code on the request path (gateway, worker, SDK) differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "gateway", "runtime/worker.py", "ember"], cwd=ROOT.parent,
                           capture_output=True, text=True).stdout.strip()
    return f"{head or 'unknown'}{' (gateway, worker or SDK modified)' if dirty else ''}"


def run(args) -> dict:
    import uvloop

    described = machine()
    workdir = Path(tempfile.mkdtemp(prefix="ember_gateway_load_"))
    procs = Processes(workdir)
    server_cpus, client_cpus = ("1", "0") if args.pin else (None, None)
    if client_cpus:
        os.sched_setaffinity(0, {int(client_cpus)})
    try:
        print(f"starting ember serve and litellm (logs in {workdir}) ...", flush=True)
        ember, direct, ca = start_ember(procs, workdir / "ember_home", server_cpus)
        litellm = start_litellm(procs, workdir, direct.port, ca.parent, server_cpus)
        targets = [direct, ember, litellm]
        ember_headers = probe(ember, ca)
        probe(direct, ca)
        probe(litellm, ca)
        rate_limited = any(h.startswith("x-ratelimit-") for h in ember_headers)
        context = ssl.create_default_context(cafile=str(ca))
        results: list[RateResult] = []
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            for target in targets:  # warm-up: first-request costs (imports, caches, pools) stay out of the numbers
                runner.run(fixed_rate(target, context, 100, 1.0))
            alive = list(targets)
            for rate in args.rates:
                for target in list(alive):
                    result = runner.run(fixed_rate(target, context, rate, args.duration))
                    results.append(result)
                    print(_rate_line(result), flush=True)
                    if result.overloaded:
                        alive.remove(target)
            saturation = []
            for target in targets:
                # A proxy idle since its last rate holds keep-alive connections the upstream has closed since.
                runner.run(fixed_rate(target, context, 100, 0.5))
                saturation.append(saturate(target, workdir, args.connections, args.duration, client_cpus))
                print(f"saturation {target.name:8s} {saturation[-1].requests_per_s:8.0f} req/s  (wrk, {args.connections} connections)", flush=True)
    finally:
        procs.stop()
        if client_cpus:
            os.sched_setaffinity(0, set(range(os.cpu_count())))
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "machine": described,
        "settings": {"duration_s": args.duration, "rates": args.rates, "wrk_connections": args.connections,
                     "pinning": "client and wrk on cpu 0, servers on cpu 1" if args.pin else "none",
                     "sustainable": f"achieved >= {SUSTAIN_ACHIEVED:.0%} of offered and p99 <= {SUSTAIN_P99_MS:g} ms",
                     "overloaded": f"achieved < {OVERLOAD_ACHIEVED:.0%} of offered or p99 > {OVERLOAD_P99_MS:g} ms",
                     "commit": commit(),
                     "ember_rate_limit_enforced": rate_limited,
                     "tls": {"direct": False, "ember": True, "litellm": True},
                     "auth": {"direct": "none", "ember": "API key (Bearer)", "litellm": "master key (Bearer)"}},
        "fixed_rate": [asdict(r) | {"sustainable": r.sustainable} for r in results],
        "saturation": [asdict(s) for s in saturation],
    }


def _rate_line(r: RateResult) -> str:
    fmt = lambda v: "   -  " if v is None else f"{v:6.2f}"  # noqa: E731
    return (f"{r.offered:6.0f} req/s {r.target:8s} achieved {r.achieved:7.1f}  p50 {fmt(r.p50_ms)} ms  p99 {fmt(r.p99_ms)} ms  "
            f"errors {r.errors:5d}  cpu {fmt(r.cpu_ms_per_request)} ms/req  {'sustainable' if r.sustainable else 'unsustainable'}")


# ---------------------------------------------------------------- the report

def sustainable_rate(results: list[dict], target: str) -> float:
    return max((r["offered"] for r in results if r["target"] == target and r["sustainable"]), default=0.0)


def goals(data: dict) -> list[tuple[str, str, bool | None]]:
    rows = {(r["target"], r["offered"]): r for r in data["fixed_rate"]}
    ember, direct = rows.get(("ember", GOAL_RATE)), rows.get(("direct", GOAL_RATE))
    added = lambda q: None if not (ember and direct and ember[q] is not None and direct[q] is not None) else ember[q] - direct[q]  # noqa: E731
    a50, a99 = added("p50_ms"), added("p99_ms")
    reached = max((r["offered"] for r in data["fixed_rate"] if r["target"] == "ember"), default=None)
    missing = "not measured" if reached is None else f"not offered (Ember's highest offered rate: {reached:g} req/s)"
    fell_behind = None if reached is None or reached >= GOAL_RATE else False
    ours, theirs = sustainable_rate(data["fixed_rate"], "ember"), sustainable_rate(data["fixed_rate"], "litellm")
    return [
        (f"added p50 at {GOAL_RATE} req/s <= {GOAL_P50_MS:g} ms", missing if a50 is None else f"{a50:.2f} ms", fell_behind if a50 is None else a50 <= GOAL_P50_MS),
        (f"added p99 at {GOAL_RATE} req/s <= {GOAL_P99_MS:g} ms", missing if a99 is None else f"{a99:.2f} ms", fell_behind if a99 is None else a99 <= GOAL_P99_MS),
        (f"sustainable rate >= {GOAL_VS_LITELLM:g}x LiteLLM's", f"{ours:g} vs {theirs:g} req/s", ours >= GOAL_VS_LITELLM * theirs if theirs else bool(ours) or None),
    ]


def markdown(data: dict) -> str:
    m, s = data["machine"], data["settings"]
    direct = {r["offered"]: r for r in data["fixed_rate"] if r["target"] == "direct"}
    ms = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    plus = lambda v, base: "-" if v is None or base is None else f"{v - base:+.2f}"  # noqa: E731
    lines = [
        "# Gateway load: direct vs Ember's gateway vs LiteLLM's proxy",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, load average at start {m['load_average_at_start']}; Python {m['python']}, "
        f"uvicorn {m['uvicorn']}, uvloop {m['uvloop']}, LiteLLM {m['litellm']}, {m['wrk']}.",
        "",
        f"Upstream: one Ember replica (bench/gateway_upstream.py) answering `/v1/chat/completions` at once. "
        f"TLS: direct is plain HTTP to the replica; Ember and LiteLLM both serve HTTPS with the same certificate. "
        f"Auth: {s['auth']['ember']} on Ember, {s['auth']['litellm']} on LiteLLM. Rate limit: Ember "
        f"{'enforces a per-key limit (x-ratelimit-* headers seen)' if s['ember_rate_limit_enforced'] else 'sent no x-ratelimit-* headers: rate limiting is not wired into the gateway in this build'}; "
        f"LiteLLM has an rpm limit of 1e8 on the model deployment with pre-call checks (its per-key limits need its Postgres-backed virtual keys). "
        f"Pinning: {s['pinning']}. Open loop, {s['duration_s']:g} s per point; latency from each request's due time. "
        f"Sustainable: {s['sustainable']}. Added latency: a row's percentile minus direct's at the same rate. "
        f"A target is offered no higher rate after one where it {s['overloaded']}. CPU ms/req: CPU time of the row's own "
        f"process (direct: the replica; ember: the gateway; litellm: the proxy) per completed request. Measured tree: {s['commit']}.",
        "",
        "## Fixed rates (open loop)",
        "",
        "| offered req/s | target | achieved req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | errors | CPU ms/req | sustainable |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["fixed_rate"]:
        base = direct.get(r["offered"], {})
        lines.append(f"| {r['offered']:g} | {r['target']} | {r['achieved']:.0f} | {ms(r['p50_ms'])} | {ms(r['p99_ms'])} | "
                     f"{plus(r['p50_ms'], base.get('p50_ms'))} | {plus(r['p99_ms'], base.get('p99_ms'))} | {r['errors']} | {ms(r['cpu_ms_per_request'])} | "
                     f"{'yes' if r['sustainable'] else 'no'} |")
    rates = sorted({r["offered"] for r in data["fixed_rate"]})
    lines += ["", "Added latency vs direct, p50 / p99 ms, by offered rate (- where the target was not offered that rate):", "",
              "| target | " + " | ".join(f"{x:g} req/s" for x in rates) + " |", "|---|" + "---:|" * len(rates)]
    for name in ("ember", "litellm"):
        row = {r["offered"]: r for r in data["fixed_rate"] if r["target"] == name}
        cells = [f"{plus(row[x]['p50_ms'], direct.get(x, {}).get('p50_ms'))} / {plus(row[x]['p99_ms'], direct.get(x, {}).get('p99_ms'))}"
                 if x in row else "-" for x in rates]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"## Saturation (closed loop, wrk -t1 -c{s['wrk_connections']})", "",
              "| target | req/s | p50 ms | p99 ms | non-2xx | socket errors | CPU ms/req | highest sustainable fixed rate |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for x in data["saturation"]:
        lines.append(f"| {x['target']} | {x['requests_per_s']:.0f} | {ms(x['p50_ms'])} | {ms(x['p99_ms'])} | {x['non_2xx']} | "
                     f"{x['socket_errors']} | {ms(x['cpu_ms_per_request'])} | {sustainable_rate(data['fixed_rate'], x['target']):g} |")
    lines += ["", "## Goals (issue 5)", "", "| goal | measured | met |", "|---|---|---|"]
    for goal, value, met in goals(data):
        lines.append(f"| {goal} | {value} | {'-' if met is None else 'yes' if met else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per fixed-rate point and per saturation run (default 5)")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=RATES,
                        help=f"offered rates, req/s, comma-separated (default {','.join(map(str, RATES))})")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections for the saturation run (default 32)")
    parser.add_argument("--pin", action="store_true", help="pin the client and wrk to cpu 0 and the servers to cpu 1")
    parser.add_argument("--keep", action="store_true", help="keep the servers' logs and configs (their folder is printed at the start)")
    parser.add_argument("--record", action="store_true", help="write bench/results/gateway_load.{md,json}")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the servers it started, as Ctrl-C does
    if shutil.which("wrk") is None:
        print("error: wrk is not installed: apt-get install -y wrk", file=sys.stderr)
        return 2
    if shutil.which("litellm") is None:
        print("error: LiteLLM's proxy is not installed: pip install 'litellm[proxy]'", file=sys.stderr)
        return 2
    data = run(args)
    report = markdown(data)
    print("\n" + report)
    if args.record:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "gateway_load.json").write_text(json.dumps(data, indent=2) + "\n")
        (RESULTS / "gateway_load.md").write_text(report)
        print(f"wrote {RESULTS / 'gateway_load.md'} and {RESULTS / 'gateway_load.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
