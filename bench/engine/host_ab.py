"""The host time of a batch-64 decode step, this checkout's engine against another's, in one run on the GPU machine.

    python bench/engine/host_ab.py --against DIR [--models 8B] [--rounds 3] [--workdir W] [--record]

The host side of a step (speed.py's b64 part: the step's wall time less its waits for the device) moves with the
machine lent: the same engine measured 0.55 ms on one H200 machine and 1.04 ms on another. A change to it is read
only against the engine before it, measured on the same machine in the same run, so this runs speed.py's b64 part
in a fresh process per engine, alternating them for --rounds rounds (this checkout first, then DIR's runtime, whose
`runtime/` replaces `ember.runtime`), and reports each engine's median and every run. Each process builds its
engine on the same random-weight model (kept in --workdir). With --record, bench/results/engine_host_ab.json.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE.parent / "results" / "engine_host_ab.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, metavar="DIR", help="a checkout whose runtime/ is the other engine")
    parser.add_argument("--models", nargs="+", default=["8B"], choices=["0.6B", "4B", "8B"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="model directories (reused when present)")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS.relative_to(HERE.parent.parent)}")
    args = parser.parse_args()
    runtime = Path(args.against) / "runtime"
    if not (runtime / "engine" / "engine.py").is_file():
        parser.error(f"--against {args.against}: no runtime/engine/engine.py there; give a checkout of this repo")
    import torch

    sys.path.insert(0, str(HERE))
    import speed  # the model builder, the engine and its b64 part

    if not torch.cuda.is_available():
        parser.error("host_ab measures decode steps on a CUDA GPU; run it on the GPU machine")
    workdir = args.workdir or tempfile.mkdtemp(prefix="ember-host-ab-")
    engines = {"this": None, "against": str(runtime)}
    result = {"machine": f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores", "against": args.against,
              "models": []}
    for shape in args.models:
        model_dir = speed.model_directory(Path(workdir), shape)   # built once, here: each process only loads it
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for round_ in range(args.rounds):
            for name, path in engines.items():
                began = time.perf_counter()
                runs[name].append(speed.b64_in_fresh_process(model_dir, path))
                r = runs[name][-1]
                speed.log(f"[{shape}] round {round_ + 1}, {name}: host {r['host_ms']:.3f} ms, GPU {r['gpu_ms']:.3f} "
                          f"ms ({r['host_ms'] / r['gpu_ms']:.1%}); launch {r['launch_ms']} "
                          f"({time.perf_counter() - began:.0f} s)")
        row = {"name": shape, "runs": runs}
        for name in engines:
            host = statistics.median(r["host_ms"] for r in runs[name])
            gpu = statistics.median(r["gpu_ms"] for r in runs[name])
            row[name] = {"host_ms": round(host, 3), "gpu_ms": round(gpu, 3), "host_share": round(host / gpu, 3)}
            speed.log(f"[{shape}] {name}: median host {host:.3f} ms against GPU {gpu:.3f} ms ({host / gpu:.1%})")
        result["models"].append(row)
    print(json.dumps(result, indent=1))
    if args.record:
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
