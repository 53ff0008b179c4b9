"""Warm snapshot loads (the page cache holds the file), path by path, in one run: how many loader
threads, and what share of them copy straight from the pinned page cache instead of through
pinned buffers. Picks the loader's defaults; raw page-cache reads are measured beside them.

    python bench/snapshot_warm_paths.py --size 8        # on the GPU machine

Writes bench/results/snapshot_warm_paths.{json,md}.
"""
import argparse
import ctypes
import mmap
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ember.snapshot import cudart, loader
from ember.snapshot.loader import load
from ember.snapshot.store import FileSource, LocalStore, staging_path
from ember.snapshot.writer import write_safetensors
from snapshot_load import RESULTS, machine, read_file, release, write_model


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
HUGE = 2 << 20
MADV_HUGEPAGE = 14


def hugepage_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """Host memory backed by transparent huge pages (pinned in place when `pin`): the kernel's copy out of
    the page cache then writes through one TLB entry per 2 MiB instead of per 4 KiB. Never freed (bench only)."""
    size = -(-nbytes // HUGE) * HUGE
    raw = _libc.mmap(None, size + HUGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    address = raw + (-raw % HUGE)
    _libc.madvise(address, size, MADV_HUGEPAGE)
    ctypes.memset(address, 0, size)
    if pin:
        cudart.register(cudart.runtime(), address, size)
    return torch.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=torch.uint8)[:nbytes]


def read_into(path: Path, threads: int, buffer) -> float:
    """GB/s of reading the whole (cached) file with `threads` threads in 16 MiB blocks into buffer(16 MiB)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    block = 16 << 20
    blocks = list(range(0, size - size % 4096, block))

    buffers = [memoryview(buffer(block).numpy()) for _ in range(threads)]

    def worker(k: int) -> None:
        for off in blocks[k::threads]:
            os.preadv(fd, [buffers[k][:min(block, size - size % 4096 - off)]], off)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    seconds = time.perf_counter() - t
    os.close(fd)
    return size / seconds / 1e9


def gpu_weighted_sums(targets: dict[str, torch.Tensor], chunk_size: int) -> float:
    """Seconds to compute, on the GPU, a position-weighted 64-bit sum of every chunk's words over the loaded
    tensors (the cost of checking chunks there instead of on the CPU), with plain torch ops."""
    words = chunk_size // 8
    torch.cuda.synchronize()
    t = time.perf_counter()
    sums = torch.zeros(1 << 16, dtype=torch.int64, device="cuda")
    offset = 0
    for tensor in targets.values():
        flat = tensor.view(-1).view(torch.int64)
        for lo in range(0, flat.numel(), 1 << 26):
            part = flat[lo:lo + (1 << 26)]
            j = torch.arange(offset + lo, offset + lo + part.numel(), device="cuda")
            weights = ((j % words + 0x1234567) * 0x9E3779B97F4A7C15) ^ ((j % words) * 0x2545F4914F6CDD1D) | 1
            sums.index_add_(0, (j // words) % (1 << 16), part * weights)
        offset += -(-tensor.numel() * tensor.element_size() // 4096) * 4096 // 8
    sums.cpu()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=float, default=8.0, help="model size in GB")
    p.add_argument("--threads", default="8,16,24,32")
    p.add_argument("--mapped", default="0,0.25,0.5,1")
    p.add_argument("--verify", default="1,0", help="1: check each chunk's xxh3 on the CPU; 0: no check (the bound)")
    p.add_argument("--buffers", default="torch,hugepage", help="pinned buffers from torch, or huge-page backed")
    p.add_argument("--dir", default="/var/tmp/ember-warm")
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
    results = {"machine": machine(root), "bytes": ref.size, "page_cache_read_gbps": {}, "loads": []}
    read_file(snap, direct=False)  # warm
    for threads in (16, 32):
        results["page_cache_read_gbps"][threads] = read_file(snap, direct=False, threads=threads)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    results["transparent_hugepage"] = thp.read_text().strip() if thp.exists() else "absent"
    for name, make in (("pageable 4 KiB", lambda n: torch.empty(n, dtype=torch.uint8)),
                       ("torch pinned", lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True)),
                       ("huge pages", lambda n: hugepage_buffer(n, pin=False)),
                       ("huge pages pinned", lambda n: hugepage_buffer(n, pin=True))):
        results["page_cache_read_gbps"][f"16 threads into {name}"] = read_into(snap, 16, make)
    print(results["transparent_hugepage"], results["page_cache_read_gbps"], flush=True)
    configs = [(t, m, v, b) for b in args.buffers.split(",") for v in args.verify.split(",")
               for t in args.threads.split(",") for m in args.mapped.split(",")]
    plain = loader.aligned_buffer
    for threads, mapped, verify, buffers in [(int(t), float(m), v == "1", b) for t, m, v, b in configs]:
        loader.aligned_buffer = plain if buffers == "torch" else hugepage_buffer
        runs = []
        for _ in range(3):
            release("cuda")
            source = FileSource(snap, ref.id)
            _, report = load(source, targets, threads=threads, mapped=mapped, verify=verify)
            source.close()
            runs.append(report)
        row = {"threads": threads, "mapped": mapped, "verify": verify, "buffers": buffers, "gbps": statistics.median(r.gbps for r in runs),
               "phases": runs[-1].phases, "mapped_chunks": runs[-1].mapped_chunks}
        results["loads"].append(row)
        print(f"threads={threads:2d} mapped={mapped:.2f} verify={verify} buffers={buffers}: {row['gbps']:.1f} GB/s  {runs[-1]}",
              flush=True)
    results["gpu_weighted_sum_s"] = gpu_weighted_sums(targets, header.chunk_size)
    print("weighted sums of every chunk on the GPU:", results["gpu_weighted_sum_s"], "s", flush=True)
    store.rm(ref.id)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "snapshot_warm_paths.json").write_text(json.dumps(results, indent=2))
    lines = ["# Warm snapshot loads by path", "", f"machine: {json.dumps(results['machine'])}", "",
             f"{ref.size / 1e9:.1f} GB bf16 snapshot in the page cache; raw page-cache reads (16 MiB blocks): " +
             ", ".join(f"{t}: {g:.1f} GB/s" for t, g in results["page_cache_read_gbps"].items()), "",
             f"transparent huge pages: {results['transparent_hugepage']}", "",
             "| threads | share of workers copying from the pinned page cache | xxh3 checked on the CPU | pinned buffers | GB/s (median of 3) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['mapped']:.2f} | {'yes' if r['verify'] else 'no'} | {r['buffers']} | {r['gbps']:.1f} |"
              for r in results["loads"]]
    (out / "snapshot_warm_paths.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
