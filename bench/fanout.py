"""Fan-out and streaming from the Python SDK against a real `ember serve`, side by side in one run:

    python bench/fanout.py [--calls 200] [--seconds 0.1] [--values 200] [--every 0.005] [--record]

1. N calls of a function that takes `--seconds`: a loop of `.remote()`, `.map()`, and `.spawn()` of each then
   `.get()` of each. max_concurrency=4 and max_replicas=8: the loop keeps one call in flight, the map and the spawns
   put all N in the gateway's queue, so the autoscaler starts replicas for them.
2. `--values` values produced `--every` seconds apart: returned as one list by `.remote()` against yielded by a
   generator through `.remote_gen()`: time to the first value and to the last.
Prints a table; with --record writes bench/results/fanout.{md,json} with the machine.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
APP = HERE / "fanout_app.py"


def machine() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}


class Server:
    """`ember serve bench/fanout_app.py` in its own EMBER_HOME and process group."""

    def __init__(self, home: Path):
        self.process = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", str(APP), "--port", "0",
                                          "--no-watch"], env=os.environ | {"EMBER_HOME": str(home)},
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True)
        for line in self.process.stdout:
            if line.startswith("Ember is serving"):
                self.url = line.split(" at ")[-1].strip()
                break
        else:
            raise RuntimeError("ember serve exited before printing its URL")
        threading.Thread(target=lambda: self.process.stdout.read(), daemon=True).start()
        ca = str(home / "tls" / "ca.pem")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", verify=ca).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("ember serve never became ready")

    def stop(self) -> None:
        os.killpg(self.process.pid, 15)
        self.process.wait(30)


def replicas_started(app: str, function: str) -> int:
    report = json.loads(subprocess.run([sys.executable, "-m", "ember.cli", "status", "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    decisions = report["apps"][app]["functions"][function]["decisions"]
    return sum(d.get("count") or 0 for d in decisions if d["action"] == "start")


def fan_out(units, calls: int, seconds: float) -> list[dict]:
    work = units["work"]
    rows = []
    for name, run in [
        ("loop of .remote()", lambda: [work.remote(x, seconds) for x in range(calls)]),
        (".map()", lambda: list(work.map(range(calls), kwargs={"seconds": seconds}))),
        (".spawn() each, then .get()", lambda: [c.get() for c in [work.spawn(x, seconds) for x in range(calls)]]),
    ]:
        time.sleep(3)  # let the previous strategy's calls drain
        before = replicas_started("fanout-bench", "work")
        began = time.perf_counter()
        results = run()
        wall = time.perf_counter() - began
        assert results == list(range(calls)), name
        rows.append({"strategy": name, "calls": calls, "wall_s": round(wall, 3),
                     "calls_per_s": round(calls / wall, 1),
                     "replicas_started": replicas_started("fanout-bench", "work") - before})
    return rows


def streaming(units, values: int, every: float) -> list[dict]:
    rows = []
    list(units["as_stream"].remote_gen(1, 0.0))  # both functions have a hot replica before timing
    units["as_list"].remote(1, 0.0)
    for name, run in [(".remote() of a list", lambda: units["as_list"].remote(values, every)),
                      (".remote_gen() of a generator", lambda: units["as_stream"].remote_gen(values, every))]:
        began = time.perf_counter()
        first = last = None
        got = 0
        result = run()
        for _ in result:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            got += 1
        assert got == values, name
        rows.append({"how": name, "values": values, "first_value_ms": round((first - began) * 1000, 1),
                     "last_value_ms": round((last - began) * 1000, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=0.1, help="each fan-out call's duration")
    ap.add_argument("--values", type=int, default=200)
    ap.add_argument("--every", type=float, default=0.005, help="seconds between produced values")
    ap.add_argument("--record", action="store_true", help="write bench/results/fanout.{md,json}")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as home:
        os.environ["EMBER_HOME"] = home
        server = Server(Path(home))
        try:
            from ember.package import load_app

            units = load_app(str(APP)).units
            fan = fan_out(units, args.calls, args.seconds)
            stream = streaming(units, args.values, args.every)
        finally:
            server.stop()

    lines = ["| strategy | calls | wall s | calls/s | replicas started |", "|---|---|---|---|---|"]
    lines += [f"| {r['strategy']} | {r['calls']} | {r['wall_s']} | {r['calls_per_s']} | {r['replicas_started']} |"
              for r in fan]
    lines += ["", "| values returned by | values | first value ms | last value ms |", "|---|---|---|---|"]
    lines += [f"| {r['how']} | {r['values']} | {r['first_value_ms']} | {r['last_value_ms']} |" for r in stream]
    m = machine()
    note = (f"Calls of {args.seconds:g} s each at max_concurrency=4, max_replicas=8; {args.values} values "
            f"{args.every * 1000:g} ms apart. One `ember serve` on {m['platform']}, {m['cpu']}, {m['cpus']} CPUs, "
            f"Python {m['python']}.")
    table = "\n".join(lines)
    print(table)
    print(note)
    if args.record:
        out = HERE / "results"
        out.mkdir(exist_ok=True)
        (out / "fanout.md").write_text(f"# Fan-out and streaming from the SDK\n\n{table}\n\n{note}\n")
        (out / "fanout.json").write_text(json.dumps({"machine": m, "args": vars(args), "fan_out": fan,
                                                     "streaming": stream}, indent=2) + "\n")


if __name__ == "__main__":
    main()
