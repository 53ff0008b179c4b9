"""Which prefill steps should replay piecewise graphs: one step's wall time, eager against graphs, per step size.

    python bench/engine/prefill_steps.py --models 4B 8B [--workdir DIR] [--record]

On random-weight models of Qwen3 shapes (bench/engine/speed.py builds them; a model already in --workdir is
reused), three engines one after another in one process, each with overlap off so that `step()` returns with its
step done:
  - eager: prefill_graphs=False, every step that prefills launched from Python;
  - default: the sizes runtime/engine/prefill_graphs.py picks for the model (what a user gets);
  - every size: a graph for every size of prefill_graphs.SIZES within the step budget, however large.
For each, the wall time of one step that prefills n prompts of 256 tokens (n = 1, 2, 3, 4, 6, 8: 256 to 2,048
tokens), and of one that prefills n beside 32 sequences decoding (a 544-token step pads to 1,024), the median of
--reps steps after one left out, and the step's device seconds (the engine's CUDA events, which count the device
idling between eager launches). Where a size's graph is slower than the eager step across the band it serves
(above half its size), the size costs more in padding than it saves in launches: the default's largest size
should sit just below that.

Eager steps are bound by the host, and the device machine's CPU speed moves by up to ~2x from one engine to the
next (session 39: a fixed pure-Python loop took 104 to 252 ms in one process). Each engine's rows therefore carry
that loop's time before and after them (`host_loop_ms`), and the table prints it: compare eager rows across modes
only where their loops agree.

With --record, writes bench/results/prefill_steps.json (the machine, the command, each model's rows).
"""
import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import speed  # noqa: E402  (bench/engine/speed.py: the model shapes and their builder)

RESULTS = Path(__file__).resolve().parents[1] / "results"
PROMPT = 256
ALONE = (1, 2, 3, 4, 6, 8)
BESIDE = (1, 2, 3, 4)
DECODING = 32
MODES = ("eager", "default", "every size")


def log(*args) -> None:
    print(*args, flush=True)


def engine(model_dir: Path, mode: str):
    """An engine of `mode` (MODES), graphs captured at start, overlap off."""
    from ember.runtime.engine import prefill_graphs
    from ember.runtime.engine.config import EngineConfig
    from ember.runtime.engine.engine import LLMEngine

    default = prefill_graphs.HOST_BOUND_FLOPS
    prefill_graphs.HOST_BOUND_FLOPS = float("inf") if mode == "every size" else default
    try:
        return LLMEngine(EngineConfig(model=str(model_dir), max_model_len=4096, graph_capture="start",
                                      prefill_graphs=mode != "eager", overlap=False))
    finally:
        prefill_graphs.HOST_BOUND_FLOPS = default


def one_step_ms(eng, prompts: int, reps: int, rng: random.Random) -> dict:
    """Median wall and device milliseconds of a step that prefills `prompts` fresh prompts of PROMPT tokens."""
    from ember.runtime.engine.sampling import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    walls, device = [], []
    for _ in range(reps + 1):
        for _ in range(prompts):
            eng.add_request(f"p{time.monotonic_ns()}", [rng.randrange(100, 30000) for _ in range(PROMPT)], one)
        before = sum(eng.stats.step_device_seconds.values())
        torch.cuda.synchronize()
        began = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - began)
        device.append(sum(eng.stats.step_device_seconds.values()) - before)
    return {"wall_ms": round(statistics.median(walls[1:]) * 1e3, 2),
            "device_ms": round(statistics.median(device[1:]) * 1e3, 2)}


def measure(model_dir: Path, mode: str, reps: int) -> dict:
    rng = random.Random(0)
    eng = engine(model_dir, mode)
    graphs = eng.runner.prefill_graphs
    row = {"sizes": list(graphs.sizes) if graphs is not None else [], "host_loop_ms": [speed.host_loop_ms()]}
    for n in ALONE:
        row[f"{n * PROMPT}"] = one_step_ms(eng, n, reps, rng)
    from ember.runtime.engine.sampling import SamplingParams
    long = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    for i in range(DECODING):
        eng.add_request(f"d{i}", [rng.randrange(100, 30000) for _ in range(300)], long)
    for _ in range(4):
        eng.step()
    for n in BESIDE:
        row[f"{DECODING}+{n * PROMPT}"] = one_step_ms(eng, n, reps, rng)
    row["host_loop_ms"].append(speed.host_loop_ms())
    for i in range(DECODING):
        eng.abort_request(f"d{i}")
    while eng.has_unfinished_requests():
        eng.step()
    eng.close()
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return row


def table(models: list[dict]) -> list[str]:
    """One line a model and step: each mode's wall ms, and the size the step padded to where it had a graph."""
    lines = []
    for m in models:
        lines.append(f"{m['name']}: default sizes {m['rows']['default']['sizes']}")
        loops = [f"{mode} {' -> '.join(str(t) for t in m['rows'][mode]['host_loop_ms'])}"
                 for mode in MODES if "host_loop_ms" in m["rows"][mode]]
        if loops:   # records before session 39 have none
            lines.append("  host loop ms (before -> after each engine's steps): " + ", ".join(loops))
        for step in [k for k in m["rows"]["eager"] if k not in ("sizes", "host_loop_ms")]:
            tokens = sum(int(part) for part in step.split("+"))
            cells = []
            for mode in MODES:
                sizes = [s for s in m["rows"][mode]["sizes"] if s >= tokens]
                padded = f" (graph {sizes[0]})" if sizes else ""
                cells.append(f"{mode} {m['rows'][mode][step]['wall_ms']:6.2f}{padded}")
            lines.append(f"  {step:>9} tokens: " + ", ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["4B", "8B"], choices=list(speed.SHAPES))
    parser.add_argument("--workdir", default="/tmp/ember-models", help="model directories (reused when present)")
    parser.add_argument("--reps", type=int, default=8, help="steps a cell (after one left out)")
    parser.add_argument("--record", action="store_true", help="write bench/results/prefill_steps.json")
    parser.add_argument("--results", default=str(RESULTS), help="where --record writes")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps {args.reps}: want at least 1 step a cell")
    if not torch.cuda.is_available():
        sys.exit("prefill_steps: needs a CUDA GPU (it times graphs against eager launches on the device)")
    models = []
    for shape in args.models:
        model_dir = speed.model_directory(Path(args.workdir), shape)
        rows = {}
        for mode in MODES:
            log(f"{shape}: {mode} ...")
            rows[mode] = measure(model_dir, mode, args.reps)
        models.append({"name": shape, "rows": rows})
        log("\n".join(table(models[-1:])))
    if args.record:
        out = Path(args.results)
        out.mkdir(parents=True, exist_ok=True)
        machine = f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores, {platform.machine()}"
        command = "python3 bench/engine/prefill_steps.py " + " ".join(sys.argv[1:])
        (out / "prefill_steps.json").write_text(json.dumps({"machine": machine, "command": command,
                                                            "date": time.strftime("%Y-%m-%d"), "models": models},
                                                           indent=1) + "\n")


if __name__ == "__main__":
    main()
