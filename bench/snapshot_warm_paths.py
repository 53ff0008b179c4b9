"""Warm snapshot loads (the page cache holds the file), variant by variant, in one run: loader
threads, checksum on or off, and the loader's huge-page pinned buffers against torch's pinned
memory; beside them, raw page-cache reads into each kind of buffer. Picks the loader's defaults.

    python bench/snapshot_warm_paths.py --size 8        # on the GPU machine

With --record writes bench/results/snapshot_warm_paths.{json,md}.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch
from snapshot_load import RESULTS, machine, read_file, release, write_model

from ember.snapshot import cudart, loader
from ember.snapshot.hostbuffer import HostBuffer
from ember.snapshot.store import FileSource, LocalStore, staging_path
from ember.snapshot.writer import write_safetensors

KEEP: list = []  # buffers of the raw reads stay mapped until the run ends


def raw_buffers() -> dict:
    lib = cudart.runtime()
    return {
        "pageable, 4 KiB pages": lambda n: torch.zeros(n, dtype=torch.uint8),
        "torch pinned": lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True),
        "huge pages": lambda n: KEEP.append(HostBuffer(n)) or KEEP[-1].tensor,
        "huge pages, pinned": lambda n: KEEP.append(HostBuffer(n, lib)) or KEEP[-1].tensor,
    }


def torch_pinned(nbytes: int, pin: bool, lib) -> tuple[torch.Tensor, object]:
    """The loader's buffers before hostbuffer.py: torch's pinned allocator, 4 KiB pages."""
    return loader.aligned_buffer(nbytes, pin), lambda: None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=float, default=8.0, help="model size in GB")
    p.add_argument("--threads", default="8,12,16")
    p.add_argument("--verify", default="1,0", help="1: check each chunk's xxh3; 0: no check (the bound)")
    p.add_argument(
        "--buffers", default="huge,torch", help="huge: the loader's huge-page buffers; torch: torch's pinned"
    )
    p.add_argument("--dir", default="/var/tmp/ember-warm")
    p.add_argument("--record", action="store_true", help="write snapshot_warm_paths.{md,json} to --out")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    os.environ["EMBER_HOME"] = str(root / "home")
    folder = root / "model"
    write_model(folder, args.size, "cuda", tiny=False)
    staged = staging_path()
    write_safetensors(folder, staged)
    store = LocalStore()
    ref = store.put(staged, "model")
    shutil.rmtree(folder)
    snap = store.objects / f"{ref.id}.ember"
    header = store.open(ref.id).header
    targets = {e.name: torch.empty(e.shape, dtype=torch.bfloat16, device="cuda") for e in header.tensors}
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    results = {"machine": machine(root), "bytes": ref.size, "page_cache_read_gbps": {}, "loads": [],
               "transparent_hugepage": thp.read_text().strip() if thp.exists() else "absent"}
    read_file(snap, direct=False)  # warm
    for name, make in raw_buffers().items():
        results["page_cache_read_gbps"][name] = read_file(snap, direct=False, threads=16, buffer=make)
    print(results["transparent_hugepage"], results["page_cache_read_gbps"], flush=True)
    for holder in KEEP:
        holder.close()
    chosen = loader.host_buffer
    configs = [
        (b, v, t) for b in args.buffers.split(",") for v in args.verify.split(",") for t in args.threads.split(",")
    ]
    for buffers, verify, threads in [(b, v == "1", int(t)) for b, v, t in configs]:
        loader.host_buffer = chosen if buffers == "huge" else torch_pinned
        runs = []
        for _ in range(3):
            release("cuda")
            source = FileSource(snap, ref.id)
            _, report = loader.load(source, targets, threads=threads, verify=verify)
            source.close()
            runs.append(report)
        row = {"threads": threads, "verify": verify, "buffers": buffers,
               "gbps": statistics.median(r.gbps for r in runs), "phases": runs[-1].phases}
        results["loads"].append(row)
        print(f"buffers={buffers} verify={verify} threads={threads:2d}: {row['gbps']:.1f} GB/s  {runs[-1]}", flush=True)
    loader.host_buffer = chosen
    store.rm(ref.id)
    out = Path(args.out)
    lines = ["# Warm snapshot loads by variant", "", f"machine: {json.dumps(results['machine'])}", "",
             f"{ref.size / 1e9:.1f} GB bf16 snapshot in the page cache. Transparent huge pages: "
             f"{results['transparent_hugepage']}.", "",
             "Raw page-cache reads, 16 threads, 16 MiB blocks: " +
             ", ".join(f"into {k} {g:.1f} GB/s" for k, g in results["page_cache_read_gbps"].items()), "",
             "| pinned buffers | xxh3 checked | threads | GB/s (median of 3) |", "|---|---|---|---|"]
    names = {"huge": "huge pages (hostbuffer.py)", "torch": "torch's pinned memory"}
    lines += [f"| {names[r['buffers']]} | {'yes' if r['verify'] else 'no'} | {r['threads']} | {r['gbps']:.1f} |"
              for r in results["loads"]]
    print("\n".join(lines))
    if args.record:
        out.mkdir(parents=True, exist_ok=True)
        (out / "snapshot_warm_paths.json").write_text(json.dumps(results, indent=2))
        (out / "snapshot_warm_paths.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
