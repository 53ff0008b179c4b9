"""The gateway's CPU per streamed token: Ember's gateway against a bare TLS relay and the replica alone, in one run.

    python bench/gateway_stream.py                         # concurrency 16 and 64, 3 rounds
    python bench/gateway_stream.py --concurrency 64 --rounds 5 --record
    python bench/gateway_stream.py --against /tmp/base     # also the gateway of another tree, in the same rounds

Online serving streams every token of every request through the gateway as its own server-sent event, so what the
gateway spends per event bounds the tokens per second one `ember serve` can relay. The upstream is one replica of
bench/gateway_stream_app.py: an OpenAI-style endpoint whose open streams each get their next token on a shared
tick every --step-ms (a decode step of one batch). This process is the client: N keep-alive connections each
stream --requests requests of --tokens tokens one after another. Three targets, in turn within each round:

- direct: the client talks to the replica itself, plain HTTP (what producing a token costs the replica);
- relay: a bare TLS-terminating byte pipe to the replica (asyncio, no HTTP parsing, no auth): the least a Python
  relay on this machine spends per event, the floor the gateway is measured against;
- ember: `ember serve` over HTTPS with an API key that has a rate limit, the request path users get.

CPU is each process's threads' run time (/proc/PID/task/*/schedstat) over the level, the relaying process's and
the replica's, per token event the client received. The relaying process runs on cpu 1 and the replica and client
on cpu 0, so the gateway's number is its own; each row is the round of least relay CPU per event: the machine's
other work only adds to it. The gateway's idle CPU (its autoscaler's ticks) is measured first and reported, not
subtracted. With --record the rows go to bench/results/gateway_stream.json.

--against DIR serves the same app from a second `ember serve` whose gateway code is DIR's (DIR/gateway and
DIR/ember, e.g. `git archive BASE gateway ember | tar -x -C DIR`), measured in the same rounds as a fourth target;
its replica runs this checkout's runtime, as this one's does. --against-loop asyncio runs that gateway on asyncio's
event loop even where uvloop is installed (what a gateway got before uvloop was one of Ember's dependencies).
"""
import argparse
import asyncio
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
from pathlib import Path

import aiohttp
from gateway_load import Processes, _wait_for, commit, serve_upstream

ROOT = Path(__file__).resolve().parent
APP = ROOT / "gateway_stream_app.py"
RESULTS = ROOT / "results" / "gateway_stream.json"
SERVER_CPU, CLIENT_CPU = 1, 0
PATH = "/v1/chat/completions"


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """The CPU time of `pid`'s threads so far, to the nanosecond (/proc's stat counts 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended between the listing and the read
    return total / 1e9


def pin(pid: int, cpu: int) -> None:
    """Every thread of `pid` to `cpu` (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {cpu})
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------- the bare relay (its own process)

async def relay_serve(upstream: tuple[str, int], cert: str, key: str) -> None:
    """Accept TLS connections and pipe each one's bytes to a connection of its own to `upstream`, both ways."""
    loop = asyncio.get_running_loop()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    class Back(asyncio.Protocol):
        def __init__(self, front: "Front") -> None:
            self.front = front

        def data_received(self, data: bytes) -> None:
            self.front.transport.write(data)

        def connection_lost(self, exc) -> None:
            self.front.transport.close()

    class Front(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport, self.pending, self.back = transport, [], None
            loop.create_task(self.connect())

        async def connect(self) -> None:
            self.back, _ = await loop.create_connection(lambda: Back(self), *upstream)
            for data in self.pending:
                self.back.write(data)

        def data_received(self, data: bytes) -> None:
            if self.back is None:
                self.pending.append(data)
            else:
                self.back.write(data)

        def connection_lost(self, exc) -> None:
            if self.back is not None:
                self.back.close()

    server = await loop.create_server(Front, "127.0.0.1", 0, ssl=context)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


# ---------------------------------------------------------------- servers

# `ember` with the ember and ember.gateway packages of the tree given as its first argument (--against).
FROM_TREE = """
import importlib.machinery, importlib.util, sys
from pathlib import Path
tree = Path(sys.argv.pop(1))
if sys.argv.pop(1) == "asyncio":
    sys.modules["uvloop"] = None  # uvicorn's "auto" loop falls back to asyncio's
folders = {"ember": tree / "ember", "ember.gateway": tree / "gateway"}

class Tree:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in folders:
            return importlib.util.spec_from_file_location(name, folders[name] / "__init__.py",
                                                          submodule_search_locations=[str(folders[name])])
        parent = name.rpartition(".")[0]
        if parent in folders or any(parent.startswith(root + ".") for root in folders):
            return importlib.machinery.PathFinder.find_spec(name, sys.modules[parent].__path__)
        return None

sys.meta_path.insert(0, Tree)
from ember.cli import main
sys.exit(main())
"""


def start_ember(procs: Processes, home: Path, tree: Path | None = None, loop: str = "auto") -> dict:
    ember = [sys.executable, "-c", FROM_TREE, str(tree), loop] if tree else [sys.executable, "-m", "ember.cli"]
    process, url, ca, replica, key = serve_upstream(procs, home, ember + ["serve", str(APP), "--port", "0"],
                                                    home.name, "stream", "Upstream")
    host, _, port = replica["address"].rpartition(":")
    return {"url": url, "ca": ca, "key": key, "pid": process.pid, "replica_pid": replica["pid"],
            "replica": (host, int(port)), "tls": home / "tls"}


def start_relay(procs: Processes, upstream: tuple[str, int], tls: Path) -> tuple[int, int]:
    process, log_path = procs.start("relay", [sys.executable, str(Path(__file__).resolve()), "--relay-serve",
                                              f"{upstream[0]}:{upstream[1]}", str(tls / "server.pem"),
                                              str(tls / "server-key.pem")], os.environ | {"PYTHONUNBUFFERED": "1"})
    port = _wait_for("the relay", log_path, process, lambda: int(log_path.read_text().split()[0]))
    return process.pid, port


# ---------------------------------------------------------------- the client

async def stream_level(url: str, headers: dict, context: ssl.SSLContext | None, concurrency: int, requests: int,
                       tokens: int, step_ms: float) -> dict:
    """`concurrency` connections each streaming `requests` requests; the events received and their gaps."""
    body = json.dumps({"max_tokens": tokens, "step_ms": step_ms, "stream": True}).encode()
    gaps: list[float] = []
    received = 0

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal received
        for _ in range(requests):
            async with session.post(url, data=body, headers=headers) as reply:
                if reply.status != 200:
                    raise RuntimeError(f"{url} answered {reply.status}: {(await reply.read())[:300]!r}")
                last = None
                async for data in reply.content.iter_any():
                    now = time.perf_counter()
                    count = data.count(b"data: {")
                    if count and last is not None:
                        gaps.append(now - last)
                    last = now if count else last
                    received += count

    connector = aiohttp.TCPConnector(limit=concurrency, ssl=context if context is not None else False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        began = time.perf_counter()
        await asyncio.gather(*(one(session) for _ in range(concurrency)))
        took = time.perf_counter() - began
    gaps.sort()
    expected = concurrency * requests * tokens
    if received != expected:
        raise RuntimeError(f"{url}: received {received} token events of {expected}")
    return {"events": received, "seconds": took,
            "itl_p50_ms": 1000 * gaps[len(gaps) // 2], "itl_p99_ms": 1000 * gaps[int(len(gaps) * 0.99)]}


def measure(target: dict, concurrency: int, args) -> dict:
    before = {name: cpu_seconds(pid) for name, pid in target["pids"].items()}
    level = asyncio.run(stream_level(target["url"], target["headers"], target["context"], concurrency, args.requests,
                                     args.tokens, args.step_ms))
    spent = {name: cpu_seconds(pid) - before[name] for name, pid in target["pids"].items()}
    row = {"target": target["name"], "concurrency": concurrency, "tok_s": round(level["events"] / level["seconds"], 1),
           "itl_p50_ms": round(level["itl_p50_ms"], 2), "itl_p99_ms": round(level["itl_p99_ms"], 2),
           "replica_us_per_token": round(1e6 * spent["replica"] / level["events"], 1)}
    if "relay" in spent:
        row["relay_us_per_token"] = round(1e6 * spent["relay"] / level["events"], 1)
    return row


def loop_name() -> str:
    """The event loop uvicorn's "auto" picks here: uvloop where installed (Ember's dependencies install it)."""
    try:
        import uvloop

        return f"uvloop {uvloop.__version__}"
    except ImportError:
        return "asyncio"


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s+(.+)", lscpu)
    return {"cpu": model.group(1).strip() if model else platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def run(args) -> dict:
    described = machine()
    workdir = Path(tempfile.mkdtemp(prefix="ember_gateway_stream_"))
    procs = Processes(workdir)
    try:
        log(f"starting ember serve and the relay (logs in {workdir}) ...")
        ember = start_ember(procs, workdir / "ember_home")
        against = (start_ember(procs, workdir / "against_home", Path(args.against).resolve(), args.against_loop)
                   if args.against else None)
        relay_pid, relay_port = start_relay(procs, ember["replica"], ember["tls"])
        for served in filter(None, (ember, against)):
            pin(served["pid"], SERVER_CPU)
            pin(served["replica_pid"], CLIENT_CPU)
        pin(relay_pid, SERVER_CPU)
        os.sched_setaffinity(0, {CLIENT_CPU})
        context = ssl.create_default_context(cafile=str(ember["ca"]))
        host, port = ember["replica"]
        targets = [
            {"name": "direct", "url": f"http://{host}:{port}{PATH}", "headers": {}, "context": None,
             "pids": {"replica": ember["replica_pid"]}},
            {"name": "relay", "url": f"https://localhost:{relay_port}{PATH}", "headers": {}, "context": context,
             "pids": {"relay": relay_pid, "replica": ember["replica_pid"]}},
            {"name": "ember", "url": f"{ember['url']}/stream{PATH}", "context": context,
             "headers": {"Authorization": f"Bearer {ember['key']}"},
             "pids": {"relay": ember["pid"], "replica": ember["replica_pid"]}},
        ] + ([{"name": "against", "url": f"{against['url']}/stream{PATH}",
               "context": ssl.create_default_context(cafile=str(against["ca"])),
               "headers": {"Authorization": f"Bearer {against['key']}"},
               "pids": {"relay": against["pid"], "replica": against["replica_pid"]}}] if against else [])
        idle_before = cpu_seconds(ember["pid"])
        time.sleep(3.0)
        idle = (cpu_seconds(ember["pid"]) - idle_before) / 3.0
        log(f"the gateway's idle CPU: {1000 * idle:.1f} ms/s")
        for target in targets:  # warm-up: imports, pools and caches stay out of the numbers
            asyncio.run(stream_level(target["url"], target["headers"], target["context"], 4, 1, 16, args.step_ms))
        rows: dict[tuple[str, int], dict] = {}
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                order = targets if round_ % 2 == 0 else targets[::-1]
                for target in order:
                    row = measure(target, concurrency, args)
                    log(f"round {round_ + 1} c{concurrency:<3d} {row}")
                    key = (target["name"], concurrency)
                    cost = row.get("relay_us_per_token", row["replica_us_per_token"])
                    if key not in rows or cost < rows[key].get("relay_us_per_token", rows[key]["replica_us_per_token"]):
                        rows[key] = row
    finally:
        procs.stop()
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    ordered = [rows[(t["name"], c)] for c in args.concurrency for t in targets]
    return {"machine": described,
            "settings": {"step_ms": args.step_ms, "tokens": args.tokens, "requests_per_connection": args.requests,
                         "rounds": args.rounds, "pinning": f"relaying process on cpu {SERVER_CPU}, replica and "
                                                           f"client on cpu {CLIENT_CPU}",
                         "row": "the round of least relay CPU per token", "commit": commit(),
                         "against": args.against and {"tree": args.against, "loop": args.against_loop},
                         "loop": loop_name()},
            "gateway_idle_cpu_ms_per_s": round(1000 * idle, 2), "rows": ordered}


def table(data: dict) -> str:
    lines = ["| concurrency | target | tok/s | relay CPU µs/token | replica CPU µs/token | ITL p50 / p99 ms |",
             "|---:|---|---:|---:|---:|---|"]
    for r in data["rows"]:
        relay = r.get("relay_us_per_token")
        lines.append(f"| {r['concurrency']} | {r['target']} | {r['tok_s']:,.0f} | {'-' if relay is None else relay} | "
                     f"{r['replica_us_per_token']} | {r['itl_p50_ms']} / {r['itl_p99_ms']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64],
                        help="streams at once, comma-separated (default 16,64)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request (default 128)")
    parser.add_argument("--requests", type=int, default=2, help="requests per connection per level (default 2)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the upstream's decode step (default 20 ms)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every level and target (default 3)")
    parser.add_argument("--against", metavar="DIR", help="also measure the gateway code of DIR (its gateway/, ember/)")
    parser.add_argument("--against-loop", choices=["auto", "asyncio"], default="auto",
                        help="the --against gateway's event loop (auto: uvloop where installed, as `ember serve`)")
    parser.add_argument("--keep", action="store_true", help="keep the servers' logs (their folder is printed)")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS.relative_to(ROOT.parent)}")
    parser.add_argument("--relay-serve", nargs=3, metavar=("HOST:PORT", "CERT", "KEY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the servers it started, as Ctrl-C does
    if args.relay_serve:
        host, _, port = args.relay_serve[0].rpartition(":")
        asyncio.run(relay_serve((host, int(port)), args.relay_serve[1], args.relay_serve[2]))
        return 0
    if len(os.sched_getaffinity(0)) < 2:
        print("error: this benchmark pins the relaying process and the client to two different cpus; run it where "
              "two are available", file=sys.stderr)
        return 2
    data = run(args)
    print(table(data))
    if args.record:
        RESULTS.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
