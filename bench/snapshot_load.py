"""Weight loading, side by side in one run: Ember's snapshot loader, safetensors and transformers,
cold (page cache dropped) and warm, against raw disk read and pinned host->device bandwidth.
Ember is also measured with torch's pinned memory in place of its huge-page buffers (warm), and
with buffered reads in place of O_DIRECT (cold).

    python bench/snapshot_load.py --sizes 8,16          # on the GPU machine (root, for drop_caches)
    python bench/snapshot_load.py --sizes 0.05 --device cpu --dir /var/tmp/x   # a dry run anywhere

Models are random bf16 tensors with Llama-2-7B names and shapes (hidden 4096, MLP 11008,
vocab 32000), as many layers as the size needs; each is written as model.safetensors plus
config.json, then built into a snapshot with the code `ember snapshot build` runs.
With --record writes bench/results/snapshot_load.{json,md} (after every measurement, so a cut-short run keeps its
numbers).
"""

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ember.snapshot import loader
from ember.snapshot.format import ALIGN
from ember.snapshot.loader import LoadReport, load
from ember.snapshot.store import FileSource, LocalStore, staging_path
from ember.snapshot.writer import write_safetensors

HIDDEN, MLP, VOCAB, HEADS = 4096, 11008, 32000, 32
BLOCK = 16 << 20
THREADS = min(16, os.cpu_count() or 1)  # for the raw disk and page-cache reads
RESULTS = Path(__file__).parent / "results"


def llama_shapes(size_gb: float, hidden: int, mlp: int, vocab: int) -> tuple[int, list[tuple[str, tuple[int, ...]]]]:
    per_layer = 4 * hidden * hidden + 3 * hidden * mlp + 2 * hidden
    layers = max(1, round((size_gb * 1e9 / 2 - 2 * vocab * hidden - hidden) / per_layer))
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + f"self_attn.{n}_proj.weight", (hidden, hidden)) for n in "qkvo"]
        shapes += [(p + "mlp.gate_proj.weight", (mlp, hidden)), (p + "mlp.up_proj.weight", (mlp, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, mlp)),
                   (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return layers, shapes


def write_model(folder: Path, size_gb: float, device: str, tiny: bool) -> Path:
    """A Hugging Face model dir: config.json + one model.safetensors of random bf16, streamed to disk."""
    from transformers import LlamaConfig
    hidden, mlp, vocab, heads = (256, 688, 1000, 4) if tiny else (HIDDEN, MLP, VOCAB, HEADS)
    layers, shapes = llama_shapes(size_gb, hidden, mlp, vocab)
    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=heads, vocab_size=vocab, tie_word_embeddings=False,
                torch_dtype="bfloat16").save_pretrained(folder)
    meta, at = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes:
        n = torch.Size(shape).numel() * 2
        meta[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps(meta).encode()
    head += b" " * (-len(head) % 8)
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for _, shape in shapes:
            t = torch.randn(shape, device=device, dtype=torch.float32).to(torch.bfloat16) * 0.02
            f.write(memoryview(t.cpu().view(-1).view(torch.uint8).numpy()))
    return path


def drop_caches(files: list[Path]) -> str:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise_dontneed"


def read_file(path: Path, direct: bool, threads: int = THREADS, buffer=None) -> float:
    """GB/s of reading the whole file with `threads` threads in BLOCK pieces (O_DIRECT when `direct`), each
    thread into its own buffer(BLOCK) (a page-aligned anonymous mapping by default)."""
    size = path.stat().st_size - path.stat().st_size % ALIGN
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    blocks = list(range(0, size, BLOCK))
    buffers = [memoryview(buffer(BLOCK).numpy() if buffer else mmap.mmap(-1, BLOCK)) for _ in range(threads)]

    def worker(k: int) -> None:
        for off in blocks[k::threads]:
            os.preadv(fd, [buffers[k][:min(BLOCK, size - off)]], off)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    seconds = time.perf_counter() - t
    os.close(fd)
    return size / seconds / 1e9


def h2d_pinned(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - t) / 1e9


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # so every Ember load pays for pinning its buffers, as a fresh replica does


def same_as_safetensors(path: Path, targets: dict[str, torch.Tensor]) -> bool:
    """Tensors Ember loaded (first, last and a layer's worth from the middle) equal the safetensors file's."""
    from safetensors import safe_open
    names = list(targets)
    sample = names[:1] + names[len(names) // 2:len(names) // 2 + 9] + names[-2:]
    with safe_open(path, "pt") as f:
        return all(torch.equal(f.get_tensor(name), targets[name].cpu()) for name in sample)


def machine(folder: Path) -> dict:
    def sh(cmd: str) -> str:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
    import safetensors
    import transformers
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "driver": sh("nvidia-smi --query-gpu=driver_version --format=csv,noheader"),
        "cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"), "cores": os.cpu_count(),
        "ram_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "kernel": platform.release(), "disk": sh(f"df -hT {folder} | tail -1"),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "safetensors": safetensors.__version__, "threads": THREADS,
    }


def run(args) -> None:
    device, tiny = args.device, args.device == "cpu"
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    os.environ["EMBER_HOME"] = str(root / "home")
    store = LocalStore()
    results = {"machine": machine(root.parent if not root.exists() else root), "sizes": []}
    if device == "cuda":
        results["h2d_pinned_gbps"] = h2d_pinned()
    out = Path(args.out)
    for size in args.sizes:
        row: dict = {"target_gb": size}
        results["sizes"].append(row)
        t = time.perf_counter()
        folder = root / f"llama-{size}gb"
        st_path = write_model(folder, size, "cuda" if device == "cuda" else "cpu", tiny)
        sync(device)
        row["write_safetensors_s"] = time.perf_counter() - t
        t = time.perf_counter()
        staged = staging_path()
        write_safetensors(folder, staged)
        ref = store.put(staged, f"llama-{size}gb")
        row["build_snapshot_s"] = time.perf_counter() - t
        snap = store.objects / f"{ref.id}.ember"
        row["bytes"] = ref.size
        files = [st_path, snap]

        def record(key: str, value) -> None:
            row[key] = value
            print(f"[{size} GB] {key}: {value}", flush=True)
            if args.record:
                write_results(results, out)

        record("drop_method", drop_caches(files))
        record("disk_read_gbps", read_file(snap, direct=True))
        drop_caches(files)
        record("disk_buffered_read_gbps", read_file(snap, direct=False))
        record("page_cache_read_gbps", read_file(snap, direct=False))

        targets = {e.name: torch.empty(e.shape, dtype=torch.bfloat16, device=device)
                   for e in store.open(ref.id).header.tensors}

        def ember(verify: bool = True, direct: bool = True, torch_buffers: bool = False) -> LoadReport:
            release(device)
            source = FileSource(snap, ref.id, direct=direct)
            chosen = loader.host_buffer
            if torch_buffers:  # the loader's buffers before hostbuffer.py
                loader.host_buffer = lambda n, pin, lib: (loader.aligned_buffer(n, pin), lambda: None)
            try:
                _, report = load(source, targets, verify=verify)
            finally:
                loader.host_buffer = chosen
                source.close()
            print("   ", report, flush=True)
            return report

        drop_caches(files)
        report = ember()
        record("ember_cold_gbps", report.gbps)
        record("ember_cold_phases", report.phases)
        record("ember_bit_identical", same_as_safetensors(st_path, targets))
        drop_caches(files)
        record("ember_cold_buffered_gbps", ember(direct=False).gbps)
        read_file(snap, direct=False)
        warm = [ember() for _ in range(3)]
        record("ember_warm_gbps", statistics.median(r.gbps for r in warm))
        record("ember_warm_phases", warm[-1].phases)
        record("ember_warm_noverify_gbps", ember(verify=False).gbps)
        plain = [ember(torch_buffers=True) for _ in range(3)]
        record("ember_warm_torch_buffers_gbps", statistics.median(r.gbps for r in plain))
        record("ember_warm_torch_buffers_phases", plain[-1].phases)
        for t in targets.values():
            t.zero_()
        ember()
        record("ember_warm_bit_identical", same_as_safetensors(st_path, targets))
        targets.clear()
        release(device)

        from safetensors.torch import load_file

        def safetensors_load() -> float:
            t = time.perf_counter()
            state = load_file(st_path, device=device)
            sync(device)
            seconds = time.perf_counter() - t
            del state
            release(device)
            return ref.size / seconds / 1e9

        drop_caches(files)
        record("safetensors_cold_gbps", safetensors_load())
        record("safetensors_warm_gbps", safetensors_load())

        from transformers import AutoModelForCausalLM

        def transformers_load() -> float:
            t = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                         device_map=device if device == "cuda" else None)
            sync(device)
            seconds = time.perf_counter() - t
            del model
            release(device)
            return ref.size / seconds / 1e9

        drop_caches(files)
        record("transformers_cold_gbps", transformers_load())
        record("transformers_warm_gbps", transformers_load())
        shutil.rmtree(folder)
        store.rm(ref.id)
    print(table(results))


def goals(row: dict, h2d: float | None) -> dict:
    disk = max(row["disk_read_gbps"], row.get("disk_buffered_read_gbps", 0))
    slower = min(disk, h2d) if h2d else disk
    return {
        "cold_vs_slower_link": row["ember_cold_gbps"] / slower,
        "warm_gbps": row["ember_warm_gbps"],
        "cold_vs_safetensors": row["ember_cold_gbps"] / row["safetensors_cold_gbps"],
        "warm_vs_safetensors": row["ember_warm_gbps"] / row["safetensors_warm_gbps"],
    }


def table(results: dict) -> str:
    h2d = results.get("h2d_pinned_gbps")
    lines = [f"machine: {json.dumps(results['machine'])}", "",
             f"pinned host->device: {h2d:.1f} GB/s" if h2d else "pinned host->device: n/a (cpu)", "",
             "| model | disk O_DIRECT | disk buffered | page cache | Ember cold | Ember cold, buffered reads | "
             "Ember warm | Ember warm, no checksum | Ember warm, torch's pinned buffers | safetensors cold | "
             "safetensors warm | transformers cold | transformers warm |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = ["disk_read_gbps", "disk_buffered_read_gbps", "page_cache_read_gbps", "ember_cold_gbps",
            "ember_cold_buffered_gbps", "ember_warm_gbps", "ember_warm_noverify_gbps", "ember_warm_torch_buffers_gbps",
            "safetensors_cold_gbps", "safetensors_warm_gbps", "transformers_cold_gbps", "transformers_warm_gbps"]
    for row in results["sizes"]:
        cells = [f"{row[k]:.1f}" if k in row else "-" for k in keys]
        lines.append(f"| {row.get('bytes', 0) / 1e9:.1f} GB bf16 | " + " | ".join(cells) + " |")
    lines += [
        "",
        "GB/s, each the bytes of the model over wall time (warm Ember: median of 3). Disk columns: 16 threads "
        "reading 16 MiB blocks of the snapshot file after drop_caches. Ember reads into huge-page buffers pinned "
        "in place; 'torch's pinned buffers' is the same loader with torch's pinned memory (4 KiB pages).",
        "",
    ]
    for row in results["sizes"]:
        if "transformers_warm_gbps" in row:
            g = goals(row, h2d)
            lines.append(f"{row['bytes'] / 1e9:.1f} GB: cold = {g['cold_vs_slower_link']:.0%} of the slower link "
                         f"(goal 90%), warm = {g['warm_gbps']:.1f} GB/s (goal 25), vs safetensors "
                         f"{g['cold_vs_safetensors']:.1f}x cold / {g['warm_vs_safetensors']:.1f}x warm (goal 3x)")
    return "\n".join(lines)


def write_results(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "snapshot_load.json").write_text(json.dumps(results, indent=2))
    (out / "snapshot_load.md").write_text("# Snapshot load benchmark\n\n" + table(results) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8,16", help="model sizes in GB, comma separated")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dir", default="/var/tmp/ember-bench", help="scratch folder on the disk under test")
    p.add_argument("--record", action="store_true", help="write snapshot_load.{md,json} to --out as rows finish")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    args.sizes = [float(s) for s in args.sizes.split(",")]
    run(args)


if __name__ == "__main__":
    sys.exit(main())
