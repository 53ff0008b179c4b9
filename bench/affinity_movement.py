"""Session routing side by side: modulo hashing, plain rendezvous, and Ember's bounded-load
rendezvous at several epsilons, in one run.

    python bench/affinity_movement.py [--sessions 1000] [--requests 20000] [--seed 0]

For each strategy: the share of sessions that move when a 5th replica joins 4 (ideal
1/5) or when one of 4 leaves (ideal: only its own); the peak/mean load over uniform
sessions and over a Zipf-skewed request stream (hot sessions, the case the bound is
for; each request adds one unit of load and none completes, the worst case); the share of a session's
requests that reach its usual replica (a proxy for prefix-cache hits); and the cost of one pick. Prints a table;
with --record writes bench/results/affinity_movement.{md,json} with the machine.
"""

import argparse
import json
import os
import platform
import random
import time
import zlib
from collections import Counter, defaultdict
from pathlib import Path

from ember.gateway.affinity import ReplicaLoad, pick

STRATEGIES = {
    "modulo (crc32 % n)": None,
    "rendezvous, unbounded": 1e6,  # a cap above any total: the bound never binds
    "bounded, eps=0.05": 0.05,
    "bounded, eps=0.10": 0.10,
    "bounded, eps=0.25 (default)": 0.25,
    "bounded, eps=0.50": 0.50,
}


def route(keys, replica_ids, epsilon):
    """Place keys one by one, each adding one unit of load; the replica of each placement in order."""
    load = dict.fromkeys(replica_ids, 0)
    out = []
    for key in keys:
        if epsilon is None:
            chosen = replica_ids[zlib.crc32(key.encode()) % len(replica_ids)]
        else:
            chosen = pick(key, [ReplicaLoad(r, load[r]) for r in replica_ids], epsilon)
        load[chosen] += 1
        out.append(chosen)
    return out, load


def peak_over_mean(load):
    return max(load.values()) / (sum(load.values()) / len(load))


def measure(epsilon, sessions, stream):
    four, five, three = ["r0", "r1", "r2", "r3"], ["r0", "r1", "r2", "r3", "r4"], ["r0", "r1", "r3"]
    at4, load4 = route(sessions, four, epsilon)
    at5, _ = route(sessions, five, epsilon)
    at3, _ = route(sessions, three, epsilon)
    must = sum(r == "r2" for r in at4)
    placed, load_stream = route(stream, four, epsilon)
    by_session = defaultdict(Counter)
    for key, replica in zip(stream, placed):
        by_session[key][replica] += 1
    sticky = sum(c.most_common(1)[0][1] for c in by_session.values()) / len(stream)
    start = time.perf_counter()
    n = 2000
    replicas = [ReplicaLoad(f"r{i}", i) for i in range(8)]
    for i in range(n):
        if epsilon is None:
            zlib.crc32(sessions[i % len(sessions)].encode()) % 8
        else:
            pick(sessions[i % len(sessions)], replicas, epsilon)
    return {
        "moved_on_join": sum(a != b for a, b in zip(at4, at5)) / len(sessions),
        "moved_on_leave_over_needed": sum(a != b for a, b in zip(at4, at3)) / must,
        "peak_over_mean_sessions": peak_over_mean(load4),
        "peak_over_mean_zipf": peak_over_mean(load_stream),
        "requests_on_usual_replica": sticky,
        "pick_us_8_replicas": (time.perf_counter() - start) / n * 1e6,
    }


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="write affinity_movement.{md,json} to --out")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    sessions = [f"session-{rng.getrandbits(64):016x}" for _ in range(args.sessions)]
    popularity = [1 / (rank + 1) ** 1.1 for rank in range(len(sessions))]
    stream = rng.choices(sessions, weights=popularity, k=args.requests)

    rows = {}
    for name, epsilon in STRATEGIES.items():
        print(f"measuring {name} ...", flush=True)
        rows[name] = measure(epsilon, sessions, stream)

    header = (
        "| strategy | moved when 4→5 (ideal 0.20) | moved when 4→3 / needed (ideal 1.00) "
        "| peak/mean, sessions | peak/mean, Zipf requests | requests on usual replica | µs per pick (8 replicas) |"
    )
    lines = [header, "|" + "---|" * 7]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['moved_on_join']:.3f} | {r['moved_on_leave_over_needed']:.2f} "
            f"| {r['peak_over_mean_sessions']:.2f} | {r['peak_over_mean_zipf']:.2f} "
            f"| {r['requests_on_usual_replica']:.3f} | {r['pick_us_8_replicas']:.1f} |"
        )
    m = machine()
    note = (
        f"{args.sessions} sessions over 4 replicas; {args.requests} requests from them with Zipf(1.1) popularity; "
        f"seed {args.seed}; {m['platform']}, {m['cpu']}, {m['cpus']} CPUs, Python {m['python']}."
    )
    table = "\n".join(lines)
    print(table)
    print(note)
    if not args.record:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "affinity_movement.md").write_text(f"# Session routing: movement and balance\n\n{table}\n\n{note}\n")
    (args.out / "affinity_movement.json").write_text(
        json.dumps({"machine": m, "args": {k: str(v) for k, v in vars(args).items()}, "results": rows}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
