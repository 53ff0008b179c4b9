"""Where a restored engine's start and its first request go, in one process, phase by phase.

    python bench/engine/start_profile.py [--shape 4b|8b|tiny] [--dir DIR] [--seed-kernels DIR] [--no-warm]

A T2 start through `ember serve` (bench/coldstart.py) reports its phases in X-Ember-Start-Breakdown, but the time
between the replica's ready line and the first token is one number there. This takes the engine alone:
  1. a child process boots the model from safetensors with snapshots on (the snapshot and the kernels are kept);
  2. a fresh child imports what a fork server would have imported (timed, not counted), then restores the engine
     from the snapshot (start phases), and runs a first request and then a second one, each to its first token,
     the first under torch.profiler and cProfile: which host calls and kernels the first request pays that the
     second does not (kernel and module loading, handle creation, allocator growth, template compilation);
  3. on a GPU, what stays on the GPU outside the engine's arena after the requests and once parked.
--no-warm restores without the kernel warm-up (EngineConfig.warm_kernels=False), to compare.
It prints the tables; nothing is written to the repository.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

RESTORE = r"""
import cProfile, io, json, logging, os, pstats, sys, time
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
began = time.perf_counter()
import torch, transformers  # what the fork server holds before a replica forks
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.sampling import SamplingParams
from ember.runtime.forkserver import preload_gpu
from ember.runtime.supervisor import gpu_architectures
if gpu_architectures():
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = gpu_architectures()
preloaded = preload_gpu()
print(f"imports (a fork server's, not a start's): {time.perf_counter() - began:.2f} s; preloaded {preloaded}",
      flush=True)
cuda = torch.cuda.is_available()
began = time.perf_counter()
if cuda:
    torch.cuda.init()  # as the worker does before its hooks (cuda_init_ms)
print(f"CUDA init: {time.perf_counter() - began:.3f} s", flush=True)
began = time.perf_counter()
starting = cProfile.Profile()
starting.enable()
engine = LLMEngine(EngineConfig(model=sys.argv[1], snapshot_store="local", warm_kernels=sys.argv[3] == "1"))
starting.disable()
start = time.perf_counter() - began
print(f"engine start: {start:.3f} s; weights {engine.runner.weights_start.source}; image {engine.runner.gpu_image} "
      f"({engine.runner.gpu_image_reason}); phases "
      + json.dumps({k: round(v, 3) for k, v in engine.runner.start_phases.items()}), flush=True)
text = io.StringIO()
pstats.Stats(starting, stream=text).sort_stats("cumulative").print_stats(30)
print(text.getvalue())
prompt = list(range(5, 5 + int(sys.argv[2])))

def first_token(request_id):
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    began = time.perf_counter()
    while True:
        if any(out.new_token_ids for out in engine.step()):
            seconds = time.perf_counter() - began
            break
    while engine.has_unfinished_requests():
        engine.step()
    return seconds

activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
host = cProfile.Profile()
with torch.profiler.profile(activities=activities) as profiler:
    host.enable()
    first = first_token("first")
    host.disable()
second = first_token("second")
print(f"first request to its first token: {first:.3f} s; second: {second:.3f} s (profilers on for the first)")
print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
text = io.StringIO()
pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(35)
print(text.getvalue())
if cuda:  # what stays on the GPU outside the engine's arena, which a park leaves: torch's allocator and the rest
    import subprocess

    def held() -> str:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout
        mine = [line for line in apps.splitlines() if line.split(",")[0].strip() == str(os.getpid())]
        return (f"torch allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, reserved "
                f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB; nvidia-smi {mine}")

    print(f"after the requests: {held()}")
    engine.park()
    print(f"parked: {held()}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4b", help="4b, 8b or tiny (bench/coldstart.py's shapes)")
    parser.add_argument("--dir", default="/tmp/ember-start-profile", help="model and EMBER_HOME go here")
    parser.add_argument("--seed-kernels", help="a FLASHINFER_WORKSPACE_BASE holding modules built before")
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--no-warm", action="store_true", help="restore with EngineConfig(warm_kernels=False)")
    args = parser.parse_args()
    from coldstart import build_model, seed_kernels

    folder = Path(args.dir)
    model = build_model(args.shape, folder / "models")
    home = folder / f"home-{args.shape}"
    if args.seed_kernels:
        print(f"seeded {seed_kernels(Path(args.seed_kernels), home)} kernel modules", flush=True)
    env = os.environ | {"EMBER_HOME": str(home), "PYTHONUNBUFFERED": "1",
                        "FLASHINFER_WORKSPACE_BASE": str(folder / "fi-workspace")}
    boot = ("import sys, json; from ember.runtime.engine.config import EngineConfig; "
            "from ember.runtime.engine.engine import LLMEngine; "
            "e = LLMEngine(EngineConfig(model=sys.argv[1], snapshot_store='local')); "
            "print('boot:', e.runner.weights_start.source, json.dumps({k: round(v, 3) for k, v in "
            "e.runner.start_phases.items()}))")
    subprocess.run([sys.executable, "-c", boot, str(model)], env=env, check=True, cwd=ROOT)
    subprocess.run([sys.executable, "-c", RESTORE, str(model), str(args.prompt_tokens), "0" if args.no_warm else "1"],
                   env=env, check=True, cwd=ROOT)
    print(json.dumps({"shape": args.shape, "model": str(model)}))


if __name__ == "__main__":
    main()
