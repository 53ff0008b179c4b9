"""Cold starts as a user meets them: `ember serve examples/chat.py`, one streamed chat request sent at zero
replicas, and the time to its first token, per rung of the cold-start ladder, beside the floors the hardware sets.

    python bench/coldstart.py [--shapes 4b,8b] [--seed-kernels DIR] [--record]
    python bench/coldstart.py --shapes tiny          # the same steps on a CPU with the tiny model: a smoke run

For each model shape (random weights, the tiny tokenizer; Qwen3-4B's shape is 7.3 GB, Qwen3-8B's 13.9 GB):
  full boot        no snapshot yet; the replica boots from safetensors and writes the snapshot. When the full boot
                   had to compile kernels (none kept yet), it is repeated, so that it measures a boot, not nvcc.
  T2 warm          the replica stopped (scale-down window 2 s); its snapshot is in the page cache
  T2 cold          the same after `echo 3 > /proc/sys/vm/drop_caches`
  fresh kernels    the node's kernel directory and flashinfer's JIT cache deleted and the page cache dropped (a
                   fresh machine whose store holds the snapshot and the kernels); FLASHINFER_DISABLE_JIT=1, so a
                   compile on the request path would fail the request instead of hiding in its time
  T1 wake          the replica parks after 1 s idle; once its first park finished, nvidia-smi's memory.used (and each
                   process's share); then requests, each 1 s or 10 s after the park before it finished (T1_GAPS),
                   and the median of each (one wake is one sample: 0.30-0.33 s for the 8B shape in one run)
Each server is measured once its deploy is prepared (fork server imported, the unit's snap=True hooks run, as
`ember status` shows), and each zero-replica rung once the previous replica's process has exited and given the GPU
back: a request at zero replicas, not one racing the last replica's exit (which the T2 rows' gpu_wait_ms would show).
Floors, measured in the same run: the snapshot's bytes over the disk (O_DIRECT), the page cache and pinned PCIe.
Prints a table; with --record writes bench/results/coldstart.{json,md}, and with --merge keeps there the shapes this
run did not measure (a GPU call's time limit fits one shape). `--seed-kernels DIR`: a
FLASHINFER_WORKSPACE_BASE whose built modules become the node's kept kernels before the first boot (saves the
67-110 s of compiling them on a machine that has compiled them before).
"""
import argparse
import json
import os
import re
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "examples" / "chat.py"
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))
from snapshot_load import drop_caches, machine, read_file  # noqa: E402

SHAPES = {  # Qwen3 shapes with the tiny tokenizer's vocabulary, as the issue measured them
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False),
}
NAMES = {"4b": "qwen3-4b-shape", "8b": "qwen3-8b-shape", "tiny": "tiny-qwen3"}
REQUEST = {"messages": [{"role": "user", "content": "Tell me a story about the sea."}], "max_tokens": 4,
           "temperature": 0, "ignore_eos": True, "stream": True}
BUILD = """
import sys, torch, transformers
from transformers import GenerationConfig
from ember.runtime.engine.tiny import train_tokenizer
out, settings = sys.argv[1], __import__("json").loads(sys.argv[2])
tokenizer = train_tokenizer()
tokenizer.save_pretrained(out)
eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
config = transformers.Qwen3Config(**settings, vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None)
torch.set_default_dtype(torch.bfloat16)
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.Qwen3ForCausalLM(config).eval()
model.generation_config = GenerationConfig(eos_token_id=[eos], bos_token_id=None)
model.save_pretrained(out)
"""
H2D = """
import torch, time
n = 4 << 30
src = torch.empty(n, dtype=torch.uint8, pin_memory=True); dst = torch.empty(n, dtype=torch.uint8, device="cuda")
dst.copy_(src, non_blocking=True); torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(5): dst.copy_(src, non_blocking=True)
torch.cuda.synchronize(); print(5 * n / (time.perf_counter() - t) / 1e9)
"""


def build_model(shape: str, folder: Path) -> Path:
    if shape == "tiny":
        from ember.runtime.engine.tiny import build_tiny_model
        return build_tiny_model(folder / NAMES[shape])
    path = folder / NAMES[shape]
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-c", BUILD, str(path), json.dumps(SHAPES[shape])], check=True)
    return path


def gpu_memory_used() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"],
                         capture_output=True, text=True)
    return int(out.stdout.split()[0]) << 20 if out.returncode == 0 else None


def gpu_processes() -> str:
    """pid:MiB of every process holding GPU memory, for the park's record."""
    if shutil.which("nvidia-smi") is None:
        return ""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    return " ".join(":".join(x.strip() for x in line.split(",")) for line in out.stdout.splitlines() if line.strip())


def drop_page_cache(home: Path, model: Path, whole: bool) -> str:
    """The whole page cache on the GPU machine (as the issue measured); on a shared CPU machine only our files."""
    files = [p for p in [*home.rglob("*.ember"), *model.glob("*.safetensors")] if p.is_file()]
    if whole:
        return drop_caches(files)
    os.sync()
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return "fadvise_dontneed"


class Server:
    """One `ember serve examples/chat.py` in its own process group; stop() ends it and its replicas."""

    def __init__(self, home: Path, env: dict[str, str]):
        self.home = home
        began = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "serve", str(APP), "--port", "0"],
            env=os.environ | {"EMBER_HOME": str(home)} | env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True, cwd=ROOT)
        self.log: list[str] = []
        for line in self.process.stdout:
            self.log.append(line)
            if line.startswith("Ember is serving"):
                self.url = line.split(" at ")[-1].strip()
                break
        else:
            raise RuntimeError("ember serve exited before printing its URL:\n" + "".join(self.log))
        threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True).start()
        from ember.gateway.keys import KeyStore

        verify = ssl.create_default_context(cafile=str(home / "tls" / "ca.pem"))
        admin_key = (home / "cli.key").read_text().strip()
        self.admin = httpx.Client(base_url=self.url, verify=verify, timeout=60,
                                  headers={"Authorization": f"Bearer {admin_key}"})
        self.http = httpx.Client(base_url=self.url, verify=verify, timeout=900, headers={
            "Authorization": f"Bearer {KeyStore(home / 'ember.db').create('coldstart')[1]}"})
        self.wait(self.prepared, "the deploy's fork server and templates", timeout=300)
        self.prepare_s = time.perf_counter() - began  # serve until the deploy is prepared
        self.parks_seen = len(self.parks())
        prepared = self.admin.get("/admin/status").json()["apps"]["chat"]["prepared"]
        print(f"  deploy prepared in {self.prepare_s:.1f} s: {prepared}", flush=True)

    def prepared(self) -> bool:
        prepared = (self.admin.get("/admin/status").json()["apps"].get("chat") or {}).get("prepared") or {}
        server = prepared.get("forkserver") or {}
        return server.get("state") == "ready" and "Chat" in server.get("templates", {})

    def parks(self) -> list[str]:
        """The gateway's log lines of finished parks (it logs one when the worker answers)."""
        log = self.home / "logs" / "gateway.log"
        return [line.strip() for line in log.read_text().splitlines() if " parked in " in line] if log.is_file() else []

    def wait_park(self) -> list[str]:
        """Until a park newer than the last one seen has finished; the park lines so far. (A replica's state reads
        parked as soon as its park begins, and its parked_bytes stay from the park before.)"""
        self.wait(lambda: len(self.parks()) > self.parks_seen, "a park")
        parks = self.parks()
        self.parks_seen = len(parks)
        return parks

    def replicas(self) -> list[dict]:
        functions = self.admin.get("/admin/status").json()["apps"].get("chat", {}).get("functions", {})
        return [r for fn in functions.values() for r in fn["replicas"]]

    def wait(self, check, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}: {self.replicas()}")
            time.sleep(0.1)

    def first_token(self, model_name: str) -> tuple[float, dict[str, str]]:
        """Seconds from sending a streamed chat request to its first token, and the start headers."""
        began = time.perf_counter()
        with self.http.stream("POST", "/chat/v1/chat/completions", json={**REQUEST, "model": model_name}) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"request failed ({reply.status_code}): {reply.read().decode()[:2000]}\n"
                                   + self.logs_tail())
            first = None
            for line in reply.iter_lines():
                if first is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    first = time.perf_counter() - began
            headers = {k: v for k, v in reply.headers.items() if k.startswith("x-ember-")}
        if first is None:
            raise RuntimeError("the stream ended without a token")
        return first, headers

    def logs_tail(self, lines: int = 40) -> str:
        """The end of the server's output and of each log under EMBER_HOME/logs, for a failure's message."""
        parts = ["== ember serve\n" + "".join(self.log[-lines:])]
        for path in sorted((self.home / "logs").rglob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"== {path.relative_to(self.home)}\n" + "\n".join(text))
        return "\n".join(parts)

    def scaled_to_zero(self, baseline: int | None, standbys: int = 0) -> float:
        """Waits for the gateway to drop every replica and, on a GPU, for their processes to give the memory back
        (to within 1 GiB of `baseline`, `standbys` processes allowed to hold a context); the seconds that second
        wait took."""
        self.wait(lambda: not self.replicas(), "scale-down")
        waited = wait_gpu_free(baseline, standbys=standbys)
        settle = time.perf_counter() + 10   # a node left idle: its standby has made its context (if it could)
        while standbys and baseline is not None and len(gpu_processes().split()) < standbys and \
                time.perf_counter() < settle:
            time.sleep(0.1)
        if standbys and baseline is not None and len(gpu_processes().split()) >= standbys:
            # and loaded cuBLAS and Triton's driver after the context (0.27-0.33 s on the H200): the request comes to
            # a GPU idle for a moment, not in the instant the last replica gave it back
            time.sleep(STANDBY_SETTLE_S)
        return waited

    def stop(self) -> None:
        for c in (self.admin, self.http):
            c.close()
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


STANDBY_SETTLE_S = 1.0
# Seconds a T1 request comes after its replica's park finished, one wake each, alternating: 1 s while the driver
# still clears the memory the park gave back (a new mapping waits for it: 30-56 ms more for the 8B shape's weights on
# the H200 3 s after a 125 GB release, 7 ms 6 s after), 10 s once it is done.
T1_GAPS = (1.0, 10.0, 1.0, 10.0, 1.0, 10.0)


def park_ms(line: str) -> int | None:
    """How long a park took, from the gateway's log line of it."""
    found = re.search(r" parked in (\d+) ms", line)
    return int(found.group(1)) if found else None


def t1_rung(gap: float) -> str:
    return "T1 wake" if gap == T1_GAPS[0] else f"T1 wake, parked {gap:g} s"


def t1_median(wakes: list[dict], gap: float) -> float:
    return round(statistics.median(w["first_token_s"] for w in wakes if w["parked_s"] == gap), 3)


def wait_gpu_free(baseline: int | None, timeout: float = 120, standbys: int = 0) -> float:
    """Until the GPU's memory is back within 1 GiB of `baseline` and at most `standbys` processes (EMBER_GPU_STANDBY's,
    each with a CUDA context and nothing else) hold it; the seconds that took."""
    began = time.perf_counter()
    if baseline is None:
        return 0.0
    # the memory first, then the process: the supervisor hands the GPU to the next start once the process is gone
    while (used := gpu_memory_used()) is not None and (used > baseline + (1 << 30)
                                                       or len(gpu_processes().split()) > standbys):
        if time.perf_counter() - began > timeout:
            raise RuntimeError(f"the GPU still holds {used / 2**30:.1f} GiB > {baseline / 2**30:.1f} GiB + 1 GiB "
                               f"after {timeout:g} s: {gpu_processes()}")
        time.sleep(0.1)
    return time.perf_counter() - began


def kernel_files(home: Path) -> set[str]:
    folder = home / "kernels"
    return {str(p.relative_to(home)) for p in folder.rglob("*.so")} if folder.is_dir() else set()


def seed_kernels(workspace: Path, home: Path) -> int:
    """Built flashinfer modules of an earlier machine's JIT workspace become this node's kept (AOT) modules."""
    count = 0
    for built in workspace.glob(".cache/flashinfer/*/*/cached_ops/*/*.so"):
        if built.stem != built.parent.name:
            continue
        version_arch = built.parent.parent.parent.relative_to(workspace / ".cache" / "flashinfer")
        target = home / "kernels" / "flashinfer" / version_arch / built.parent.name / built.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)
        count += 1
    return count


def forget_snapshots(home: Path) -> None:
    """The weight snapshots go; kept kernels and other blobs stay (a node that never served this model)."""
    for folder in ("objects", "refs"):
        shutil.rmtree(home / "snapshots" / folder, ignore_errors=True)


def request_timeline(spans_file: Path, seen: int) -> tuple[str, int]:
    """With --trace: the spans of the last request's trace among the file's lines past `seen`, one per line (start
    and length in ms from the trace's first span, sorted by start), and the lines read so far."""
    if not spans_file.is_file():
        return "  (no spans: tracing is off in this environment)", seen
    lines = spans_file.read_text().splitlines()
    spans = [json.loads(line) for line in lines[seen:] if line.strip()]
    roots = [s for s in spans if s["parent_span_id"] is None and s["name"].startswith("POST ")]
    if not roots:
        return "  (no request span)", len(lines)
    trace = [s for s in spans if s["trace_id"] == roots[-1]["trace_id"]]
    origin = min(s["start_ns"] for s in trace)
    rows = [f"  {(s['start_ns'] - origin) / 1e6:8.1f} ms +{(s['end_ns'] - s['start_ns']) / 1e6:8.1f} ms  "
            f"{s['service']}: {s['name']}" for s in sorted(trace, key=lambda s: s["start_ns"])]
    return "\n".join(rows), len(lines)


def measure_shape(shape: str, folder: Path, args, gpu: bool) -> tuple[dict, list[dict]]:
    model = build_model(shape, folder / "models")
    home = folder / f"home-{shape}"
    workspace = folder / f"fi-workspace-{shape}"
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(workspace, ignore_errors=True)
    if args.seed_kernels:
        print(f"[{shape}] seeded {seed_kernels(Path(args.seed_kernels), home)} kernel modules", flush=True)
    name = model.name
    env = {"EMBER_CHAT_MODEL": str(model), "EMBER_CHAT_SCALEDOWN_WINDOW": "2",
           "FLASHINFER_WORKSPACE_BASE": str(workspace)}
    spans_file, spans_seen = home.parent / f"spans-{shape}.jsonl", 0
    if args.trace:   # every request's spans (gateway, worker, engine) go to one file, printed after each rung
        spans_file.unlink(missing_ok=True)
        env["EMBER_TRACE_FILE"] = str(spans_file)
    standbys = 1   # the default: the T2 rungs start from a standby that initialised CUDA while the GPU was idle
    if args.no_standby:
        env["EMBER_GPU_STANDBY"], standbys = "0", 0
    rows: list[dict] = []
    baseline = gpu_memory_used()  # nothing of ours on the GPU yet

    def record(rung: str, seconds: float, headers: dict, note: str = "") -> None:
        rows.append({"model": name, "rung": rung, "first_token_s": round(seconds, 3),
                     "cold_start": headers.get("x-ember-cold-start", ""),
                     "breakdown": headers.get("x-ember-start-breakdown", ""), "note": note})
        print(f"[{shape}] {rung}: {seconds:.3f} s  {headers.get('x-ember-cold-start', '')}  "
              f"{headers.get('x-ember-start-breakdown', '')} {note}", flush=True)
        if args.trace:
            nonlocal spans_seen
            time.sleep(0.5)   # the stream's spans end with it; their exporters write them as they end
            timeline, spans_seen = request_timeline(spans_file, spans_seen)
            print(timeline, flush=True)

    server = Server(home, env)
    prepare_s = server.prepare_s
    try:
        before = kernel_files(home)
        full, headers = server.first_token(name)
        compiled = kernel_files(home) - before
        if compiled:  # that boot compiled kernels: boot again, now that they are kept, without the snapshot
            record("full boot (compiling kernels)", full, headers, f"{len(compiled)} modules compiled")
            server.scaled_to_zero(baseline)
            forget_snapshots(home)
            full, headers = server.first_token(name)
        record("full boot", full, headers)
        released = server.scaled_to_zero(baseline, standbys)
        warm, headers = server.first_token(name)
        record("T2 warm", warm, headers, f"previous replica's exit gave the GPU back {released:.1f} s after scale-down")
        released = server.scaled_to_zero(baseline, standbys)
        how = drop_page_cache(home, model, whole=gpu)
        cold, headers = server.first_token(name)
        record("T2 cold", cold, headers, f"{how}; GPU back {released:.1f} s after scale-down")
        server.scaled_to_zero(baseline)
    finally:
        server.stop()
    wait_gpu_free(baseline)

    if args.t2_only:  # a quick look at the restore path: no fresh-kernel or park rungs, no floors, nothing recorded
        return {}, rows
    shutil.rmtree(home / "kernels", ignore_errors=True)  # a fresh machine: the store has the kernels, the node not
    shutil.rmtree(workspace, ignore_errors=True)
    how = drop_page_cache(home, model, whole=gpu)
    server = Server(home, env | {"FLASHINFER_DISABLE_JIT": "1"})
    try:
        fresh, headers = server.first_token(name)
        record("fresh kernels", fresh, headers, f"{how}; deploy prepared in {server.prepare_s:.1f} s before it")
    finally:
        server.stop()
    wait_gpu_free(baseline)

    server = Server(home, env | {"EMBER_CHAT_SCALEDOWN_WINDOW": "600", "EMBER_CHAT_PARK_AFTER": "1"})
    wakes: list[dict] = []
    try:
        server.first_token(name)
        parked_bytes, holders = None, ""
        for i, gap in enumerate(T1_GAPS):
            parks = server.wait_park()
            if i == 0:   # the first park: what a parked replica holds of the GPU
                parked_bytes, holders = gpu_memory_used(), gpu_processes()
                print(f"  parked: {parked_bytes} bytes in use; per process (pid:MiB) {holders}; {parks[-1:]}",
                      flush=True)
            time.sleep(gap)  # a wake comes some time after the park, not on its heels
            wake, headers = server.first_token(name)
            wakes.append({"parked_s": gap, "first_token_s": round(wake, 3), "park_ms": park_ms(parks[-1])})
            print(f"[{shape}] T1 wake {gap:g} s after its park ({wakes[-1]['park_ms']} ms): {wake:.3f} s  "
                  f"{headers.get('x-ember-cold-start', '')}", flush=True)
        parked_note = f"parked GPU memory {parked_bytes / 2**30:.2f} GiB ({holders}); " if parked_bytes else ""
        parked_note += f"parks took {', '.join(str(w['park_ms']) for w in wakes)} ms (the first copies the weights " \
                       "to host memory); "
        for gap in sorted(set(T1_GAPS)):
            times = [w["first_token_s"] for w in wakes if w["parked_s"] == gap]
            record(t1_rung(gap), statistics.median(times), headers, f"{parked_note}median of "
                   f"{', '.join(f'{t:.3f}' for t in times)}")
            parked_note = ""
    finally:
        server.stop()
    wait_gpu_free(baseline)

    snapshot = max(home.rglob("objects/*.ember"), key=lambda p: p.stat().st_size)
    weight_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    floors = measure_floors(snapshot, home, model, gpu)
    nbytes = snapshot.stat().st_size
    floors.update(t1_wake_s=round(weight_bytes / floors["pcie_gbps"] / 1e9, 3) if floors.get("pcie_gbps") else None,
                  t2_warm_s=round(nbytes / min(floors["page_cache_gbps"], floors.get("pcie_gbps") or 1e9) / 1e9, 3),
                  t2_cold_s=round(nbytes / min(floors["disk_gbps"], floors.get("pcie_gbps") or 1e9) / 1e9, 3),
                  snapshot_bytes=nbytes)
    result = {"name": name, "weight_bytes": weight_bytes, "deploy_prepare_s": round(prepare_s, 1),
              "full_boot_s": round(full, 3), "t2_warm_s": round(warm, 3),
              "t2_cold_s": round(cold, 3), "t1_wake_s": t1_median(wakes, T1_GAPS[0]),
              "t1_wake_settled_s": t1_median(wakes, max(T1_GAPS)), "t1_wakes": wakes,
              "fresh_kernels_first_request_s": round(fresh, 3), "parked_gpu_bytes": parked_bytes, "floors": floors}
    return result, rows


def measure_floors(snapshot: Path, home: Path, model: Path, gpu: bool) -> dict:
    drop_page_cache(home, model, whole=gpu)
    disk = read_file(snapshot, direct=True)
    read_file(snapshot, direct=False)  # into the page cache
    page_cache = read_file(snapshot, direct=False)
    floors = {"disk_gbps": round(disk, 2), "page_cache_gbps": round(page_cache, 2)}
    if gpu:
        out = subprocess.run([sys.executable, "-c", H2D], capture_output=True, text=True, check=True)
        floors["pcie_gbps"] = round(float(out.stdout.split()[-1]), 2)
    return floors


def goals(m: dict) -> list[str]:
    """The issue's goals for the 7.3 GB model, checked against one shape's numbers."""
    f = m["floors"]
    checks = [("T1 wake <= 0.3 s", m["t1_wake_s"] <= 0.3), ("T2 warm <= 1.5 s", m["t2_warm_s"] <= 1.5),
              ("T2 cold within 1.5x its floor", m["t2_cold_s"] <= 1.5 * f["t2_cold_s"]),
              ("full boot >= 10x T2 warm", m["full_boot_s"] >= 10 * m["t2_warm_s"]),
              ("fresh kernels within 1 s of T2 cold", m["fresh_kernels_first_request_s"] <= m["t2_cold_s"] + 1)]
    if m["parked_gpu_bytes"] is not None:
        checks.append(("parked <= 2 GiB", m["parked_gpu_bytes"] <= 2 << 30))
    return [f"{what}: {'met' if ok else 'NOT met'}" for what, ok in checks]


def table(models: list[dict]) -> str:
    lines = ["| model | rung | first token (s) | floor (s) | X-Ember-Cold-Start | start breakdown | note |",
             "|---|---|---|---|---|---|---|"]
    floor_of = {"T2 warm": "t2_warm_s", "T2 cold": "t2_cold_s", "fresh kernels": "t2_cold_s", "T1 wake": "t1_wake_s"}
    floor_of |= {t1_rung(gap): "t1_wake_s" for gap in T1_GAPS}
    by_name = {m["name"]: m for m in models}
    for r in (r for m in models for r in m["rows"]):
        floor = by_name[r["model"]]["floors"].get(floor_of.get(r["rung"], ""), "")
        lines.append(f"| {r['model']} | {r['rung']} | {r['first_token_s']:.3f} | {floor if floor is not None else ''} "
                     f"| {r['cold_start']} | {r['breakdown']} | {r['note']} |")
    lines.append("")
    for m in models:
        f = m["floors"]
        parked = f"{m['parked_gpu_bytes'] / 2**30:.2f} GiB" if m["parked_gpu_bytes"] else "n/a"
        lines.append(f"{m['name']}: {m['weight_bytes'] / 1e9:.1f} GB of weights; disk {f['disk_gbps']} GB/s, page "
                     f"cache {f['page_cache_gbps']} GB/s, PCIe {f.get('pcie_gbps', 'n/a')} GB/s; parked GPU memory "
                     f"{parked}. Goals: {'; '.join(goals(m))}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4b,8b", help="comma-separated: 4b, 8b, tiny")
    parser.add_argument("--dir", default="/tmp/ember-coldstart", help="models, EMBER_HOMEs and caches go here")
    parser.add_argument("--seed-kernels", help="a FLASHINFER_WORKSPACE_BASE holding modules built before")
    parser.add_argument("--record", action="store_true", help="write bench/results/coldstart.{json,md}")
    parser.add_argument("--t2-only", action="store_true", help="only the full boot and T2 rungs, printed (a check "
                        "of the restore path; cannot --record)")
    parser.add_argument("--results", default=str(RESULTS), help="where --record writes (default bench/results)")
    parser.add_argument("--merge", action="store_true",
                        help="with --record: keep the recorded shapes this run does not measure")
    parser.add_argument("--trace", action="store_true",
                        help="serve with EMBER_TRACE_FILE and print each rung's request spans (gateway, worker, "
                             "engine): where the time after a replica's start goes")
    parser.add_argument("--no-standby", action="store_true",
                        help="serve with EMBER_GPU_STANDBY=0: the T2 rungs pay CUDA's initialisation and context "
                             "instead of starting from a standby that made them while the GPU was idle")
    args = parser.parse_args()
    if args.t2_only and args.record:
        parser.error("--t2-only measures part of the ladder: it cannot --record")
    if args.merge and not args.record:
        parser.error("--merge joins this run into the record: add --record")
    kept: list[dict] = []
    if args.merge:
        try:
            kept = kept_models(Path(args.results) / "coldstart.json")
        except ValueError as err:
            parser.error(str(err))
    gpu = shutil.which("nvidia-smi") is not None
    shapes = [shape.strip() for shape in args.shapes.split(",")]
    for shape in shapes:
        if shape not in NAMES:
            parser.error(f"unknown shape {shape!r}: choose from {', '.join(NAMES)}")
        if shape != "tiny" and not gpu:
            parser.error(f"the {shape} shape needs a GPU (no nvidia-smi here): on a CPU run --shapes tiny")
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    models = []
    for shape in shapes:
        result, shape_rows = measure_shape(shape, folder, args, gpu)
        if not result:
            continue
        print(json.dumps(result), flush=True)
        models.append(result | {"measured_on": time.strftime("%Y-%m-%d", time.gmtime()), "rows": shape_rows})
    report = table(models)
    print(report)
    if args.record:
        command = f"python bench/coldstart.py --shapes {args.shapes}" + (" --merge" if args.merge else "")
        write_record(Path(args.results), models, kept, command, machine(folder))


def write_record(out: Path, models: list[dict], kept: list[dict], command: str, machine_info: dict) -> None:
    """bench/results/coldstart.{json,md}: this run's shapes, and the `kept` ones of an earlier record it did not
    measure (in their recorded order, each replaced where this run measured it)."""
    out.mkdir(parents=True, exist_ok=True)
    measured = {m["name"] for m in models}
    joined = [next((m for m in models if m["name"] == k["name"]), k) for k in kept]
    joined += [m for m in models if m["name"] not in {k["name"] for k in kept}]
    (out / "coldstart.json").write_text(json.dumps({"machine": machine_info, "models": joined}, indent=1) + "\n")
    earlier = [f"{m['name']} ({m.get('measured_on', 'an earlier run')})" for m in joined if m["name"] not in measured]
    (out / "coldstart.md").write_text(
        f"# Cold starts through `ember serve examples/chat.py`\n\n`{command}` on {machine_info['gpu']} "
        f"(driver {machine_info['driver']})" + (f"; kept from earlier runs: {', '.join(earlier)}" if earlier else "")
        + ". A streamed chat request sent at zero replicas (or to a parked one), seconds to its first token.\n\n"
        f"{table(joined)}\n")


def kept_models(path: Path) -> list[dict]:
    """The shapes of an earlier record, each with its table rows, for --merge (none where there is no record)."""
    if not path.is_file():
        return []
    try:
        models = json.loads(path.read_text())["models"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a coldstart record ({err}): drop --merge to write a new one") from None
    if not isinstance(models, list) or not all(isinstance(m, dict) and "name" in m for m in models):
        raise ValueError(f"{path} is not a coldstart record (its models are not named shapes): drop --merge to "
                         "write a new one")
    bare = [m["name"] for m in models if "rows" not in m]
    if bare:
        raise ValueError(f"{path} keeps no table rows for {', '.join(bare)} (recorded before --merge): record every "
                         "shape without --merge")
    return models


if __name__ == "__main__":
    main()
