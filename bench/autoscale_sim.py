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
import math
import multiprocessing
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

from pydantic import ValidationError

from ember.gateway.autoscaler.baselines import KPA_SETTINGS, KpaMemo, RayMemo, kpa_decide, ray_decide
from ember.gateway.autoscaler.policy import AppTails, PolicyMemo, ScalingSettings, decide
from ember.gateway.autoscaler.simulator import Policy, ReplicaModel, Report, simulate
from ember.gateway.autoscaler.trace import Request, read_jsonl
from ember.gateway.deployment import scaling_settings
from ember.spec import FunctionSpec

sys.path.insert(0, str(Path(__file__).parent))
from autoscale_traces import MAX_DURATION_S, bounded, generate  # noqa: E402

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


def measured_note(path: Path = COLDSTART) -> str:
    """What the measured rows of this run used, from bench/coldstart.py's record."""
    if MEASURED is None:
        return f"No measured tiers in this run ({path} is missing or not bench/coldstart.py's output)."
    parked = json.loads(path.read_text())["models"][0].get("parked_gpu_bytes") or 0
    shown = "bench/results/coldstart.json" if path == COLDSTART else str(path)
    return (f"The measured tiers ({shown}, recorded on the H200) park in {parked / 2**30:.2f} GiB "
            f"of GPU memory, {'under' if MEASURED.park_frees_gpu else 'over'} the 2 GiB this bench counts as freed, "
            f"so measured rows {'park' if MEASURED.park_frees_gpu else 'keep the GPU while parked'}: wake "
            f"{MEASURED.wake} s, T2 warm {MEASURED.node_warm} s, T2 cold {MEASURED.node_cold} s.")
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
                        peers=AppTails),
        "kpa": Policy("kpa-like", partial(kpa_decide, KPA), KpaMemo(), 0, KPA.max_replicas),
        "ray": Policy("ray-default", partial(ray_decide, RAY), RayMemo(), 0, RAY.max_replicas),
    }


def compare(trace: list[Request], model: ReplicaModel, name: str, until: float | None = None,
            ember: ScalingSettings = EMBER, progress: bool = False) -> dict[str, Report]:
    """Every policy's report on `trace`; with `progress`, a line on stderr as each begins and ends (on a 2-core
    machine a day of trace took 37 s under Ember's policy and 11-13 s under the others; 2,000 requests over 10
    minutes among 50 functions took 29 s in all, among 200 functions 149 s)."""
    until = until if until is not None else (trace[-1].t if trace else 0.0)
    reports = {}
    for key, policy in policies(model, ember).items():
        began = time.perf_counter()
        if progress:
            print(f"autoscale_sim: {name}: {len(trace):,} requests over {until:,.0f} s under {policy.name}...",
                  file=sys.stderr, flush=True)
        reports[key] = simulate(trace, policy, model, tick=TICK, slo_ttft=SLO_TTFT, until=until, trace_name=name)
        if progress:
            print(f"autoscale_sim: {name}: {policy.name} done in {time.perf_counter() - began:.1f} s",
                  file=sys.stderr, flush=True)
    return reports


def summary(reports: dict[str, Report]) -> dict:
    return {"policies": {key: {"gpu_s": round(r.gpu_seconds, 1), "p50_ttft_s": round(r.ttft_p50, 3),
                               "p99_ttft_s": round(r.ttft_p99, 3), "slo": round(r.slo_attainment, 4)}
                         for key, r in reports.items()}}


MAX_TIER_S = 3600.0   # a start that takes longer is no tier a policy could weigh


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
        try:
            seconds[key.strip()] = float(value)
        except ValueError:
            seconds[key.strip()] = math.nan
        if not 0 <= seconds[key.strip()] <= MAX_TIER_S:
            raise ValueError(f"--tiers {key.strip()}={value.strip()!r}: want seconds from 0 to {MAX_TIER_S:g}")
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
  the simulator reports, and whether a park frees the GPU from each park. The functions of a trace are one
  app: each is told its app-mates' pooled tail (`policy.app_tail`), as the gateway's scaler tells each
  function of a deployment.
- GPU-seconds count a replica from the moment it starts until it stops, and while parked where the park
  keeps the GPU (the 13s rows); where a park frees the GPU, a parked replica is billed as pinned host RAM.
  MEASURED_NOTE The measured-tier counts in the notes below are from the record whose tiers were wake
  0.199 s, T2 warm 0.882 s and T2 cold 5.017 s; the list and table above are this run's.
- Every function of a trace shares one finite cluster: 5 nodes of 8 GPUs (40 GPUs; `CLUSTER`). A start
  that finds every GPU taken stops the longest-parked replica that holds one (13s rows, where a park
  keeps its GPU), else the longest-idle hot replica with nothing in flight, of any function, else waits
  until another replica gives one back; "waited for a GPU" counts the starts that waited. A parked
  replica wakes on its own node, or starts afresh elsewhere when that node is full. A start on a node
  that has not run the function is node-cold. Starts P/W/C: parked wakes / node-warm / node-cold.
- Verdict per trace: no more GPU-seconds than KPA-like (0.5% slack); at least 40% fewer on bursts and small
  functions wherever wakes are fast (a park frees the GPU and a wake takes at most the ladder's 0.3 s: the
  ladder and, since the re-recorded coldstart.json, the measured rows); p99 TTFT no worse at the table's
  10 ms (equal there is a tie); SLO >= 99% wherever KPA-like reaches it.

## What the defaults trade, and where the 40% goal is out of reach

- Since 2026-12-03 the record runs seeds 0-4, the issue's five (before, seeds 0-1, whose counts the notes below
  quote: 70 of 72). What fails of the 180: small at seeds 1-4 under fast wakes (8: KPA-like's p99 there is a
  hot replica's or a first start's, below), bursts burst_rate=3 at seeds 3-4 and alpha=1.2 at seed 4 under fast
  wakes (6, at -35% to -38%: the trickle between bursts, below), and day shape=linear seed 3 under the measured
  tiers (+1% GPU-seconds, 0.18 s p99 either way). The same 15 fail with the 4B tiers re-measured on 2026-12-06
  (wake 0.193 s, T2 warm 0.436, T2 cold 3.997, against 0.200, 0.472, 4.470): burst_rate=3 seed 4 under them
  now also misses on p99 (1.34 against KPA-like's 1.20 s; 0.97 against 1.22 before), at -37% GPU-seconds.
- Held out at the trace generator's default length (3600 s; the record runs 1800), the issue's four kinds at their
  default options, seeds 5-9, all three tiers (2026-12-03, a script in the session's scratch calling `one_trace`):
  49 of 60 pass. Bursts and steady pass all 30 (bursts -64% to -73% under fast wakes). Small fails at seeds 6-9
  under fast wakes (8 rows, -0% at a hot replica's p99 as at seeds 1-4 above; seed 9 ladder also 0.23 vs 0.22 s,
  from one wake after an idle stretch of ln(1000) mean gaps that KPA-like held through); seed 5 passes (-42%). Day
  fails 3 (seed 5 13s, seed 6 ladder and measured: p99 0.01-0.02 s over, GPU-s -1% to -2%); day seeds 0-9 at 3600
  s pass 24 of 30 (13s tiers fail at seeds 0, 1, 2, 5, up to 0.21 vs 0.17 s). At noon the day trace sits at 9-10
  concurrent against one replica's target of 10: KPA-like evicts the second replica as its stable average dips
  under 10, panics again the next tick (its panic counts only ready replicas) and so holds two most of the time,
  paying a start each round; Ember, which does not scale under what the panic window would panic over, drops to
  one at a dip and a Poisson peak over 16 slots then waits for a wake, or a 13 s start. Tried against it and
  dropped: holding the count whose slots take the stable average's Poisson spread (fixes 3 of those 6 and fails
  seed 7's 13s row at +1% GPU-s, and +1% on 12 of the record's 1800 s day traces), holding what the panic window's
  peak over the hold or the stable window asked (+1% to +5% GPU-s on most day traces), and a last replica that
  holds until 1 in 100,000 arrivals' idle stretch instead of 1 in 1,000 (fixes small seed 9's p99; the record's
  verdicts unchanged, bursts 1-3 points less saved, burst_rate=3 seed 2 ladder -42% -> -41%). The record's one day
  failure (linear seed 3, measured, +1%) is the same band the other way: Ember held two replicas from ~800 to
  1,000 s where KPA-like's evict-and-restart rounds left it one for a while.
- Under 13 s tiers where a park frees nothing, parking cannot pay; Ember learns that and sizes and stops
  replicas as KPA does (60 s stable average, last replica stopped after 90 s idle), so GPU-seconds match
  KPA-like within a few percent either way; on bursts its p99 is lower, as it starts capacity on a
  burst's first sample (below).
- Under fast wakes Ember's savings come from what KPA-like holds for nothing: capacity left over from a
  burst (parked within seconds, woken in 0.2-0.3 s) and replicas held across the gaps between requests.
  The last replica of a function holds until an idle stretch that long would come once in 1,000 arrivals
  at its recent rate, so its p99 stays a hot replica's; except where the app's p99 is already lost:
  over the last ~10 minutes (requests weighted to fade over 600 s), more than 1 in 100 of the app's
  requests either queued a wake's delay behind busy replicas, came after an idle stretch of 90 s or
  more (KPA's 60 s window and 30 s grace), which any policy that frees an idle replica within 90 s
  serves with a start (KPA-like) or a wake (Ember), or came in a surge: while the concurrency averaged
  over 6 s was over the slots (16 each) of the replicas the 60 s average sizes, as at a burst's onset,
  where KPA-like, which sizes on that average, has no slot for them until a start ends; or, once their
  function had served, waited while none of its replicas could take them (all parked, starting or
  draining): they waited for a wake or a start, over a hot replica's TTFT, so a p99 lost stays lost while
  parking fast keeps waking for them, until they fade. (Counted on
  the latest sample alone, a Poisson peak of day traffic over one replica's 16 slots, which waits only
  for a slot to free, made a held-out day trace, seed 5, park its last replica fast: p99 0.35 against
  0.18 s.) Then a function under one
  arrival per wake's cost (0.3 s x (1 + 10) = 3.3 GPU-s, i.e. under 0.3 req/s over the last 60 s or
  over the last 30 s) parks its last replica after 2 s idle (the floor kept for a caller's think
  time): its wakes land below that p99, and on
  Poisson arrivals an idle second saves a wake with odds `rate` however long it has idled, so holding
  never pays, not even a round trip's worth (the 3.3 s it held before). A function's first requests
  ever are not counted: every deployment starts each function once, and counting those would park fast
  through the first minutes of every app (checked again: on small seeds 1-3 that costs the p99, 0.44-0.45
  against KPA-like's 0.30-0.32 s under ladder tiers, while none of them reaches -40%).
- The small-function notes of the last record bounded the saving at a hot p99 by PASTA (the share of a
  function's idle time a park gives back is the share of its requests that wait for a wake); whether
  KPA-like's pooled p99 is a start is a property of the arrivals (how many come after 90 s of
  idleness), which the app sees. Per trace (ladder tiers; hot TTFT p99 ~0.18 s: a 3,200-token prompt
  at 20k tokens/s and one decode step):
  - spread=log and 40 functions at 0.005-0.1 req/s: 1.2% to ~10% of requests come after 90 s idle, so
    KPA-like's p99 is a start (1.06-5.23 s) and Ember parks every function after 2 s idle: -44%, -44%,
    -59%, -59% (seed 0), -72%, -72%, -70%, -70% (seed 1), each at a lower p99 than KPA-like's: a
    wake's tail, or the first starts on nodes without the function's snapshot that every policy pays.
  - seed 0 small: 0.95% of requests come after 90 s idle (the expectation from the 20 rates,
    sum(r e^(-90 r)) / sum(r); counted over the last ~10 minutes it hovers at 0.8-1.2%). Ember parked
    fast only while that count was over 1 in 100, 39% of the time (-31%, ladder and measured), and went
    back to holding each time it dipped under, though the wakes parking fast had cost (each over a hot
    replica's TTFT) were still in the window. It now counts those too (requests that waited with no
    replica to take them, once their function had served), so the p99 stays lost while it wakes for
    them: -50% / -51% at p99 0.53 / 0.43 s against 1.55 / 0.94 s (spread=log seed 0: -44% -> -58%).
  - seed 1 small: what a p99 no worse leaves. Of KPA-like's 4,049 requests, 40 are over a wake's TTFT
    (0.32 s, ladder): 27 wait on the 20 first starts, 10 on starts after 90 s idle, 3 are hot with
    prompts over ~6,000 tokens: 0.99%, so its p99 (0.297 s ladder, 0.358 s measured) is a hot
    replica's tail, not a start (seed 0: 1.83%, p99 1.55 s). Under ladder tiers a wake's TTFT (>= 0.317
    s) is over it and Ember's run has the same 40 requests at or over 0.305 s (the same first starts;
    its restarts are wakes): one more wake and the p99 rounds worse. Measured, with an oracle that
    parks after 2 s only the k slowest functions (the most GPU-seconds saved per wake: a function's mean
    gap) and holds the rest: ladder k=1 -3% at p99 0.34 s (against 0.30); measured k=4 -14% at 0.357 s
    (against 0.358), k=6 -21% at 0.368 s, k=10 -34% at 0.398 s (855 wakes; one crosses 0.365 s with a
    prompt over ~3,000 tokens, 1.3% of them, or when its node is full and it starts afresh). -40% at a
    p99 no worse is out of reach of any policy here; Ember holds (-0%, p99 0.30 vs 0.30 and 0.25 vs
    0.36 s). Held-out seeds 2 and 3 are the same (0.99% and 0.94% of KPA-like's requests over a wake's
    TTFT; p99 0.32 / 0.31 s ladder). The simulator frees a parked replica's GPU to the cluster and places
    starts on the lowest free GPU, so a wake can find its node full; the AWS backend instead keeps a
    parked replica's slot on its node (`ACTIVE` counts "parked") and places a start on the least busy
    node that holds the package.
  - held-out seed 4 small: KPA-like's p99 is a start (1.52 s) only with its first starts: 0.57% of
    requests wait on starts after 90 s idle and 0.65% on the first starts. Counting a function's first
    requests would win it (and parks fast through every app's first minutes: on seeds 1-3 that costs
    the p99, 0.44-0.46 against 0.30-0.32 s, ladder), so they stay uncounted: a first start says nothing
    about a function's traffic. Ember holds there (-0%, p99 0.34 vs 1.52 s).
  A user who prefers the GPU-seconds sets `park_after` (`python bench/autoscale_traces.py small --seed 1
  --duration 1800 --out small.jsonl; python bench/autoscale_sim.py --trace small.jsonl --park-after 5
  --json`); on seeds 1-3 small that costs the p99.
- Bursts whose requests fit one replica (burst_rate=3 burst_s=30): -47/-45% (ladder) and -47/-47%
  (measured) at p99 0.61/0.41 and 0.56/0.44 s against KPA-like's 1.41/0.62 and 1.03/0.59 s (seeds 0/1;
  -26/-16% and -22/-24% three records ago). Three rules held replicas there: the bursts barely queue
  behind Ember's replicas (a wake lands before 16 slots fill), so the app's p99 did not count as lost
  and the last replica held 90 s after each request of the 0.05 req/s trickle between bursts; their
  onsets are surges, now counted, and the trickle parks after 2 s, judged on the lower of the 60 s
  window's rate and its last 30 s's (the whole window still counts a burst that ended). A panic that
  began just after a burst's panic ended was taken for load near the target and held 60 s; a panic
  within a stable window of a burst now holds as the burst's (the 60 s average it would be near counts
  the burst). And after a burst, spare capacity parked below what the 6 s average, still counting the
  burst's tail, would panic over (to 3 of 19 replicas while it asked for 6, on bursts seed 5), so the
  next tick panicked, woke 10 and held them 60 s; it now parks no lower than that.
- Two rules since the last record, for bursts that outlast the stable window or need several replicas:
  - Load that fell (the 60 s average asks twice the replicas the 6 s average does, and more than one
    beyond them: the mirror of a burst) parks as after a burst. A burst longer than 60 s stopped counting
    as one while the stable average followed it, so when it ended the stable average's count held: on
    held-out bursts alpha=1.2 seed 4 (ladder) 40 replicas stayed hot ~11 s after a 94 s burst at 150
    req/s while 55 requests drained, then one trickle request at zero woke 35 parked replicas and held
    them until they idled out (-17% -> -28% GPU-s against KPA-like).
  - Where the app's p99 is already lost to requests that found no capacity (surges, stranded requests)
    and a wake is quick, replicas fill their 16 slots less the concurrency's Poisson spread, ceil((c +
    2.33 sqrt(c)) / 16) (2.33: passed one time in 100), never more than the target's ceil(c / 10). The
    target's headroom holds what comes while a start runs; here capacity is a wake away, and a request
    over the slots waits a wake at most, which the p99 already counts. A p99 lost only to queueing behind
    busy replicas does not count: filling slots queues more and would keep it lost by itself (counted,
    steady rate=20 seeds 1/2 held 8-10% fewer GPU-seconds than KPA-like and lost the p99 tie, 0.22 vs 0.21
    and 0.20 vs 0.19 s).
    It costs p99 margin where KPA-like's p99 is a start: bursts seed 1 0.84 -> 1.08 s (KPA-like 2.65),
    burst_rate=3 seed 1 0.36 -> 0.41 s (0.62). A spread of 1 standard deviation instead of 2.33 saves
    more and loses that tie (burst_rate=3 seed 1 p99 0.67 vs 0.62 s).
  Where Ember's GPU-seconds went on held-out burst_rate=3 seed 4 (ladder) before them: 2,882 of its
  3,271 were replicas with requests in flight, against 2,980 for replicas at exactly ceil(concurrency /
  10) with no lag or idle second: at the target of 10, -40% was out of reach (-34%), as the last notes
  said. That bound was too narrow: the replicas that fill 16 slots less the spread, with no lag or idle,
  on the concurrency of every request served at once, come to -42%, -43%, -45% of KPA-like's GPU-seconds
  on burst_rate=3 seeds 3, 4, 5 (at the target: -40%, -34%, -38%) and -46%, -55% on alpha=1.2 seeds 4, 5
  (-28%, -40%); with every slot full, -56%, -53%, -57% and -53%, -61%. Held-out bursts rows, ladder
  (seeds 2-7, 1800 s): burst_rate=3 seeds 3, 4, 5, 7 -34%,
  -26%, -26%, -36% -> -35%, -37%, -34%, -37% (still short), alpha=1.2 seeds 4, 5 -17%, -27% -> -38%, -43%
  (seed 5 passes on both fast tiers; seed 4 is short and its measured-tier p99 is 4.49 vs 4.37 s, both
  capacity-bound at the cluster's 40 GPUs). What is left over those bounds: after each trickle request
  the last replica holds PARK_AFTER_FLOOR (2 s, a caller's think time between turns) before it parks, and
  on seed 7, whose bursts fit one replica's slots and barely surge, for up to 90 s where the app's p99
  counts as a hot replica's (Ember's is 0.53 s against KPA-like's 1.23, about 1 in 100 of its requests
  waiting at burst onsets: on the line). The trickle alone costs 280, 426, 422 and 455 GPU-s on seeds 3,
  4, 5, 7, of which 154, 208, 266 and 344 idle (KPA-like's bill: 2,944, 4,441, 4,230, 2,683); a 0.5 s
  floor would take seeds 3, 4, 5, 7 to -37%, -39%, -35%, -39%, still short, and drops a think time the
  policy cannot see from the trace, so the floor stays.
  Counts with both rules, against the commit before them, every trace of the suite under all three tiers,
  counted as `python bench/autoscale_sim.py --seeds 8 --duration 1800` counts seeds 0-7 (the same traces,
  policies and verdict; these runs left out Ray-default, which no verdict reads): recorded seeds 0-1 69 ->
  69 of 72 (70 with the next rule); held-out seeds 2-4 96 -> 96 of 108, seeds 5-7 96 -> 98 of 108 (alpha=1.2 seed 5,
  ladder and measured); seeds 8-9 of day, bursts and steady 52 -> 52 of 54 (seed 9 day fails both ways:
  p99 0.21 vs 0.17 s). No trace that passed fails. Neither rule acts on the small-functions traces (a
  function under 10 concurrent is one replica either way, and none falls from over two replicas' worth):
  their rows are the same run for run (seeds 0-7: the same GPU-seconds and p99 in all 72 small runs).
- A panic of load near the target (1 -> 2 replicas at 9-10 concurrent against a target of 10: under
  panic_threshold x the stable average and at most one replica over its count) holds the stable window,
  as KPA's does; once the measured tiers could park, seed 1 day linear parked the second replica 9 s
  after each crossing and re-woke it while requests queued over the first one's 16 slots (p99 0.19
  against 0.18 s); it now ties. A burst (load at panic_threshold x the stable average, or more than one
  replica over its count), or a panic within a stable window of one, holds only 4 park_afters.
- Steady load is sized as KPA-like sizes it, with no tolerance over the target: a 10% tolerance kept 2
  replicas at 22 concurrent where KPA-like ran 3, and Poisson peaks over their 32 slots queued.
- No scale-down, parking or not, goes under what the panic window would panic over at once. On held-out
  day seed 4 (ladder) a near-target panic ended at t=992.5 s while the 6 s average was 10.3 (two
  replicas' worth), the second replica parked, the next tick panicked, woke it and held it another 60 s:
  +3% GPU-s against KPA-like, now +0% (day linear seed 4, 13 s tiers: +1% -> -1%).
- A burst in the latest sample starts capacity at once, however slow a start. It used to only where a
  start (or wake) came within the 6 s panic window; slower, the policy waited for the 6 s average, on the
  reasoning that the average has seen the burst by the time that capacity could help. It has, but the
  capacity then comes a start after that, so every request queued meanwhile waits the extra seconds.
  Seed 0 bursts alpha=1.2 under 13 s tiers failed on it: p99 9.76 against KPA-like's 9.57 s at -12%
  GPU-s, both policies asking for their first start of each burst on the same tick. The p99 is the 27th
  slowest of 2,651 requests; both had 48 requests over 9 s in the burst at t=852 s, and KPA-like's luck
  made the rest: at t=401.5 its panic ended with 47 requests in flight, it stopped 4 of 5 replicas,
  panicked over its one ready replica while 13 s starts ran and held 6 replicas to t=474.5, just past the
  next burst's onset at 473.5 (Ember, sizing down with the load, had 1): over t=450-510 its requests over
  9 s were 26 against Ember's 67. Starting on the first sample (1-2 s sooner at each onset) brings Ember's
  requests over 9 s to 14 (9 at t=852) and its p99 to 8.77 s, -12% GPU-s. Under 13 s tiers on bursts,
  day and steady, seeds 0-4, it lowers the p99 on every bursts trace (by 0.2-1.3 s) with up to 6% fewer
  GPU-s than before, 44 -> 45 of 45; under the ladder and measured tiers every start comes within the
  panic window, so those rows are unchanged.
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
    ap.add_argument("--seeds", type=bounded(int, 1, 1000, low_open=False), default=3,
                    help="seeds of the suite (default 3)")
    ap.add_argument("--duration", type=bounded(float, 0, MAX_DURATION_S), default=3600.0,
                    help="seconds of each suite trace (default 3600)")
    ap.add_argument("--jobs", type=bounded(int, 1, 1024, low_open=False), default=os.cpu_count() or 1,
                    help="traces simulated at once (default: CPUs)")
    ap.add_argument("--record", action="store_true", help="write bench/results/autoscale_sim.{md,json,png}")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    if args.trace:
        try:
            model = replace(parse_tiers(args.tiers), park_frees_gpu=args.parked_holds == "host")
            trace = read_jsonl(args.trace.read_text().splitlines(), str(args.trace))
            spec = FunctionSpec.model_validate(FUNCTION.model_dump() | {"park_after": args.park_after})
        except ValidationError as exc:
            sys.exit(f"autoscale_sim: --park-after {args.park_after:g}: {exc.errors()[0]['msg']}")
        except (OSError, ValueError) as exc:
            sys.exit(f"autoscale_sim: {exc}")
        ember = scaling_settings(spec)
        reports = compare(trace, model, args.trace.name, ember=ember, progress=True)
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
        NOTES.replace("MEASURED_NOTE", measured_note()),
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
