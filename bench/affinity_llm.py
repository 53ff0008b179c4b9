"""Prefix-cache hits with session affinity against round robin, through the gateway to the LLM engine.

    python bench/affinity_llm.py [--replicas 3] [--conversations 12] [--turns 5] [--parallel 4] [--max-tokens 8]

Starts `ember serve bench/affinity_llm_app.py` (the chat example's engine, a tiny random-weight Qwen3, with
--replicas warm replicas) once with `--routing affinity` and once with `--routing round-robin`, runs the same
multi-turn workload through each (every turn resends the growing history, with X-Session-ID), then reads
`ember:prefix_cache_hits` / `ember:prefix_cache_queries` from each replica's /metrics. Prints a table; with
--record writes bench/results/affinity_llm.{md,json} with the machine.
"""

import argparse
import concurrent.futures
import json
import os
import platform
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "bench" / "affinity_llm_app.py"
MODES = ("affinity", "round-robin")
WORDS = "harbor lantern copper meadow violet engine summit river orchard signal canvas pebble".split()


def _start(home: Path, mode: str, replicas: int) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "serve", str(APP), "--port", "0", "--routing", mode],
        env=os.environ | {"EMBER_HOME": str(home), "EMBER_BENCH_REPLICAS": str(replicas)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=ROOT)
    for line in process.stdout:
        if line.startswith("Ember is serving"):
            return process, line.split(" at ")[-1].strip()
    raise RuntimeError("ember serve exited before printing its URL")


def _stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _hot_replicas(admin: httpx.Client, n: int, timeout: float = 300) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            replicas = admin.get("/admin/status").json()["apps"]["chat"]["functions"]["Chat"]["replicas"]
        except (httpx.TransportError, KeyError, ValueError):
            replicas = []
        hot = [r for r in replicas if r["state"] == "hot"]
        if len(hot) >= n:
            return hot
        time.sleep(0.5)
    raise RuntimeError(f"{n} replicas were not hot within {timeout:.0f} s")


def _cache_counts(replicas: list[dict]) -> dict[str, tuple[float, float]]:
    counts = {}
    for replica in replicas:
        text = httpx.get(f"http://{replica['address']}/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            for name in ("prefix_cache_hits", "prefix_cache_queries"):
                if line.startswith(f"ember:{name}"):
                    values[name] = float(line.rsplit(" ", 1)[1])
        counts[replica["id"]] = (values.get("prefix_cache_hits", 0.0), values.get("prefix_cache_queries", 0.0))
    return counts


def _conversation(http: httpx.Client, c: int, turns: int, max_tokens: int) -> list[float]:
    """One chat: each turn resends the whole history plus a new user message."""
    messages = [{"role": "system", "content": f"Conversation {c}. You are assistant number {c}; answer briefly. "
                                              + " ".join(WORDS[(c + i) % len(WORDS)] for i in range(24))}]
    latencies = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Turn {t}: tell me about the {WORDS[(c * 7 + t) % len(WORDS)]}."})
        began = time.monotonic()
        reply = http.post(
            "/chat/v1/chat/completions",
            headers={"X-Session-ID": f"conversation-{c}"},
            json={"model": "tiny-qwen3", "messages": messages, "max_tokens": max_tokens, "seed": c * 100 + t},
        )
        latencies.append(time.monotonic() - began)
        reply.raise_for_status()
        messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
    return latencies


def measure(
    mode: str, home: Path, replicas: int, conversations: int, turns: int, parallel: int, max_tokens: int
) -> dict:
    """One gateway in `mode`, the workload through it, and the engines' prefix-cache counts."""
    process, url = _start(home, mode, replicas)
    try:
        from ember.gateway.keys import KeyStore

        verify = ssl.create_default_context(cafile=str(home / "tls" / "ca.pem"))
        admin_key = (home / "cli.key").read_text().strip()
        user_key = KeyStore(home / "ember.db").create(f"bench-{mode}")[1]
        with httpx.Client(
            base_url=url, verify=verify, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60
        ) as admin:
            hot = _hot_replicas(admin, replicas)
        before = _cache_counts(hot)
        began = time.monotonic()
        with (
            httpx.Client(
                base_url=url, verify=verify, headers={"Authorization": f"Bearer {user_key}"}, timeout=300
            ) as http,
            concurrent.futures.ThreadPoolExecutor(parallel) as pool,
        ):
            latencies = sum(pool.map(lambda c: _conversation(http, c, turns, max_tokens), range(conversations)), [])
        wall = time.monotonic() - began
        after = _cache_counts(hot)
    finally:
        _stop(process)
    hits = sum(after[r][0] - before[r][0] for r in after)
    queries = sum(after[r][1] - before[r][1] for r in after)
    return {
        "mode": mode,
        "requests": len(latencies),
        "prompt_tokens": int(queries),
        "cached_tokens": int(hits),
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "wall_s": round(wall, 2),
        "mean_latency_ms": round(1000 * sum(latencies) / len(latencies), 1),
        "per_replica_hit_rate": {
            r: round((after[r][0] - before[r][0]) / max(after[r][1] - before[r][1], 1), 4) for r in after
        },
    }


def compare(home: Path, replicas: int, conversations: int, turns: int, parallel: int, max_tokens: int) -> list[dict]:
    rows = []
    for mode in MODES:
        print(
            f"running {conversations} conversations x {turns} turns over {replicas} replicas, routing {mode} ...",
            flush=True,
        )
        rows.append(measure(mode, home, replicas, conversations, turns, parallel, max_tokens))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--parallel", type=int, default=4, help="conversations in flight at once")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--record", action="store_true",
                        help="write the results to --out (.json and .md); without it they are only printed")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "affinity_llm"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ember-bench-") as tmp:
        rows = compare(Path(tmp), args.replicas, args.conversations, args.turns, args.parallel, args.max_tokens)
    import torch

    machine = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
               "torch": torch.__version__, "device": "cuda" if torch.cuda.is_available() else "cpu",
               "model": "tiny-qwen3 (random weights, examples' tiny config)"}
    result = {"machine": machine, "workload": vars(args) | {"out": None, "record": None}, "results": rows,
              "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    header = "| routing | requests | prompt tokens | cached tokens | prefix hit rate | mean latency ms | wall s |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['requests']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['hit_rate']:.1%} | "
              f"{r['mean_latency_ms']} | {r['wall_s']} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if not args.record:
        return
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out + ".md").write_text(
        "# Prefix-cache hits: session affinity vs round robin\n\n"
        f"`python bench/affinity_llm.py --replicas {args.replicas} --conversations {args.conversations} "
        f"--turns {args.turns} "
        f"--parallel {args.parallel} --max-tokens {args.max_tokens}`, measured {result['measured']}.\n\n"
        "Each conversation resends its growing history every turn with `X-Session-ID`; "
        "hit rate = prompt tokens found in "
        "the engines' prefix caches / prompt tokens looked up, summed over replicas (`ember:prefix_cache_*`).\n\n"
        f"{table}\n\nMachine: {json.dumps(machine)}\n"
    )


if __name__ == "__main__":
    main()
