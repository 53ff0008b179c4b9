"""Ember's default autoscaling policy against KPA-like and Ray Serve default policies, in the trace simulator.

    python bench/autoscale_sim.py --trace PATH [--tiers wake=S,warm=S,cold=S] [--parked-holds host|gpu] [--json]
    python bench/autoscale_sim.py [--seeds 5] [--duration 3600] [--record]

With --trace, replays a JSON-lines trace ({"t", "function", "prompt_tokens", "output_tokens"}; each
function in it gets its own replicas, all with default settings, on one shared cluster) and prints a
table, or with --json exactly {"policies": {"ember": {"gpu_s", "p50_ttft_s", "p99_ttft_s", "slo"}, "kpa": ...,
"ray": ...}}. Without it, runs the held-out-style suite (bench/autoscale_traces.py: day, bursts,
small, steady and variations of each, several seeds) under the ladder's tier costs and under 13 s
tiers where a park frees nothing, and prints the comparison; --record writes it to
bench/results/autoscale_sim.{md,json} with the machine and a plot of replicas over time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

from ember.gateway.autoscaler.baselines import KPA_SETTINGS, KpaMemo, RayMemo, kpa_decide, ray_decide
from ember.gateway.autoscaler.policy import PolicyMemo, ScalingSettings, app_tail, decide
from ember.gateway.autoscaler.simulator import Policy, ReplicaModel, Report, simulate
from ember.gateway.autoscaler.trace import Request, read_jsonl
from ember.gateway.deployment import scaling_settings
from ember.spec import FunctionSpec

sys.path.insert(0, str(Path(__file__).parent))
from autoscale_traces import generate  # noqa: E402

# The function under test: an LLM replica that batches up to 16 requests, aimed at 10. Every scaling
# knob is left at its default, so Ember runs what `ember serve` runs for such a function.
FUNCTION = FunctionSpec(max_replicas=40, target_concurrency=10.0, max_concurrency=16)
EMBER = scaling_settings(FUNCTION)
SHAPE = dict(min_replicas=0, max_replicas=40, target_concurrency=10.0, max_concurrency=16)
KPA = ScalingSettings(**SHAPE, **KPA_SETTINGS)
RAY = ScalingSettings(**SHAPE)
SLO_TTFT = 2.0
TICK = 0.5  # the gateway calls every policy twice a second
# Every function of a trace shares one cluster of 5 nodes of 8 GPUs: 40 GPUs, as many as the largest trace has
# functions and a burst may ask replicas, so at their peaks functions compete for GPUs and starts make room or wait.
CLUSTER = dict(nodes=5, gpus_per_node=8)
LADDER = ReplicaModel(wake=0.3, node_warm=1.5, node_cold=4.0, **CLUSTER)  # the cold-start ladder's targets
# the H200 when the issue was filed: 13 s starts, parks that freed nothing
SLOW = ReplicaModel(wake=13.0, node_warm=13.0, node_cold=13.0, park_frees_gpu=False, **CLUSTER)
COLDSTART = Path(__file__).parent / "results" / "coldstart.json"


def measured_tiers(path: Path = COLDSTART) -> ReplicaModel | None:
    """The ladder as bench/coldstart.py last measured it on the GPU machine (its first model, Qwen3-4B's shape): T1
    wake, T2 warm and T2 cold to the first token, and whether a parked replica gave its GPU memory back (<= 2 GiB)."""
    try:
        model = json.loads(path.read_text())["models"][0]
        return ReplicaModel(wake=model["t1_wake_s"], node_warm=model["t2_warm_s"], node_cold=model["t2_cold_s"],
                            park_frees_gpu=(model.get("parked_gpu_bytes") or 0) <= 2 << 30, **CLUSTER)
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


MEASURED = measured_tiers()
NAMES = {"ember": "ember", "kpa": "kpa-like", "ray": "ray-default"}

# The suite: each kind at the parameters, and variations that move rates and shapes around.
SUITE = [
    ("day", {}), ("day", {"shape": "linear"}), ("day", {"low": 0.05, "high": 8.0}),
    ("bursts", {}), ("bursts", {"alpha": 1.2, "gap": 300.0}), ("bursts", {"burst_rate": 3.0, "burst_s": 30.0}),
    ("small", {}), ("small", {"spread": "log"}), ("small", {"functions": 40, "low": 0.005, "high": 0.1}),
    ("steady", {}), ("steady", {"rate": 1.0}), ("steady", {"rate": 20.0}),
]
GOAL_KINDS = ("bursts", "small")  # >= 40% fewer GPU-seconds than KPA-like when wakes are fast


def fast_wakes(model: ReplicaModel) -> bool:
    """Whether the issue's 40% goal applies: a park frees the GPU and a wake is as quick as the ladder's 0.3 s goal."""
    return model.park_frees_gpu and model.wake <= LADDER.wake


def policies(model: ReplicaModel, ember: ScalingSettings = EMBER) -> dict[str, Policy]:
    return {
        "ember": Policy("ember", partial(decide, ember), PolicyMemo(costs=model.costs()), 0, ember.max_replicas,
                        peers=app_tail),
        "kpa": Policy("kpa-like", partial(kpa_decide, KPA), KpaMemo(), 0, KPA.max_replicas),
        "ray": Policy("ray-default", partial(ray_decide, RAY), RayMemo(), 0, RAY.max_replicas),
    }


def compare(trace: list[Request], model: ReplicaModel, name: str, until: float | None = None,
            ember: ScalingSettings = EMBER) -> dict[str, Report]:
    until = until if until is not None else (trace[-1].t if trace else 0.0)
    return {key: simulate(trace, policy, model, tick=TICK, slo_ttft=SLO_TTFT, until=until, trace_name=name)
            for key, policy in policies(model, ember).items()}


def summary(reports: dict[str, Report]) -> dict:
    return {"policies": {key: {"gpu_s": round(r.gpu_seconds, 1), "p50_ttft_s": round(r.ttft_p50, 3),
                               "p99_ttft_s": round(r.ttft_p99, 3), "slo": round(r.slo_attainment, 4)}
                         for key, r in reports.items()}}


def parse_tiers(text: str) -> ReplicaModel:
    if text.strip() == "measured":
        if MEASURED is None:
            raise ValueError(f"--tiers measured reads {COLDSTART}, which is missing or not bench/coldstart.py's output")
        return MEASURED
    seconds = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("wake", "warm", "cold"):
            raise ValueError(f"--tiers takes wake=S,warm=S,cold=S; {key.strip()!r} is not one of them")
        seconds[key.strip()] = float(value)
    return replace(LADDER, wake=seconds.get("wake", LADDER.wake), node_warm=seconds.get("warm", LADDER.node_warm),
                   node_cold=seconds.get("cold", LADDER.node_cold))


def table(rows: list[tuple[str, str, dict[str, Report]]]) -> str:
    head = ("trace", "tiers", "policy", "GPU-s", "vs KPA", "starts P/W/C", "waited for a GPU", "TTFT p50",
            "TTFT p99", f"SLO (TTFT<={SLO_TTFT:g}s)", "503s", "parked host GB-s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for trace, tiers, reports in rows:
        kpa = reports["kpa"].gpu_seconds
        for r in reports.values():
            c = r.cold_starts
            lines.append("| " + " | ".join((
                trace, tiers, r.policy, f"{r.gpu_seconds:,.0f}", f"{r.gpu_seconds / kpa - 1:+.0%}",
                f"{c['parked']}/{c['node-warm']}/{c['node-cold']}", str(r.gpu_waits), f"{r.ttft_p50:.2f}",
                f"{r.ttft_p99:.2f}",
                f"{r.slo_attainment:.2%}", str(r.rejected), f"{r.parked_host_gb_seconds:,.0f}")) + " |")
    return "\n".join(lines)


def verdict(kind: str, fast: bool, e: Report, k: Report) -> tuple[str, bool]:
    """Ember against KPA-like on one trace, with the issue's goals."""
    change = e.gpu_seconds / k.gpu_seconds - 1
    fails = []
    if change > 0.005:  # half a percent: the bill of one replica for a few seconds on an hour's trace
        fails.append("more GPU-seconds")
    if kind in GOAL_KINDS and fast and change > -0.40:
        fails.append("under 40% saved")
    if round(e.ttft_p99, 2) > round(k.ttft_p99, 2):  # at the 10 ms the table shows: equal there is a tie
        fails.append("worse p99")
    if k.slo_attainment >= 0.99 > e.slo_attainment:
        fails.append("SLO under 99%")
    line = (f"GPU-s {change:+.0%}, p99 TTFT {e.ttft_p99:.2f} vs {k.ttft_p99:.2f} s, "
            f"SLO {e.slo_attainment:.2%} vs {k.slo_attainment:.2%}")
    return line + (": " + ", ".join(fails) if fails else ": ok"), not fails


def one_trace(seed: int, kind: str, options: dict, duration: float) -> list[dict]:
    trace = generate(kind, duration, seed, **options)
    label = kind + "".join(f" {k}={v}" for k, v in options.items())
    runs = []
    tier_sets = [("ladder", LADDER)] + ([("measured", MEASURED)] if MEASURED else []) + [("13s", SLOW)]
    for tiers, model in tier_sets:
        reports = compare(trace, model, label, until=duration)
        line, ok = verdict(kind, fast_wakes(model), reports["ember"], reports["kpa"])
        runs.append({"seed": seed, "kind": kind, "options": options, "label": label, "tiers": tiers,
                     "reports": reports, "verdict": line, "ok": ok})
    return runs


def suite(seeds: int, duration: float, progress: bool, jobs: int) -> list[dict]:
    """Every suite trace under both tier settings, `jobs` traces at a time (each trace is independent)."""
    tasks = [(seed, kind, options, duration) for seed in range(seeds) for kind, options in SUITE]
    runs, began = [], time.perf_counter()
    with multiprocessing.Pool(jobs) as pool:
        for done in pool.imap(star, tasks):
            runs += done
            if progress:
                for r in done:
                    print(f"  seed {r['seed']} {r['label']:40} {r['tiers']:6} {r['verdict']} "
                          f"({time.perf_counter() - began:.0f}s)", flush=True)
    return runs


def star(task: tuple) -> list[dict]:
    return one_trace(*task)


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu": names[0] if names else platform.processor() or platform.machine(), "cpus": os.cpu_count()}


def plot(runs: list[dict], path: Path) -> None:
    """Replicas holding a GPU, and parked replicas, over time per policy, on the seed-0 base traces."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in runs if r["seed"] == 0 and not r["options"] and r["tiers"] == "ladder"]
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 2.6 * len(shown)), squeeze=False)
    colors = {"ember": "tab:red", "kpa": "tab:blue", "ray": "tab:green"}
    for ax, run in zip(axes[:, 0], shown):
        for key, report in run["reports"].items():
            t = [x[0] / 60 for x in report.timeline]
            ax.step(t, [x[1] for x in report.timeline], where="post", color=colors[key], lw=1,
                    label=f"{report.policy} ({report.gpu_seconds:,.0f} GPU-s)")
            if key == "ember":
                ax.fill_between(t, [x[2] for x in report.timeline], step="post", color=colors[key], alpha=0.2,
                                label="ember parked (host RAM)")
        ax.set_title(f"{run['label']}, seed 0, ladder tiers", fontsize=9, loc="left")
        ax.set_ylabel("replicas")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


NOTES = """## How to read this

- Ember runs with every scaling knob at its default (`FunctionSpec(max_replicas=40, target_concurrency=10,
  max_concurrency=16)` through `gateway/deployment.scaling_settings`, as `ember serve` runs it). Its cost
  model starts from the backend's ladder and learns each function's wake and start seconds from the starts
  the simulator reports, and whether a park frees the GPU from each park.
- GPU-seconds count a replica from the moment it starts until it stops, and while parked where the park
  keeps the GPU (the 13s rows); where a park frees the GPU, a parked replica is billed as pinned host RAM.
- Every function of a trace shares one finite cluster: 5 nodes of 8 GPUs (40 GPUs; `CLUSTER`). A start
  that finds every GPU taken stops the longest-parked replica that holds one (13s rows, where a park
  keeps its GPU), else the longest-idle hot replica with nothing in flight, of any function, else waits
  until another replica gives one back; "waited for a GPU" counts the starts that waited. A parked
  replica wakes on its own node, or starts afresh elsewhere when that node is full. A start on a node
  that has not run the function is node-cold. Starts P/W/C: parked wakes / node-warm / node-cold. At
  40 GPUs no seed-0 start waited; on 4 nodes, without stopping idle replicas for room, the 40-function
  trace filled all 32 GPUs under every policy (57,899 GPU-s each, 383 503s).
- Verdict per trace: no more GPU-seconds than KPA-like (0.5% slack), at least 40% fewer on bursts and
  small functions under ladder tiers, p99 TTFT no worse at the table's 10 ms (equal there is a tie), SLO
  >= 99% wherever KPA-like reaches it.

## What the defaults trade, and where the 40% goal is out of reach

- Under 13 s tiers where a park frees nothing, parking cannot pay; Ember learns that and sizes and stops
  replicas as KPA does (60 s stable average, last replica stopped after 90 s idle), so GPU-seconds and
  p99 match KPA-like within a few percent either way.
- Under ladder tiers Ember's savings come from what KPA-like holds for nothing: capacity left over from a
  burst (parked within seconds, woken in 0.3 s) and replicas held across the gap between bursts. Where a
  function's requests of the last ~10 minutes spent more time queued behind busy replicas than a wake's
  delay for 1 in 100 of them (bursts), its p99 is already a wait for capacity; then, with the rate under
  one arrival per wake's cost (0.3 s x (1 + 10) = 3.3 GPU-s, i.e. under 0.3 req/s), the last replica
  parks after 3.3 s idle: the
  trickle's wakes (0.3-0.5 s TTFT) land below that p99, and on Poisson arrivals an idle second saves a
  wake with odds `rate` however long it has idled, so holding longer never pays.
- On Poisson arrivals a park can only save GPU-time by making requests wait for a wake: the chance that
  the next request comes after an idle stretch of X seconds is e^(-rate X), and that is also the share of
  the idle time a park after X saves. Cutting 40% of the GPU-seconds of 20 functions at 0.01-0.2 req/s
  means about 40% of their requests wait 0.3 s, and any extra request that waits moves the p99 TTFT up
  from a hot replica's (~0.2 s) to a wake's (~0.35-0.5 s). The default keeps the p99: the last replica
  parks only once its idle stretch would happen once in 1,000 arrivals at the function's recent rate
  (after a burst that is seconds; under a steady trickle it is what KPA holds, and then it parks
  instead of stopping, so the next request wakes in 0.3 s instead of starting cold). A user who prefers
  the GPU-seconds sets `park_after`: with `park_after=5` the seed-0 small-function trace costs 47% fewer
  GPU-seconds than KPA-like at a p99 TTFT of 0.51 s against 0.23 s (`python bench/autoscale_traces.py small
  --seed 0 --out small.jsonl; python bench/autoscale_sim.py --trace small.jsonl --park-after 5 --json`).
- Why no per-function rule gets both on "small": on Poisson arrivals the share of a function's idle time
  a park saves equals the share of its requests that wait for a wake (e^(-rate X) for a park after X s),
  so -40% needs 40%+ of those requests to wait 0.3 s, and the pooled p99 becomes a wake's (~0.45-0.5 s).
  That is no worse than KPA-like exactly where KPA-like's own cold starts are over 1% of requests (seed
  0 small: KPA p99 1.55 s) and worse where they are not (seed 1 small: KPA p99 0.30 s). A function
  cannot tell which: it sees only its own requests, and at 0.1-0.2 req/s its own p99 under KPA-like is a
  hot replica's. Tried in this work (before the cluster was bounded): parking every function under 0.3
  req/s after 3.3 s (the memoryless rule without the tail condition) saved 50-75% on 6 small traces with
  p99 better than KPA-like on 5, but made every day trace's p99 worse (0.23-0.36 s against 0.16-0.21 s:
  the night's requests wake); limiting it to rates where even a 90 s hold leaves >1% of requests to a
  wake (< 0.05 req/s) saved 15-45% and still lost day p99 on 4 of 6. The default keeps the p99, so
  "small" saves ~0% under ladder tiers.
- Steady load is sized as KPA-like sizes it, with no tolerance over the target: a 10% tolerance kept 2
  replicas at 22 concurrent where KPA-like ran 3, and Poisson peaks over their 32 slots queued (seed 0
  day low=0.05 high=8: 20 requests waited against KPA-like's 5, p99 0.20 against 0.19 s).
- Bursts whose requests fit one replica (burst_rate=3 burst_s=30) barely queue, so their p99 stays a hot
  replica's or a wake's and the last replica holds between them as under steady load: -30 and -20% there.
- Left as measured: seed 0 bursts under measured tiers, +4% GPU-seconds (at p99 1.08 against 1.62 s).
  The H200's latest park kept 3.1 GiB of GPU memory (bench/results/coldstart.json), over the 2 GiB this
  bench counts as freed, so those rows cannot park; Ember then still starts for a burst on its latest
  sample (a 1.1 s start comes within the panic window) where KPA-like waits for the 6 s average, and
  holds what it started through the panic. Seed 0 bursts alpha=1.2 under 13 s tiers, p99 9.76 against
  9.57 s, where Ember cannot park either: the start timings differ, not explained here. Near-target
  panics (1 -> 2 replicas) hold 4 park_afters (~9 s) where KPA-like's hold 60 s; a re-wake can then
  queue a few requests (a day trace's p99 was 0.19 against 0.18 s under the previous measured tiers;
  holding the stable window there cost steady traces 2% more GPU-seconds than KPA-like).
- No policy that cannot see arrivals coming does much better at a hot replica's p99. Poisson arrivals see
  time averages (PASTA): the share of a function's requests that find it with no hot replica equals the
  share of time it has none. Keeping the pooled p99 hot allows at most 1% of requests to wait, so the GPU
  time given back, weighted by each function's rate, is at most 1% of the requests' total: on seed 0
  small (20 functions, 0.105 req/s each on average) that is about the whole time of the one or two
  slowest functions, ~10% of the fleet, before counting what KPA-like already gives back in their gaps.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, help="JSON-lines trace to replay")
    ap.add_argument("--tiers", default="wake=0.3,warm=1.5,cold=4",
                    help="seconds per tier (default: the ladder's goals), or 'measured': bench/results/coldstart.json")
    ap.add_argument("--parked-holds", choices=("host", "gpu"), default="host",
                    help="what a parked replica keeps: pinned host RAM (default) or its GPU (a park frees nothing)")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    ap.add_argument("--park-after", type=float, help="Ember with this park_after instead of its learned one")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the suite (default 3)")
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds of each suite trace (default 3600)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="traces simulated at once (default: CPUs)")
    ap.add_argument("--record", action="store_true", help="write bench/results/autoscale_sim.{md,json,png}")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    if args.trace:
        try:
            model = replace(parse_tiers(args.tiers), park_frees_gpu=args.parked_holds == "host")
            trace = read_jsonl(args.trace.read_text().splitlines(), str(args.trace))
        except (OSError, ValueError) as exc:
            sys.exit(f"autoscale_sim: {exc}")
        ember = scaling_settings(FUNCTION.model_copy(update={"park_after": args.park_after}))
        reports = compare(trace, model, args.trace.name, ember=ember)
        if args.json:
            print(json.dumps(summary(reports)))
        else:
            print(table([(args.trace.name, args.tiers, reports)]))
        return

    if args.record:
        try:
            import matplotlib  # noqa: F401  (the plot is drawn last: say it is missing before the minutes of the suite)
        except ImportError:
            sys.exit("autoscale_sim: --record draws bench/results/autoscale_sim.png with matplotlib, which is not "
                     "installed: pip install -e '.[bench]' (or pip install 'matplotlib>=3.8')")
    began = time.perf_counter()
    runs = suite(args.seeds, args.duration, progress=not args.json, jobs=args.jobs)
    elapsed = time.perf_counter() - began
    passed = sum(r["ok"] for r in runs)
    if args.json:
        print(json.dumps([{"seed": r["seed"], "trace": r["label"], "tiers": r["tiers"], **summary(r["reports"])}
                          for r in runs]))
    else:
        print(f"{passed}/{len(runs)} traces meet every goal ({elapsed:.0f} s)")
    if not args.record:
        return
    host = machine()
    base = [(r["label"], r["tiers"], r["reports"]) for r in runs if r["seed"] == 0]
    md = "\n".join([
        "# Autoscaling policies on held-out-style traces",
        "",
        f"`python bench/autoscale_sim.py --seeds {args.seeds} --duration {args.duration:g} --record`: "
        f"{len(runs) * 3} simulations in {elapsed:.0f} s on {host['cpu']} ({host['cpus']} CPUs), "
        f"{host['platform']}, Python {host['python']}.",
        "",
        f"Tiers: ladder = {asdict(LADDER)} (the issue's goals); measured = "
        f"{asdict(MEASURED) if MEASURED else 'n/a'} (bench/results/coldstart.json, Qwen3-4B shape); "
        "13s = wake, node-warm and node-cold 13 s, a park keeps the GPU. "
        f"Policies decide every {TICK:g} s and at once when a request finds no replica. SLO: TTFT <= {SLO_TTFT:g} s "
        "over all requests (503s count as misses). KPA-like: "
        f"{KPA_SETTINGS}; Ray Serve default: target_ongoing_requests=2, look-back 30 s, upscale delay 30 s, "
        "downscale delay 600 s.",
        "",
        f"**{passed} of {len(runs)} traces meet every goal.**",
        "",
        "![replicas over time](autoscale_sim.png)",
        "",
        "## Ember against KPA-like, every trace and seed",
        "",
        *[f"- seed {r['seed']}, {r['label']}, {r['tiers']} tiers: {r['verdict']}" for r in runs],
        "",
        "## Seed 0",
        "",
        table(base),
        "",
        NOTES,
    ])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "autoscale_sim.md").write_text(md)
    (args.out / "autoscale_sim.json").write_text(json.dumps({
        "machine": host, "seconds": elapsed, "duration": args.duration, "tick": TICK, "slo_ttft": SLO_TTFT,
        "ember": asdict(EMBER), "kpa_like": asdict(KPA), "ladder": asdict(LADDER), "slow": asdict(SLOW),
        "measured": asdict(MEASURED) if MEASURED else None,
        "runs": [{"seed": r["seed"], "trace": r["label"], "tiers": r["tiers"], "ok": r["ok"], **summary(r["reports"])}
                 for r in runs],
    }, indent=1))
    plot(runs, args.out / "autoscale_sim.png")
    print(f"wrote {args.out / 'autoscale_sim.md'}, .json and .png")


if __name__ == "__main__":
    main()
