"""An engine's T1 rung on one GPU: park, idle, wake, and the first token after it, beside the floor of a wake (the
weights' bytes over a pinned host-to-device copy measured in the same run).

    python bench/engine/park_wake.py                     # the 8B shape; prints the table
    python bench/engine/park_wake.py --models 4B 8B --record   # also writes bench/results/park_wake.json

The engine runs with EngineConfig's defaults (what a user gets: the KV cache takes most of the GPU, and a park
releases it too). Each cycle: one greedy token hot, a park, `--idle` seconds, a wake (the arena's report: seconds
until every region is mapped, then waiting for the weights' copies), one greedy token. Two ways of waking, in
alternating cycles of one engine: the weights mapped in pieces of gpu_memory.WAKE_PIECE, each piece's copy queued
as it maps (the default), and mapped whole before their copy starts (as before session 36). A wake's first
token is what bench/coldstart.py's T1 row measures through `ember serve`, less the HTTP path.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed  # noqa: E402

RESULTS = speed.RESULTS
WAYS = {"pieces": None, "whole": 1 << 62}   # gpu_memory.WAKE_PIECE for each way (None: the default)


def h2d_bandwidth(nbytes: int) -> float:
    """Bytes per second of a pinned host-to-device copy of `nbytes`, best of 3."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    del host, device
    torch.cuda.empty_cache()
    return nbytes / best


def cycles(eng, count: int, idle: float) -> dict[str, list[dict]]:
    """`count` park-idle-wake cycles for each way, alternating."""
    from ember.runtime.engine import gpu_memory
    from ember.runtime.engine.sampling import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = speed.random_prompts(1, 32, 32, seed=0)[0]
    eng.generate([prompt], one)   # graphs and kernels warm before the first park
    default = gpu_memory.WAKE_PIECE
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    try:
        for _ in range(count):
            for way, piece in WAYS.items():
                gpu_memory.WAKE_PIECE = default if piece is None else piece
                began = time.perf_counter()
                eng.generate([prompt], one)
                hot = time.perf_counter() - began
                park = eng.park()
                time.sleep(idle)
                began = time.perf_counter()
                wake = eng.wake()
                woke = time.perf_counter()
                eng.generate([prompt], one)
                token = time.perf_counter() - woke
                runs[way].append({"wake_s": round(woke - began, 4), "map_s": round(wake.map_seconds, 4),
                                  "copy_wait_s": round(wake.copy_seconds, 4), "copied_bytes": wake.copied_bytes,
                                  "mapped_bytes": wake.mapped_bytes, "park_s": round(park.seconds, 4),
                                  "hot_token_s": round(hot, 4), "token_after_wake_s": round(token, 4)})
                speed.log(f"  {way}: {runs[way][-1]}")
    finally:
        gpu_memory.WAKE_PIECE = default
    return runs


def measure(shape: str, args, workdir: Path) -> dict:
    from ember.runtime.engine.config import EngineConfig
    from ember.runtime.engine.engine import LLMEngine

    model_dir = speed.model_directory(workdir, shape)
    eng = LLMEngine(EngineConfig(model=str(model_dir)))
    regions = {r.name: r.size for r in eng.runner.arena.regions}
    kept = sum(r.size for r in eng.runner.arena.regions if r.keep)
    bandwidth = h2d_bandwidth(kept)
    speed.log(f"[{shape}] regions {regions}; pinned H2D {bandwidth / 1e9:.1f} GB/s")
    runs = cycles(eng, args.cycles, args.idle)
    eng.close()
    row = {"name": f"Qwen3-{shape} shape (random weights)", "weights_region_bytes": kept,
           "kv_region_bytes": sum(size for name, size in regions.items() if name != "weights"),
           "h2d_gb_s": round(bandwidth / 1e9, 2), "floor_s": round(kept / bandwidth, 4), "idle_s": args.idle,
           "cycles": runs}
    for way, rows in runs.items():
        row[f"{way}_wake_s"] = round(statistics.median(r["wake_s"] for r in rows), 4)
        row[f"{way}_wake_and_token_s"] = round(statistics.median(r["wake_s"] + r["token_after_wake_s"]
                                                                 for r in rows), 4)
    row["hot_token_s"] = round(statistics.median(r["hot_token_s"] for rows in runs.values() for r in rows), 4)
    return row


def table(result: dict) -> str:
    lines = ["| model | weights GiB | KV GiB | floor s (pinned H2D GB/s) | wake s: pieces / whole | wake + first "
             "token s: pieces / whole | hot token s |", "|---" * 7 + "|"]
    for m in result["models"]:
        lines.append(f"| {m['name']} | {m['weights_region_bytes'] / 2**30:.2f} | {m['kv_region_bytes'] / 2**30:.2f} "
                     f"| {m['floor_s']} ({m['h2d_gb_s']}) | {m['pieces_wake_s']} / {m['whole_wake_s']} | "
                     f"{m['pieces_wake_and_token_s']} / {m['whole_wake_and_token_s']} | {m['hot_token_s']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["8B"], choices=list(speed.SHAPES))
    parser.add_argument("--cycles", type=int, default=3, help="park-wake cycles of each way (median reported)")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds parked before each wake")
    parser.add_argument("--workdir", help="where models are written and kept (default: a temp dir, removed)")
    parser.add_argument("--record", action="store_true", help="write park_wake.json in --results")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.cycles < 1 or args.idle < 0:
        parser.error("--cycles must be at least 1 and --idle at least 0")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: parking releases device memory")
    result = {"machine": f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores, {platform.machine()}; "
                         f"torch {torch.__version__}", "models": []}
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(args.workdir) if args.workdir else Path(scratch)
        for shape in args.models:
            result["models"].append(measure(shape, args, workdir))
    print(table(result))
    if args.record:
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "park_wake.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
