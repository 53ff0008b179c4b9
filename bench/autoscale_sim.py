"""Ember's autoscaling policy against always-on, KPA-like and Ray Serve default
policies on five seeded traces, in one run of the trace simulator.

    python bench/autoscale_sim.py [--duration 1800] [--seed 0]

Prints a table and writes bench/results/autoscale_sim.{md,json} with the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

from ember.gateway.autoscaler.baselines import (
    KPA_SETTINGS,
    AlwaysOnMemo,
    KpaMemo,
    RayMemo,
    always_on_decide,
    kpa_decide,
    ray_decide,
)
from ember.gateway.autoscaler.policy import PolicyMemo, ScalingSettings, decide
from ember.gateway.autoscaler.simulator import Policy, ReplicaModel, Report, simulate
from ember.gateway.autoscaler.trace import TRACES, Request, generate

MODEL = ReplicaModel()
MAX_REPLICAS = 40
# The function under test: an LLM replica that batches up to 16 requests and is sized at 10.
FUNCTION = dict(min_replicas=0, max_replicas=MAX_REPLICAS, target_concurrency=10.0, max_concurrency=MODEL.max_concurrency)
# Parking costs no GPU and waking costs 0.3 s, so Ember can give capacity back after 5 s
# of disuse and hold panic for 20 s instead of KPA's 60 s.
EMBER = ScalingSettings(**FUNCTION, park_after=5.0, scaledown_window=600.0, stable_window=20.0,
                        start_latency=MODEL.node_warm, wake_latency=MODEL.wake)
KPA = ScalingSettings(**FUNCTION, **KPA_SETTINGS)
RAY = ScalingSettings(**FUNCTION)
SLO_TTFT = 2.0
TICK = 0.5  # the gateway calls every policy twice a second
BURSTY = ("on_off", "spike", "sessions")


def peak_replicas(trace: list[Request], target: float, window: float = 6.0) -> int:
    """Replicas an always-on fleet needs: the peak offered concurrency over `window`, at `target` each."""
    busy = [0.0] * (int(max(r.t + MODEL.service(r) for r in trace)) + 2)
    for r in trace:  # spread each request's service time over the seconds it covers
        t, end = r.t, r.t + MODEL.service(r)
        while t < end:
            step = min(end, math.floor(t) + 1) - t
            busy[int(t)] += step
            t += step
    w = int(window)
    peak = max(sum(busy[i:i + w]) / w for i in range(max(1, len(busy) - w)))
    return min(MAX_REPLICAS, max(1, math.ceil(peak / target)))


def policies(trace: list[Request]) -> list[Policy]:
    n = peak_replicas(trace, EMBER.target_concurrency)
    return [
        Policy("ember", partial(decide, EMBER), PolicyMemo(), EMBER.min_replicas, EMBER.max_replicas),
        Policy("kpa-like", partial(kpa_decide, KPA), KpaMemo(), KPA.min_replicas, KPA.max_replicas),
        Policy("ray-default", partial(ray_decide, RAY), RayMemo(), RAY.min_replicas, RAY.max_replicas),
        Policy(f"always-on({n})", partial(always_on_decide, n), AlwaysOnMemo(), 0, MAX_REPLICAS, initial_hot=n),
    ]


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }


def table(reports: list[Report]) -> str:
    head = ("trace", "policy", "GPU-s", "vs KPA", "cold starts P/W/C/B", "wait p50", "wait p99",
            "TTFT p50", "TTFT p99", f"SLO (TTFT<={SLO_TTFT:g}s)", "503s", "parked host GB-s")
    rows = []
    kpa = {r.trace: r.gpu_seconds for r in reports if r.policy == "kpa-like"}
    for r in reports:
        c = r.cold_starts
        rows.append((r.trace, r.policy, f"{r.gpu_seconds:,.0f}", f"{r.gpu_seconds / kpa[r.trace] - 1:+.0%}",
                     f"{c['parked']}/{c['node-warm']}/{c['node-cold']}/{c['full-boot']}",
                     f"{r.queue_wait_p50:.2f}", f"{r.queue_wait_p99:.2f}", f"{r.ttft_p50:.2f}", f"{r.ttft_p99:.2f}",
                     f"{r.slo_attainment:.2%}", str(r.rejected), f"{r.parked_host_gb_seconds:,.0f}"))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def goal(reports: list[Report]) -> list[str]:
    """The issue's goal on the bursty traces, checked per trace."""
    out = []
    for name in BURSTY:
        e = next(r for r in reports if r.trace == name and r.policy == "ember")
        k = next(r for r in reports if r.trace == name and r.policy == "kpa-like")
        saved = 1 - e.gpu_seconds / k.gpu_seconds
        ok = saved >= 0.40 and e.ttft_p99 <= k.ttft_p99 and e.slo_attainment >= 0.99
        out.append(f"- {name}: {saved:.0%} fewer GPU-seconds than KPA-like, p99 TTFT {e.ttft_p99:.2f}s vs "
                   f"{k.ttft_p99:.2f}s, SLO {e.slo_attainment:.2%}: {'met' if ok else 'NOT met'}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of trace (default 1800)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    began = time.perf_counter()
    reports = []
    for i, name in enumerate(TRACES):
        trace = generate(name, args.duration, args.seed + i)
        for policy in policies(trace):
            reports.append(simulate(trace, policy, MODEL, tick=TICK, slo_ttft=SLO_TTFT, until=args.duration, trace_name=name))
            print(f"  {name:9} {policy.name:14} done ({time.perf_counter() - began:.1f}s)", flush=True)
    elapsed = time.perf_counter() - began

    md = "\n".join([
        "# Autoscaling policies on simulated traces",
        "",
        f"`python bench/autoscale_sim.py --duration {args.duration:g} --seed {args.seed}`; "
        f"simulated in {elapsed:.1f} s on {machine()['platform']} ({machine()['cpus']} CPUs).",
        "",
        f"Replica model: {asdict(MODEL)}.",
        f"Function: {FUNCTION}; Ember adds park_after={EMBER.park_after:g}s, stable_window={EMBER.stable_window:g}s, "
        f"scaledown_window={EMBER.scaledown_window:g}s. KPA-like: {KPA_SETTINGS} (scaledown_window is its "
        "scale-to-zero grace). Ray Serve default: target_ongoing_requests=2, look-back 30 s, upscale delay 30 s, "
        "downscale delay 600 s, min_replicas=0. Always-on: the trace's peak 6 s concurrency / target, hot from t=0.",
        f"SLO: TTFT <= {SLO_TTFT:g} s, over all requests (503s count as misses). Cold starts: "
        "P parked wake / W node-warm / C node-cold / B full boot.",
        "",
        table(reports),
        "",
        "Goal on the bursty traces (>= 40% fewer GPU-seconds than KPA-like, p99 TTFT no worse, SLO >= 99%):",
        *goal(reports),
        "",
    ])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "autoscale_sim.md").write_text(md)
    (args.out / "autoscale_sim.json").write_text(json.dumps({
        "machine": machine(), "seconds": elapsed, "duration": args.duration, "seed": args.seed,
        "model": asdict(MODEL), "slo_ttft": SLO_TTFT, "reports": [asdict(r) for r in reports],
    }, indent=1))
    print(table(reports))
    print("\n".join(goal(reports)))


if __name__ == "__main__":
    main()
