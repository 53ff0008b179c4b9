"""Engine speed on one GPU: Ember against transformers and the HBM roofline, side by side in one run.

    python bench/engine/speed.py                          # every shape, every part; prints a table
    python bench/engine/speed.py --models 8B --record     # also writes bench/results/engine_speed.json
    python bench/engine/speed.py --models 0.6B --skip-online --offline-requests 16   # a quick look
    python bench/engine/speed.py --models 8B --parts b1,offline,b64 --record --results DIR   # one call's share
    python bench/engine/speed.py --merge DIR1/engine_speed.json DIR2/engine_speed.json     # join the shares
    python bench/engine/speed.py --models 8B --parts b1,b64 --overlap both    # overlap scheduling on and off

With --record, engine_speed.partial.json in --results holds what the run has measured so far, rewritten after every
part, so a run cut short (a device call's time limit) keeps it; --merge takes it like any engine_speed.json.

Random-weight models of the shapes of Qwen3-0.6B, 4B and 8B (bf16, built on the GPU, the tiny tokenizer of
runtime/engine/tiny.py). Per model:
  - roofline: weight bytes over the device-to-device copy bandwidth measured in this run (batch-1 decode
    reads every weight once per token);
  - batch 1: a 128-token prompt, 256 greedy tokens; decode tok/s from the first token to the last, for Ember
    and for transformers' `generate` with its static cache;
  - offline: 256 requests, prompt and output lengths uniform in [100, 1024] (seed 0), output tok/s, with batches
    of up to 256 sequences and 8192 tokens, and again (offline-defaults) with EngineConfig's default batch sizes,
    what a user who sets nothing gets; the engine's decode graphs are captured first, as its idle loop does
    within seconds of a start (the time is in the split as captured_before_s); transformers runs `generate_batch`
    (continuous batching) on the first --hf-offline-requests prompts, each generating --hf-offline-tokens (it takes
    one max_new_tokens for a batch);
  - host vs GPU per decode step at batch 64 (256-token prompts): host = step wall time minus the time the host
    waited for the device, GPU = CUDA events around the forward pass and sampling, and the step's wall time;
    the median of --b64-processes fresh processes (each its own engine on the same model), as one process's host
    time moves from 0.50 to 0.86 ms on the same H200 machine within minutes (the runs are kept in the row);
  - skewed: long prompts among short ones (SKEWED), 256 greedy tokens each, all at once: output tok/s, and the
    decode graphs' mean GPU ms a step against the floor of those steps (the weights' read or products, whichever
    is longer, plus every sequence's K/V at the copy bandwidth), and beside them the same with flashinfer's decode
    kernel in place of Ember's streamed attention (flashinfer_...; not when --streamed-decode names the kernel);
  - Ember runs with overlap scheduling, EngineConfig's default; with --overlap both or off, also or only with
    EngineConfig(overlap=False), in fields named "..._serial";
  - online: `ember serve` with one replica, the OpenAI completions API streaming, 256-token prompts and
    128-token outputs at each concurrency, streamed from client processes of their own (load_client.py; every stream
    of a level starts at once): output tok/s, TTFT and ITL p50/p99 (serial steps in "online_serial"),
    and the host CPU each streamed token cost the gateway process and the rest of `ember serve`'s processes (and
    of that, their main threads: the replica's event loop; its step loop spins on the device while steps run),
    and the replica's forward passes by kind (decode graphs replayed, prefills through the piecewise graphs, eager
    steps: prefills no piecewise size fits and the decode steps such a prefill joined) with their mean GPU ms, from
    the engine's counters at the gateway's /metrics.
"""
import argparse
import gc
import json
import os
import platform
import shutil
import signal
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SHAPES = {   # Qwen3 configs as published (vocabulary 151936, head_dim 128)
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
}
CONCURRENCY = (1, 4, 8, 16, 32, 64)


def log(*args) -> None:
    print(*args, flush=True)


def build_model(shape: str, directory: Path, tokenizer=None):
    """Save a random-weight Qwen3 of `shape` with `tokenizer` (by default the tiny one); return the transformers
    model (on the GPU)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from ember.runtime.engine.tiny import train_tokenizer

    tokenizer = tokenizer or train_tokenizer()
    tokenizer.save_pretrained(directory)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(**SHAPES[shape], head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                         rope_theta=1000000, rms_norm_eps=1e-6, eos_token_id=eos, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=0, bos_token_id=None)
    model.save_pretrained(directory)
    return model


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write) of 4 GiB, best of 10."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * (2 << 30) / best


def matmul_rate(fp8: bool = False) -> float:
    """FLOP/s of the best bf16 product of prefill sizes (8192 tokens through the 8B shape's MLP), best of 10; with
    `fp8`, of the FP8 product EngineConfig(quantization="fp8") runs (torch._scaled_mm, a scale per row of each)."""
    a = torch.randn(8192, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(12288, 4096, dtype=torch.bfloat16, device="cuda")
    if fp8:
        a, w = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        scale_a = torch.ones(8192, 1, device="cuda")
        scale_w = torch.ones(1, 12288, device="cuda")
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if fp8:
            torch._scaled_mm(a, w.t(), scale_a=scale_a, scale_b=scale_w, out_dtype=torch.bfloat16)
        else:
            torch.nn.functional.linear(a, w)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    del a, w
    return 2 * 8192 * 4096 * 12288 / best


def _workload_costs(model_dir: Path, weight_bytes: int, prompt_lens: list[int], fp8: bool = False,
                    fp8_kv: bool = False) -> dict:
    """What the offline workload's parts cost a model of this shape: the bytes its products read per step, the
    FLOPs per decoded token, the K/V bytes per token of context, and prefill's FLOPs (weights and causal attention;
    the head's product only for each prompt's last token, whose logits sample its first output). `fp8`: the
    decoder's product weights one byte a parameter (EngineConfig(quantization="fp8")), the head's two. `fp8_kv`: K
    and V one byte a value (EngineConfig(kv_cache_dtype="fp8"))."""
    shape = json.loads((model_dir / "config.json").read_text())
    layers, hidden = shape["num_hidden_layers"], shape["hidden_size"]
    head_dim = shape.get("head_dim") or hidden // shape["num_attention_heads"]
    # the embedding table is gathered, not read whole; the head is a product like the others
    product_bytes = weight_bytes - (0 if shape.get("tie_word_embeddings") else shape["vocab_size"] * hidden * 2)
    flops_per_token = product_bytes   # 2 FLOPs per bf16 parameter (2 bytes)
    head_flops = shape["vocab_size"] * hidden * 2
    attention_flops = sum(4 * layers * shape["num_attention_heads"] * head_dim * p * p / 2 for p in prompt_lens)
    if fp8:
        product_bytes -= (product_bytes - head_flops) // 2
    return {"product_bytes": product_bytes, "flops_per_token": flops_per_token,
            "kv_per_token": layers * shape["num_key_value_heads"] * head_dim * 2 * (1 if fp8_kv else 2),
            "prefill_flops": sum(prompt_lens) * (flops_per_token - head_flops) + len(prompt_lens) * head_flops
            + attention_flops}


def offline_floor(model_dir: Path, weight_bytes: int, prompt_lens: list[int], output_lens: list[int],
                  bandwidth: float, flops: float, fp8: bool = False, fp8_kv: bool = False) -> float:
    """Seconds an ideal engine of Ember's kind (and vLLM's and SGLang's: prefill and decode in their own steps, a
    step's attention after its products) needs for the offline workload at this run's measured copy bandwidth and
    matrix product rate: every prompt prefilled at the product rate, then each decode step of every sequence still
    running, taking the longer of reading the weights and computing the step's products, plus reading each
    sequence's K/V at the copy bandwidth. Nothing is wasted: no padding, no launch gaps, no host time, and prefill
    overlaps nothing. A lower bound on the run's time for such an engine; `offline_bound` is one for any. `fp8`:
    with FP8 product weights (the head's bf16 product counted at `flops` too, which keeps it a lower bound); `fp8_kv`:
    with an FP8 KV cache."""
    c = _workload_costs(model_dir, weight_bytes, prompt_lens, fp8, fp8_kv)
    seconds = c["prefill_flops"] / flops
    running = sorted(zip(output_lens, prompt_lens))
    for step in range(1, max(output_lens)):   # the token of step 0 came with the prefill
        running = [(o, p) for o, p in running if o > step]
        batch_flops = c["flops_per_token"] * len(running)
        context = sum(p + step for _, p in running)
        seconds += max(c["product_bytes"] / bandwidth, batch_flops / flops) + context * c["kv_per_token"] / bandwidth
    return seconds


def decode_floor(model_dir: Path, weight_bytes: int, prompt_lens: list[int], new_tokens: int, bandwidth: float,
                 flops: float) -> float:
    """offline_floor's seconds for the decode steps alone of these prompts, each generating `new_tokens` tokens
    together (the first with its prefill)."""
    prefill = _workload_costs(model_dir, weight_bytes, prompt_lens)["prefill_flops"] / flops
    return offline_floor(model_dir, weight_bytes, prompt_lens, [new_tokens] * len(prompt_lens), bandwidth,
                         flops) - prefill


def offline_bound(model_dir: Path, weight_bytes: int, prompt_lens: list[int], output_lens: list[int],
                  bandwidth: float, flops: float) -> float:
    """Seconds no engine can beat on the offline workload with bf16 weights and K/V at these rates: the longer of
    all its products at the product rate (prefill's, then one decoded token's per output token after the first)
    and all its reads at the copy bandwidth (the weights once for the prefill and once for each of the longest
    output's decode steps, which follow one another, and every decode step's K/V), as if every product overlapped
    every read."""
    c = _workload_costs(model_dir, weight_bytes, prompt_lens)
    decoded = sum(o - 1 for o in output_lens)
    compute = (c["prefill_flops"] + decoded * c["flops_per_token"]) / flops
    context = sum(sum(p + step for step in range(1, o)) for o, p in zip(output_lens, prompt_lens))
    reads = max(output_lens) * c["product_bytes"] + context * c["kv_per_token"]
    return max(compute, reads / bandwidth)


def random_prompts(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 1000, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@torch.no_grad()
def hf_batch1(model, prompt: list[int], new_tokens: int) -> float:
    """transformers' static-cache greedy decode, tok/s after the first token. Eager: on CUDA a static cache makes
    `generate` compile the forward pass by itself, and the compiled runs measured 1.0 tok/s for the 8B shape on
    the H200 (transformers 5.17), compiling again inside the timed calls."""
    ids = torch.tensor([prompt], device="cuda")

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        began = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                       disable_compile=True)
        torch.cuda.synchronize()
        return time.perf_counter() - began

    timed(4)   # warm-up
    return (new_tokens - 1) / (timed(new_tokens) - timed(1))


@torch.no_grad()
def hf_offline(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, str]:
    """Output tok/s of transformers' continuous batching (`generate_batch`), else of padded batched `generate`."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    try:
        model.generate_batch(prompts[:2], generation_config=config)   # warm-up
        began = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=config)
        elapsed = time.perf_counter() - began
        produced = sum(len(o.generated_tokens) for o in outputs.values())
        return produced / elapsed, "generate_batch"
    except Exception as e:  # noqa: BLE001 - a version without continuous batching: fall back, say so
        log(f"  transformers generate_batch failed ({e!r}); padded batched generate instead")
    began, produced = time.perf_counter(), 0
    for i in range(0, len(prompts), 64):
        chunk = prompts[i:i + 64]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device="cuda")
        out = model.generate(ids, attention_mask=mask, generation_config=config)
        produced += (out.shape[1] - width) * len(chunk)
    return produced / (time.perf_counter() - began), "generate (padded batches of 64)"


def ember_engine(model_dir: Path, max_num_seqs: int | None = None, overlap: bool = True,
                 streamed_decode: int | None = None, device_wait: str | None = None, max_model_len: int = 4096,
                 quantization: str | None = None, kv_cache_dtype: str = "auto"):
    """The engine with batches of up to `max_num_seqs` sequences and 8192 tokens a step; with None, with
    EngineConfig's defaults (what a user gets). `streamed_decode`: EngineConfig.streamed_decode_min_batch when
    given, 0 for flashinfer's decode kernel at every batch size; `device_wait`: EngineConfig.device_wait when
    given; `quantization` and `kv_cache_dtype`: EngineConfig's."""
    from ember.runtime.engine.config import EngineConfig
    from ember.runtime.engine.engine import LLMEngine

    tuned = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 8192}
    if streamed_decode is not None:
        tuned["streamed_decode_min_batch"] = streamed_decode or None
    if device_wait is not None:
        tuned["device_wait"] = device_wait
    return LLMEngine(EngineConfig(model=str(model_dir), max_model_len=max_model_len, overlap=overlap,
                                  quantization=quantization, kv_cache_dtype=kv_cache_dtype, **tuned))


def ember_batch1(eng, prompt: list[int], new_tokens: int) -> float:
    from ember.runtime.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))   # warm-up
    eng.add_request("b1", prompt, params)
    times = []
    while eng.has_unfinished_requests():
        if eng.step():
            times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def generate_recorded(eng, prompts: list[list[int]], params) -> tuple[list[list[int]], float, list]:
    """`eng.generate`'s outputs, its seconds, and every step's RunOutput (from the runner's collect, which each step
    passes through, overlapped or not)."""
    runs = []
    collect = eng.runner.collect

    def recorded(launched):
        runs.append(collect(launched))
        return runs[-1]

    eng.runner.collect = recorded
    try:
        began = time.perf_counter()
        outputs = eng.generate(prompts, params)
        elapsed = time.perf_counter() - began
    finally:
        del eng.runner.collect
    return outputs, elapsed, runs


def ember_offline(eng, prompts: list[list[int]], output_lens: list[int]) -> tuple[float, dict]:
    """Output tok/s, and where the run's time went: steps replayed from a graph or run eagerly (prefill chunks
    and mixed steps), their GPU seconds, and the host's seconds outside the waits for the device."""
    from ember.runtime.engine.sampling import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    # An engine that has been up: its idle loop captured every decode graph (~75 ms each on the H200), as a served
    # replica's does within seconds of its start, and as other engines capture theirs before they serve
    began = time.perf_counter()
    while eng.capture_idle():
        pass
    captured_before = time.perf_counter() - began
    graphs = eng.runner.graphs
    captured = graphs.capture_seconds if graphs else 0.0
    outputs, elapsed, runs = generate_recorded(eng, prompts, params)
    assert [len(o) for o in outputs] == output_lens
    graphed = [r for r in runs if r.graph_batch_size is not None]
    eager = [r for r in runs if r.graph_batch_size is None]
    split = {"seconds": round(elapsed, 2), "graph_steps": len(graphed), "eager_steps": len(eager),
             "graph_gpu_s": round(sum(r.gpu_seconds for r in graphed), 2),
             "eager_gpu_s": round(sum(r.gpu_seconds for r in eager), 2),
             "host_s": round(elapsed - sum(r.wait_seconds for r in runs), 2),
             # of host_s: the decode graphs captured on their first use in this run (lazy capture)
             "capture_s": round((graphs.capture_seconds if graphs else 0.0) - captured, 2),
             # before the run, outside its time: the graphs the engine's idle loop captures
             "captured_before_s": round(captured_before, 2)}
    return sum(output_lens) / elapsed, split


def ember_skewed(eng, model_dir: Path, weight_bytes: int, bandwidth: float, flops: float) -> list[dict]:
    """Each SKEWED batch (SKEWED_TOKENS greedy tokens a request, all at once): output tok/s, and its decode graphs'
    mean GPU ms a step against the floor of its decode steps (offline_floor's, less its prefill)."""
    from ember.runtime.engine.sampling import SamplingParams

    rows = []
    for name, lens in SKEWED.items():
        prompts = [random_prompts(1, n, n, seed=i)[0] for i, n in enumerate(lens)]
        params = SamplingParams(temperature=0, max_tokens=SKEWED_TOKENS, ignore_eos=True)
        outputs, elapsed, runs = generate_recorded(eng, prompts, params)
        assert [len(o) for o in outputs] == [SKEWED_TOKENS] * len(lens)
        graphed = [r for r in runs if r.graph_batch_size is not None]
        floor = decode_floor(model_dir, weight_bytes, lens, SKEWED_TOKENS, bandwidth, flops)
        rows.append({"workload": name, "requests": len(lens),
                     "output_tok_s": round(len(lens) * SKEWED_TOKENS / elapsed, 1),
                     "decode_graph_steps": len(graphed),
                     "decode_gpu_ms_per_step": round(1000 * sum(r.gpu_seconds for r in graphed) / max(1, len(graphed)),
                                                     3),
                     "decode_floor_ms_per_step": round(1000 * floor / (SKEWED_TOKENS - 1), 3)})
    return rows


def ember_host_vs_gpu(eng, batch: int = 64) -> tuple[float, float, float, dict]:
    """Median host, GPU and wall milliseconds per decode step with `batch` sequences running (with overlap, the
    wall time is what the host does not hide behind the device), and the launch's parts: host work up to the
    forward pass (prepare), waiting on the device within it (blocked), queueing the forward pass and sampling."""
    from ember.runtime.engine.sampling import SamplingParams

    for i, prompt in enumerate(random_prompts(batch, 256, 256, seed=3)):
        eng.add_request(f"b64-{i}", prompt, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    host, gpu, walls, parts = [], [], [], {"prepare": [], "blocked": [], "queue": []}
    runs, launches = [], []
    launch, collect = eng.runner.launch, eng.runner.collect

    def recorded(launched):   # the bench reads each step's RunOutput beside the engine
        runs.append(collect(launched))
        return runs[-1]

    def launched(*args, **kwargs):
        launches.append(launch(*args, **kwargs))
        return launches[-1]

    eng.runner.collect, eng.runner.launch = recorded, launched
    try:
        while eng.has_unfinished_requests():
            runs.clear()
            launches.clear()
            began = time.perf_counter()
            eng.step()
            wall = time.perf_counter() - began
            if runs and runs[0].graph_batch_size == batch and len(eng.scheduler.running) == batch:
                host.append(wall - runs[0].wait_seconds)
                gpu.append(runs[0].gpu_seconds)
                walls.append(wall)
                for step in launches:
                    parts["prepare"].append(step.prepared - step.began - step.blocked)
                    parts["blocked"].append(step.blocked)
                    parts["queue"].append(step.queued - step.prepared)
    finally:
        del eng.runner.collect, eng.runner.launch
    return (1000 * statistics.median(host), 1000 * statistics.median(gpu), 1000 * statistics.median(walls),
            {k: round(1000 * statistics.median(v), 3) for k, v in parts.items() if v})


FRESH_B64 = """
import json, sys
from pathlib import Path
{redirect}
sys.path.insert(0, {here!r})
import speed
eng = speed.ember_engine(Path({model_dir!r}), max_num_seqs=256, overlap={overlap!r}, streamed_decode={streamed!r},
                         device_wait={device_wait!r})
host, gpu, wall, launch = speed.ember_host_vs_gpu(eng)
print(json.dumps({{"host_ms": host, "gpu_ms": gpu, "wall_ms": wall, "launch_ms": launch}}))
"""


def b64_in_fresh_process(model_dir: Path, runtime: str | None = None, overlap: bool = True,
                         streamed_decode: int | None = None, device_wait: str | None = None) -> dict:
    """`ember_host_vs_gpu` in a new process with its own engine on `model_dir` (this process must have freed the
    GPU memory of its own): {host_ms, gpu_ms, wall_ms, launch_ms}. `runtime`: a directory to import as
    ember.runtime in place of this checkout's (another commit's engine, for host_ab.py)."""
    redirect = f"import ember.runtime; ember.runtime.__path__[:] = [{runtime!r}]" if runtime else ""
    code = FRESH_B64.format(redirect=redirect, here=str(Path(__file__).parent), model_dir=str(model_dir),
                            overlap=overlap, streamed=streamed_decode, device_wait=device_wait)
    out = subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.PIPE, text=True,
                         env=os.environ).stdout
    return json.loads(out.strip().splitlines()[-1])


def cpu_seconds(root: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of `root` and every process under it, by pid (Linux /proc)."""
    parents, times = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return {pid: times[pid] for pid in tree if pid in times}


def main_thread_cpu_seconds(pids) -> dict[int, float]:
    """CPU seconds so far of each process's main thread (a replica's event loop: HTTP, the OpenAI handlers,
    detokenizing, the SSE sends; its engine steps on another thread), by pid; a process gone is left out."""
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def serving_url(process: subprocess.Popen, serve_log: Path, timeout: float = 300) -> str:
    """The URL `ember serve` prints once it serves, read from its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in serve_log.read_text(errors="replace").splitlines():
            if line.startswith("Ember is serving"):
                return line.split(" at ")[-1].strip()
        if process.poll() is not None:
            raise RuntimeError(f"`ember serve` exited with {process.returncode}; its log ({serve_log}) ends:\n"
                               + serve_log.read_text(errors="replace")[-3000:])
        time.sleep(0.2)
    raise RuntimeError(f"`ember serve` printed no URL within {timeout:g} s; see {serve_log}")


ONLINE_SETTLE_S = 6.0   # the replica idles after the warm-up: ~1 s before its idle loop starts, ~2 s of captures


def online(model_dir: Path, concurrency: tuple[int, ...], requests_per_level: int,
           overlap: bool = True, serve_log_dir: Path | None = None, device_wait: str | None = None,
           settle: float = ONLINE_SETTLE_S) -> list[dict]:
    """`ember serve` with one replica (its engine with EngineConfig(overlap=overlap)); streaming completions at each
    concurrency, `settle` seconds after a warm-up request. The server's log is kept in `serve_log_dir` (default:
    beside the model)."""
    serve_log_dir = serve_log_dir or model_dir.parent
    import httpx
    import load_client  # beside this file

    home = Path(tempfile.mkdtemp(prefix="ember-speed-"))
    kept = Path(os.environ["EMBER_HOME"]) / "kernels" if os.environ.get("EMBER_HOME") else None
    if kept is not None and kept.is_dir():   # the kernels this node kept from an earlier run: no compile to wait for
        shutil.copytree(kept, home / "kernels")
    # the server's output goes to a file, never a pipe: a pipe nobody drains fills and stops the server mid-run
    serve_log = serve_log_dir / f"serve-{model_dir.name}{'' if overlap else '-serial'}.log"
    with serve_log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "serve", str(Path(__file__).parent / "serve_app.py"), "--port", "0"],
            env=os.environ | {"EMBER_HOME": str(home), "EMBER_BENCH_MODEL": str(model_dir),
                              "EMBER_BENCH_OVERLAP": "1" if overlap else "0",
                              "EMBER_BENCH_DEVICE_WAIT": device_wait or ""},
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)

    def stop(signum, frame):   # `timeout` ends this bench: the server (its own session) goes with it
        os.killpg(process.pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        url = serving_url(process, serve_log)
        from ember.gateway.keys import KeyStore

        verify = ssl.create_default_context(cafile=str(home / "tls" / "ca.pem"))
        key = KeyStore(home / "ember.db").create("speed")[1]
        name = model_dir.name
        prompts = random_prompts(requests_per_level, 256, 256, seed=4)
        with httpx.Client(base_url=url, verify=verify, headers={"Authorization": f"Bearer {key}"},
                          timeout=httpx.Timeout(30, read=300)) as http:
            began = time.monotonic()
            log(f"  online: {url} serving; waiting for its replica (a full boot: kernels compile on a fresh home)")
            said = began
            while (reply := http.get("/speed/v1/models")).status_code != 200:   # the replica is up once this answers
                if reply.status_code == 503 and "replica_failed" in reply.text:   # its start failed: say why, now
                    raise RuntimeError(f"the bench's replica failed to start: {reply.text[:2000]}")
                if time.monotonic() - began > 600:
                    raise RuntimeError("the replica did not come up within 600 s")
                if time.monotonic() - said >= 15:
                    said = time.monotonic()
                    log(f"  online: still waiting for the replica ({said - began:.0f} s; {reply.status_code})")
                time.sleep(1)
            log(f"  online: replica up in {time.monotonic() - began:.1f} s")

            def level_of(prompts: list[list[int]], concurrency: int) -> tuple[list, float]:
                body = {"model": name, "max_tokens": 128, "ignore_eos": True, "temperature": 0}
                return load_client.stream(url, "/speed/v1/completions", body, prompts, concurrency,
                                          {"Authorization": f"Bearer {key}"}, str(home / "tls" / "ca.pem"))

            began = time.monotonic()
            first = level_of(prompts[:1], 1)[0][0]   # warm-up: the replica's first decode steps capture their graphs
            log(f"  online: warm-up request done in {time.monotonic() - began:.1f} s (TTFT {first[0]:.2f} s)")
            # an idle replica captures the graphs it has not used yet (decode sizes, then the prefill graphs): a
            # replica that served before has them; the levels measure that, not the first minute of a new one
            time.sleep(settle)
            rows = []
            for level in concurrency:
                before = cpu_seconds(process.pid)
                loops_before = main_thread_cpu_seconds(pid for pid in before if pid != process.pid)
                steps_before = engine_steps(http)
                results, elapsed = level_of(prompts[:max(level * 4, 16)], level)
                used = {pid: seconds - before.get(pid, 0.0) for pid, seconds in cpu_seconds(process.pid).items()}
                loops = {pid: seconds - loops_before.get(pid, 0.0)
                         for pid, seconds in main_thread_cpu_seconds(pid for pid in used if pid != process.pid).items()}
                steps = {key: value - steps_before.get(key, 0.0) for key, value in engine_steps(http).items()}
                tokens = len(results) * 128
                ttft = sorted(r[0] for r in results)
                itl = sorted(x for r in results for x in r[1])
                rows.append({"concurrency": level, "requests": len(results),
                             "output_tok_s": round(len(results) * 128 / elapsed, 1),
                             "ttft_ms_p50": round(1000 * _pct(ttft, 50), 1),
                             "ttft_ms_p99": round(1000 * _pct(ttft, 99), 1),
                             "itl_ms_p50": round(1000 * _pct(itl, 50), 2),
                             "itl_ms_p99": round(1000 * _pct(itl, 99), 2),
                             # host CPU per streamed token: the gateway (one process: its ceiling is about
                             # 1e6 / this tok/s) and the rest of `ember serve`'s processes (replica, fork server)
                             "gateway_cpu_us_per_token": round(1e6 * used.get(process.pid, 0.0) / tokens, 1),
                             "replica_cpu_us_per_token": round(
                                 1e6 * (sum(used.values()) - used.get(process.pid, 0.0)) / tokens, 1),
                             # of which the main threads (the replica's event loop); the rest is mostly the step
                             # loop, whose wait for each step's tokens is CUDA's spin-wait: about a core throughout
                             "replica_loop_cpu_us_per_token": round(1e6 * sum(loops.values()) / tokens, 1),
                             # the replica's forward passes in the level: replayed decode graphs, steps that
                             # prefilled through the piecewise graphs, and eager ones (prefills no piecewise size
                             # fits, and the decode steps such a prefill joined), with GPU ms each
                             **step_split(steps)})
                log("  online", rows[-1])
        return rows
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(home, ignore_errors=True)


def engine_steps(http) -> dict[tuple[str, str], float]:
    """The served engine's step counters, from the gateway's /metrics: {(series, kind): value}. The gateway
    reuses a replica's scrape for a second, so this waits that long first."""
    time.sleep(1.1)
    totals: dict[tuple[str, str], float] = {}
    for line in http.get("/metrics").text.splitlines():
        for series in ("ember:engine_steps_total", "ember:engine_step_device_seconds_total"):
            if line.startswith(series + "{") and 'kind="' in line:
                kind = line.split('kind="', 1)[1].split('"', 1)[0]
                totals[series, kind] = totals.get((series, kind), 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def streams(text: str) -> int:
    """A --concurrency level: streams in flight, 1 to 4,096."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"want a whole number of streams from 1 to 4,096, got {text!r}")
    return value


def step_split(steps: dict[tuple[str, str], float]) -> dict:
    """Steps by kind over a load level, and each kind's mean GPU milliseconds."""
    row = {}
    for kind in ("graph", "piecewise", "eager"):
        count = steps.get(("ember:engine_steps_total", kind), 0.0)
        row[f"{kind}_steps"] = int(count)
        device = steps.get(("ember:engine_step_device_seconds_total", kind), 0.0)
        if count and device:   # none measured on a CPU
            row[f"{kind}_step_gpu_ms"] = round(1000 * device / count, 2)
    return row


def wait_gpu_memory(free: int, timeout: float = 120) -> None:
    """Until the GPU has `free` bytes free again (within 1 GiB): the served replica's processes have exited."""
    deadline = time.monotonic() + timeout
    while torch.cuda.mem_get_info()[0] < free - (1 << 30):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the served replica's GPU memory did not come back within {timeout:g} s "
                               f"({torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB free, {free / 2**30:.1f} before)")
        time.sleep(0.5)


def _pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def model_directory(workdir: Path, shape: str, keep_model: bool = False):
    """The random-weight model of `shape` in `workdir`, built there unless an earlier run left it; with
    `keep_model`, also (directory, the transformers model on the GPU) as built, or None when it was there."""
    model_dir = workdir / f"qwen3-{shape.lower()}-random"
    model = None
    if not (model_dir / "config.json").is_file():
        model = build_model(shape, model_dir)
    if keep_model:
        return model_dir, model
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return model_dir


def saved_weight_bytes(model_dir: Path) -> int:
    """Bytes of the tensors in the model's safetensors files (each file less its header)."""
    total = 0
    for file in model_dir.glob("*.safetensors"):
        with open(file, "rb") as f:
            total += file.stat().st_size - 8 - struct.unpack("<Q", f.read(8))[0]
    return total


def host_loop_ms() -> float:
    """The host's speed now: the median of three runs of a fixed pure-Python loop, in ms. The device machine's CPU
    moves by up to ~2x from one minute to the next (session 39: 104 to 252 ms in one process), and every host-bound
    number (batch-1 host time, eager steps, the online rows' replica CPU) moves with it."""
    times = []
    for _ in range(3):
        began = time.perf_counter()
        sum(i * i for i in range(HOST_LOOP))
        times.append(time.perf_counter() - began)
    return round(statistics.median(times) * 1e3, 1)


HOST_LOOP = 1_000_000   # iterations of host_loop_ms's loop (~50-130 ms on the device machine)


def measure(shape: str, args, bandwidth: float, workdir: Path) -> dict:
    began = time.perf_counter()
    model_dir, hf = model_directory(workdir, shape, keep_model=True)
    weight_bytes = saved_weight_bytes(model_dir)
    row = {"name": f"Qwen3-{shape} shape (random weights)", "weight_bytes": weight_bytes,
           "roofline_b1_tok_s": round(bandwidth / weight_bytes, 1),
           "host_loop_ms": [host_loop_ms()]}   # and again at the end: how fast the host was around this row
    if args.device_wait:
        row["device_wait"] = args.device_wait
    log(f"[{shape}] built in {time.perf_counter() - began:.1f} s, {weight_bytes / 1e9:.2f} GB; roofline "
        f"{row['roofline_b1_tok_s']} tok/s")
    b1_prompt = random_prompts(1, 128, 128, seed=1)[0]
    g = torch.Generator().manual_seed(0)
    prompts = random_prompts(args.offline_requests, 100, 1024, seed=0)
    output_lens = torch.randint(100, 1025, (args.offline_requests,), generator=g).tolist()
    floor = offline_floor(model_dir, weight_bytes, [len(p) for p in prompts], output_lens, bandwidth, args.flops)
    row["offline_floor_s"] = round(floor, 2)
    row["offline_floor_output_tok_s"] = round(sum(output_lens) / floor, 1)
    bound = offline_bound(model_dir, weight_bytes, [len(p) for p in prompts], output_lens, bandwidth, args.flops)
    row["offline_bound_output_tok_s"] = round(sum(output_lens) / bound, 1)
    log(f"[{shape}] offline floor: {floor:.2f} s = {row['offline_floor_output_tok_s']} output tok/s at "
        f"{bandwidth / 1e9:.0f} GB/s and {args.flops / 1e12:.0f} TFLOPS; no engine beats "
        f"{row['offline_bound_output_tok_s']} (every product overlapping every read)")
    args.checkpoint(row)
    if "transformers" in args.parts:
        from transformers import Qwen3ForCausalLM

        if hf is None:   # a model an earlier run left: loaded straight onto the GPU
            hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda").eval()
        row["transformers_b1_tok_s"] = round(hf_batch1(hf, b1_prompt, args.hf_b1_tokens), 1)
        log(f"[{shape}] transformers batch 1 ({args.hf_b1_tokens} tokens): {row['transformers_b1_tok_s']} tok/s")
        if args.hf_offline_requests:
            hf_prompts = prompts[:args.hf_offline_requests]
            new_tokens = args.hf_offline_tokens or round(statistics.mean(output_lens))
            rate, how = hf_offline(hf, hf_prompts, new_tokens)
            row["transformers_offline_output_tok_s"] = round(rate, 1)
            row["transformers_offline_method"] = f"{how} on {len(hf_prompts)} requests of {new_tokens} tokens"
            log(f"[{shape}] transformers offline: {rate:.1f} output tok/s ({how})")
        args.checkpoint(row)
    hf = None   # its GPU memory goes before the engine sizes its KV cache
    gc.collect()
    torch.cuda.empty_cache()
    if "online" in args.parts:   # first: an engine in this process keeps its GPU memory until the process ends
        for overlap in OVERLAP_MODES[args.overlap]:
            free = torch.cuda.mem_get_info()[0]
            row["online" if overlap else "online_serial"] = online(model_dir, tuple(args.concurrency),
                                                                  args.online_requests, overlap,
                                                                  device_wait=args.device_wait)
            args.checkpoint(row)
            wait_gpu_memory(free)
    if args.parts & {"b1", "offline", "b64", "offline-defaults"}:
        for overlap in OVERLAP_MODES[args.overlap]:
            ember_parts(row, shape, model_dir, args, b1_prompt, prompts, output_lens, overlap)
    for part in ("fp8", "fp8_kv"):
        if part in args.parts:
            ember_fp8(row, shape, model_dir, args, b1_prompt, prompts, output_lens, bandwidth, part == "fp8_kv")
    if "skewed" in args.parts:
        # Ember's decode attention (as configured) and, unless --streamed-decode chose one, flashinfer's beside it
        kernels = [("", args.streamed_decode)] + ([("flashinfer_", 0)] if args.streamed_decode is None else [])
        runs = {}
        for prefix, streamed in kernels:
            eng = ember_engine(model_dir, max_num_seqs=256, streamed_decode=streamed, device_wait=args.device_wait,
                               max_model_len=max(max(lens) for lens in SKEWED.values()) + SKEWED_TOKENS)
            while eng.capture_idle():   # as offline: the graphs an engine that has been up holds
                pass
            runs[prefix] = ember_skewed(eng, model_dir, weight_bytes, bandwidth, args.flops)
            eng.close()
            del eng
            gc.collect()
            torch.cuda.empty_cache()
        row["skewed"] = [dict(first, **{prefix + key: other[key] for prefix, rows in runs.items() if prefix
                                        for other in [rows[i]] for key in SKEWED_MEASURED})
                         for i, first in enumerate(runs[""])]
        log(f"[{shape}] ember skewed batches: {row['skewed']}")
        args.checkpoint(row)
    row["host_loop_ms"].append(host_loop_ms())
    if not args.workdir:   # a model in a given --workdir stays for the next run
        shutil.rmtree(model_dir, ignore_errors=True)
    return row


def ember_parts(row: dict, shape: str, model_dir: Path, args, b1_prompt: list[int], prompts: list[list[int]],
                output_lens: list[int], overlap: bool) -> None:
    """Ember's batch-1, offline and batch-64 parts into `row`; without overlap, each field named with "_serial"."""
    suffix, label = ("", "") if overlap else ("_serial", " (serial)")
    # this process's engine, unless every part it would run goes to fresh processes
    if args.parts & {"b1", "offline"} or ("b64" in args.parts and not args.b64_processes):
        began = time.perf_counter()
        eng = ember_engine(model_dir, max_num_seqs=256, overlap=overlap, streamed_decode=args.streamed_decode,
                           device_wait=args.device_wait)
        if args.streamed_decode is not None:
            row["streamed_decode_min_batch"] = args.streamed_decode
        row[f"ember_start_phases_s{suffix}"] = {k: round(v, 3) for k, v in eng.runner.start_phases.items()}
        log(f"[{shape}] ember engine{label} up in {time.perf_counter() - began:.1f} s: "
            f"{row[f'ember_start_phases_s{suffix}']}")
        if "b1" in args.parts:
            b1 = row[f"ember_b1_tok_s{suffix}"] = round(ember_batch1(eng, b1_prompt, 256), 1)
            log(f"[{shape}] ember batch 1{label}: {b1} tok/s ({b1 / row['roofline_b1_tok_s']:.0%} of roofline)")
            args.checkpoint(row)
        if "offline" in args.parts:
            rate, split = ember_offline(eng, prompts, output_lens)
            row[f"offline_output_tok_s{suffix}"], row[f"offline_time_split{suffix}"] = round(rate, 1), split
            log(f"[{shape}] ember offline{label}: {round(rate, 1)} output tok/s; {split}")
            args.checkpoint(row)
        if "b64" in args.parts and not args.b64_processes:
            host, gpu, wall, launch = ember_host_vs_gpu(eng)
            b64_row(row, shape, suffix, label, [{"host_ms": host, "gpu_ms": gpu, "wall_ms": wall, "launch_ms": launch}])
            args.checkpoint(row)
        # its weights, KV cache and graphs freed now: the next engine (here or in a process) sizes by what is free
        eng.close()
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    if "b64" in args.parts and args.b64_processes:   # each process needs the GPU memory this one's engine freed
        runs = []
        for i in range(args.b64_processes):
            runs.append(b64_in_fresh_process(model_dir, overlap=overlap, streamed_decode=args.streamed_decode,
                                             device_wait=args.device_wait))
            log(f"[{shape}] batch 64 decode step{label}, process {i + 1} of {args.b64_processes}: host "
                f"{runs[-1]['host_ms']:.3f} ms, GPU {runs[-1]['gpu_ms']:.3f} ms")
        b64_row(row, shape, suffix, label, runs)
        args.checkpoint(row)
    if "offline-defaults" in args.parts:  # the same run with EngineConfig's defaults for the batch sizes
        eng = ember_engine(model_dir, overlap=overlap, device_wait=args.device_wait)
        rate, split = ember_offline(eng, prompts, output_lens)
        row[f"offline_defaults_output_tok_s{suffix}"] = round(rate, 1)
        row[f"offline_defaults_time_split{suffix}"] = split
        row["offline_defaults"] = {"max_num_seqs": eng.config.max_num_seqs,
                                   "max_num_batched_tokens": eng.config.max_num_batched_tokens}
        log(f"[{shape}] ember offline{label}, default batch sizes {row['offline_defaults']}: "
            f"{round(rate, 1)} output tok/s; {split}")
        eng.close()
        del eng
        gc.collect()
        torch.cuda.empty_cache()


def ember_fp8(row: dict, shape: str, model_dir: Path, args, b1_prompt: list[int], prompts: list[list[int]],
              output_lens: list[int], bandwidth: float, kv: bool = False) -> None:
    """Batch 1 and offline with FP8 weights (EngineConfig(quantization="fp8"), the batch sizes of ember_parts),
    into row["fp8"], or with `kv` an FP8 KV cache besides (kv_cache_dtype="fp8"), into row["fp8_kv"]: batch 1
    against the roofline of the FP8 model's bytes, offline against the floor at the FP8 product rate measured in
    this run."""
    name = "fp8_kv" if kv else "fp8"
    eng = ember_engine(model_dir, max_num_seqs=256, device_wait=args.device_wait, quantization="fp8",
                       kv_cache_dtype="fp8" if kv else "auto")
    weight_bytes = sum(p.nbytes for p in dict.fromkeys(eng.runner.model.parameters()))
    floor = offline_floor(model_dir, row["weight_bytes"], [len(p) for p in prompts], output_lens, bandwidth,
                          args.fp8_flops, fp8=True, fp8_kv=kv)
    fp8 = row[name] = {"weight_bytes": weight_bytes, "roofline_b1_tok_s": round(bandwidth / weight_bytes, 1),
                       "offline_floor_output_tok_s": round(sum(output_lens) / floor, 1),
                       "kv_blocks": eng.runner.num_blocks,
                       "ember_start_phases_s": {k: round(v, 3) for k, v in eng.runner.start_phases.items()}}
    log(f"[{shape}] ember {name} engine up: {weight_bytes / 1e9:.2f} GB of weights, {eng.runner.num_blocks} KV "
        f"blocks, roofline {fp8['roofline_b1_tok_s']} tok/s, offline floor {fp8['offline_floor_output_tok_s']} "
        "output tok/s")
    fp8["ember_b1_tok_s"] = round(ember_batch1(eng, b1_prompt, 256), 1)
    log(f"[{shape}] ember {name} batch 1: {fp8['ember_b1_tok_s']} tok/s "
        f"({fp8['ember_b1_tok_s'] / fp8['roofline_b1_tok_s']:.0%} of its roofline)")
    args.checkpoint(row)
    rate, fp8["offline_time_split"] = ember_offline(eng, prompts, output_lens)
    fp8["offline_output_tok_s"] = round(rate, 1)
    log(f"[{shape}] ember {name} offline: {fp8['offline_output_tok_s']} output tok/s "
        f"({rate / fp8['offline_floor_output_tok_s']:.0%} of its floor); {fp8['offline_time_split']}")
    args.checkpoint(row)
    eng.close()
    del eng
    gc.collect()
    torch.cuda.empty_cache()


def b64_row(row: dict, shape: str, suffix: str, label: str, runs: list[dict]) -> None:
    """The b64 fields of `row`: each the median over `runs` (one per process), the runs kept when several."""
    host, gpu, wall = (statistics.median(r[key] for r in runs) for key in ("host_ms", "gpu_ms", "wall_ms"))
    launch = {k: round(statistics.median(r["launch_ms"][k] for r in runs), 3) for k in runs[0]["launch_ms"]}
    row[f"host_ms_per_step_b64{suffix}"], row[f"gpu_ms_per_step_b64{suffix}"] = round(host, 3), round(gpu, 3)
    row[f"wall_ms_per_step_b64{suffix}"], row[f"launch_ms_b64{suffix}"] = round(wall, 3), launch
    if len(runs) > 1:
        row[f"b64_runs{suffix}"] = [{k: round(r[k], 3) for k in ("host_ms", "gpu_ms", "wall_ms")} for r in runs]
    log(f"[{shape}] batch 64 decode step{label}: host {host:.3f} ms, GPU {gpu:.3f} ms ({host / gpu:.1%}), "
        f"wall {wall:.3f} ms; launch {launch}" + (f" (medians of {len(runs)} processes)" if len(runs) > 1 else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["8B", "4B", "0.6B"], choices=list(SHAPES))
    parser.add_argument("--offline-requests", type=int, default=256)
    parser.add_argument("--hf-offline-requests", type=int, default=16, help="0 skips transformers' offline run")
    parser.add_argument("--hf-offline-tokens", type=int, default=128,
                        help="tokens each of transformers' offline requests generates (0: the workload's mean output "
                             "length, ~560, which took transformers over 230 s on the H200); its KV cache stays "
                             "shorter than the workload's, so its rate is if anything flattered")
    parser.add_argument("--hf-b1-tokens", type=int, default=256,
                        help="tokens transformers decodes at batch 1 (its rate is steady; fewer save minutes)")
    parser.add_argument("--online-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=streams, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--skip-online", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--workdir", default=None,
                        help="where model directories are written and kept, and reused when present (default: a "
                             "temp dir, removed)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {','.join(PARTS)} (default all): a run that must end within a "
                             "time limit measures some, and --merge joins the runs")
    parser.add_argument("--overlap", choices=tuple(OVERLAP_MODES), default="on",
                        help="Ember's parts with EngineConfig(overlap=...): 'on' (the default config), 'off' names "
                             "their fields with a '_serial' suffix (ember_b1_tok_s_serial, ...), 'both' measures "
                             "each twice, side by "
                             "side")
    parser.add_argument("--streamed-decode", type=int, metavar="N",
                        help="Ember's b1, offline and b64 parts with EngineConfig(streamed_decode_min_batch=N): decode "
                             "graphs of N or more sequences run paged_decode's streamed attention; 0: flashinfer's "
                             "decode kernel at every batch size (online keeps the default)")
    parser.add_argument("--device-wait", choices=("block", "spin"),
                        help="every Ember part with EngineConfig(device_wait=...), named in the row as device_wait "
                             "(default: the config's default, unnamed)")
    parser.add_argument("--b64-processes", type=int, default=3, metavar="N",
                        help="the b64 part's medians over N fresh processes, each its own engine (one process's host "
                             "time moves up to 2x between processes on the H200 machine); 0: in this process's "
                             "engine, after b1 and offline")
    parser.add_argument("--record", action="store_true", help="write bench/results/engine_speed.json")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where --record writes engine_speed.json (and, for bench/results, the SVG and README)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="no measuring: join the models and parts of these recorded runs (a later file's "
                             "numbers win) into --results (bench/results/engine_speed.json, its SVG and README)")
    args = parser.parse_args()
    if args.merge:
        record(merge(args.merge), args.results)
        return
    args.parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    if args.b64_processes < 0:
        parser.error(f"--b64-processes {args.b64_processes}: give 0 (this process) or more")
    if args.parts - set(PARTS):
        parser.error(f"--parts: {sorted(args.parts - set(PARTS))} unknown; use some of {','.join(PARTS)}")
    if args.skip_online:
        args.parts.discard("online")
    if args.skip_transformers:
        args.parts.discard("transformers")
    import transformers

    bandwidth = copy_bandwidth()
    args.flops = matmul_rate()
    args.fp8_flops = matmul_rate(fp8=True) if args.parts & {"fp8", "fp8_kv"} else None
    log(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s, bf16 products {args.flops / 1e12:.0f} TFLOPS"
        + (f", FP8 products {args.fp8_flops / 1e12:.0f} TFLOPS" if args.fp8_flops else ""))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ember-speed-models-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    result = {"machine": f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores, {platform.machine()}; "
                         f"torch {torch.__version__}, transformers {transformers.__version__}",
              "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "matmul_tflops": round(args.flops / 1e12, 1),
              "models": rows}
    if args.fp8_flops:
        result["fp8_matmul_tflops"] = round(args.fp8_flops / 1e12, 1)

    def checkpoint(row: dict) -> None:
        """With --record, what the run has measured so far, after every part: a run cut short keeps it."""
        if args.record:
            args.results.mkdir(parents=True, exist_ok=True)
            partial = {**result, "models": [*rows, row] if row not in rows else rows}
            (args.results / PARTIAL).write_text(json.dumps(partial, indent=1) + "\n")

    args.checkpoint = checkpoint
    for shape in args.models:
        rows.append(measure(shape, args, bandwidth, workdir))
    print(json.dumps(result, indent=1))
    if args.record:
        record(result, args.results)
        (args.results / PARTIAL).unlink(missing_ok=True)


PARTIAL = "engine_speed.partial.json"   # --record's checkpoint of a run in progress (bench/results ignores it)
PARTS = ("transformers", "b1", "offline", "b64", "offline-defaults", "online", "skewed", "fp8", "fp8_kv")
# fp8: batch 1 and offline again with EngineConfig(quantization="fp8"), into the row's "fp8" field; fp8_kv: the same
# with kv_cache_dtype="fp8" besides, into "fp8_kv"
# skewed: long prompts among short ones, decoded together (one program per sequence left a long context's KV to a
# few programs, session 35); each request decodes SKEWED_TOKENS tokens
SKEWED = {"one 16,384-token prompt among 63 of 512": [16384] + [512] * 63,
          "8 of 8,192 among 120 of 600": [8192] * 8 + [600] * 120}
SKEWED_TOKENS = 256
SKEWED_MEASURED = ("output_tok_s", "decode_gpu_ms_per_step")   # per kernel, the rest per workload
OVERLAP_MODES = {"on": [True], "off": [False], "both": [True, False]}


def merge(files: list[Path]) -> dict:
    """One result from several runs' engine_speed.json: each model's fields from every run that measured them, a
    later run's winning; the machines named once each."""
    models: dict[str, dict] = {}
    machines: list[str] = []
    bandwidth = flops = note = None
    for file in files:
        run = json.loads(file.read_text())
        machines += [run["machine"]] if run["machine"] not in machines else []
        bandwidth = run.get("copy_bandwidth_gb_s", bandwidth)
        flops = run.get("matmul_tflops", flops)
        note = run.get("note", note)   # the recorded summary's paragraph
        for model in run["models"]:
            models.setdefault(model["name"], {}).update(model)
    order = {f"Qwen3-{shape} shape (random weights)": i for i, shape in enumerate(SHAPES)}
    return {"machine": "; ".join(machines), "copy_bandwidth_gb_s": bandwidth, "matmul_tflops": flops,
            "models": sorted(models.values(), key=lambda m: order.get(m["name"], len(order))),
            **({"note": note} if note is not None else {})}


def record(result: dict, results: Path = RESULTS) -> None:
    """engine_speed.json in `results`; for bench/results also a bar chart of batch-1 decode (SVG) and the summary
    in bench/README.md."""
    results.mkdir(parents=True, exist_ok=True)
    (results / "engine_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    if results.resolve() != RESULTS.resolve():
        return
    (RESULTS / "engine_speed_b1.svg").write_text(bar_chart(result["models"]))
    has_online = any(m.get("online") for m in result["models"])
    if has_online:
        (RESULTS / "engine_speed_online.svg").write_text(online_chart(result["models"]))
    rows = ["| model | weights GB | roofline b1 tok/s | Ember b1 tok/s | transformers b1 tok/s "
            "| Ember offline out tok/s (at default batch sizes) | offline floor out tok/s (bound) "
            "| transformers offline out tok/s | host / GPU ms per step at b64 |",
            "|---" * 9 + "|"]
    for m in result["models"]:
        b1 = m.get("ember_b1_tok_s")
        b1_text = f"{b1} ({b1 / m['roofline_b1_tok_s']:.0%})" if b1 else "-"
        if "ember_b1_tok_s_serial" in m:
            b1_text += f"; serial steps {m['ember_b1_tok_s_serial']}"
        rows.append(f"| {m['name']} | {m['weight_bytes'] / 1e9:.2f} | {m['roofline_b1_tok_s']} | {b1_text} | "
                    f"{m.get('transformers_b1_tok_s') or '-'} | {m.get('offline_output_tok_s') or '-'} "
                    f"({m.get('offline_defaults_output_tok_s') or '-'}) | "
                    f"{m.get('offline_floor_output_tok_s') or '-'}"
                    + (f" ({m['offline_bound_output_tok_s']})" if "offline_bound_output_tok_s" in m else "") + " | "
                    f"{m.get('transformers_offline_output_tok_s') or '-'} | "
                    f"{m.get('host_ms_per_step_b64', '-')} / {m.get('gpu_ms_per_step_b64', '-')}"
                    + (f"; step wall {m.get('wall_ms_per_step_b64', '-')} against "
                       f"{m['wall_ms_per_step_b64_serial']} serial" if "wall_ms_per_step_b64_serial" in m else "")
                    + " |")
    online = [f"| {m['name']}{label} | {o['concurrency']} | {o['output_tok_s']} | {o['ttft_ms_p50']} / "
              f"{o['ttft_ms_p99']} | {o['itl_ms_p50']} / {o['itl_ms_p99']} | "
              f"{o.get('gateway_cpu_us_per_token', '-')} / {o.get('replica_cpu_us_per_token', '-')}"
              + (f" ({o['replica_loop_cpu_us_per_token']})" if "replica_loop_cpu_us_per_token" in o else "") + " |"
              for m in result["models"]
              for key, label in (("online", ""), ("online_serial", " (serial steps)")) for o in m.get(key, [])]
    products = f", bf16 products {result['matmul_tflops']} TFLOPS" if result.get("matmul_tflops") else ""
    section = "\n".join([
        MARK_BEGIN, "## Engine speed (`bench/engine/speed.py --record`)", "", f"Machine: {result['machine']}; "
        f"device copy bandwidth {result['copy_bandwidth_gb_s']} GB/s{products}.",
        *([result["note"], ""] if "note" in result else [""]),
        *rows, "", "![batch-1 decode against the roofline](results/engine_speed_b1.svg)", "",
        *(["| model | concurrency | output tok/s | TTFT ms p50 / p99 | ITL ms p50 / p99 | host CPU us/token: gateway "
            "/ the rest (of it, the replica's event loop, where measured) |", "|---" * 6 + "|", *online, "",
            "![online output tok/s by concurrency](results/engine_speed_online.svg)"]
          if online else ["Online serving: not measured in this run."]), *skewed_rows(result["models"]), MARK_END])
    readme = ROOT / "bench" / "README.md"
    text = readme.read_text() if readme.exists() else "# Benchmarks\n\n"
    if MARK_BEGIN in text:
        text = text[:text.index(MARK_BEGIN)] + section + text[text.index(MARK_END) + len(MARK_END):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    readme.write_text(text)


MARK_BEGIN, MARK_END = "<!-- engine-speed:begin -->", "<!-- engine-speed:end -->"


def skewed_rows(models: list[dict]) -> list[str]:
    """The skewed part's table (README lines, a blank line first), or none where no model measured it."""
    rows = [f"| {m['name']} | {s['workload']} | {s['output_tok_s']} | {s.get('flashinfer_output_tok_s', '-')} | "
            f"{s['decode_gpu_ms_per_step']} / {s.get('flashinfer_decode_gpu_ms_per_step', '-')} / "
            f"{s['decode_floor_ms_per_step']} |" for m in models for s in m.get("skewed", [])]
    if not rows:
        return []
    return ["", "Long prompts among short ones, decoded together (the skewed part, 256 tokens each):", "",
            "| model | workload | output tok/s | with flashinfer's decode attention | decode step GPU ms: Ember / "
            "flashinfer's / floor |", "|---" * 5 + "|", *rows]


def bar_chart(models: list[dict]) -> str:
    """Horizontal bars per model: the roofline, Ember and transformers at batch 1 (tok/s), as a plain SVG."""
    series = [("roofline", "roofline_b1_tok_s", "#bbbbbb"), ("Ember", "ember_b1_tok_s", "#d9534f"),
              ("transformers", "transformers_b1_tok_s", "#5b8def")]
    top = max(m["roofline_b1_tok_s"] for m in models)
    bars, y = [], 10
    for m in models:
        bars.append(f'<text x="5" y="{y + 12}" font-size="12">{m["name"]}</text>')
        y += 18
        for label, key, color in series:
            if key in m:
                width = 400 * m[key] / top
                bars.append(f'<rect x="110" y="{y}" width="{width:.1f}" height="14" fill="{color}"/>'
                            f'<text x="5" y="{y + 11}" font-size="11">{label}</text>'
                            f'<text x="{115 + width:.1f}" y="{y + 11}" font-size="11">{m[key]} tok/s</text>')
                y += 18
        y += 8
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="620" height="{y}" font-family="sans-serif">'
            + "".join(bars) + "</svg>\n")


def online_chart(models: list[dict]) -> str:
    """Online output tok/s against concurrency (the levels evenly spaced), a line per model, and dashed the rate the
    engine's batch-64 decode step allows in-process (64 tokens per step), as a plain SVG."""
    colors = ["#d9534f", "#5b8def", "#5cb85c", "#f0ad4e"]
    served = [m for m in models if m.get("online")]
    levels = sorted({o["concurrency"] for m in served for o in m["online"]})
    ceilings = {m["name"]: 64e3 / m["gpu_ms_per_step_b64"] for m in served if m.get("gpu_ms_per_step_b64")}
    top = max([o["output_tok_s"] for m in served for o in m["online"]] + list(ceilings.values()))
    left, width, height = 60, 440, 240

    def x(level: int) -> float:
        return left + width * levels.index(level) / max(1, len(levels) - 1)

    def y(rate: float) -> float:
        return 20 + height * (1 - rate / top)

    parts = [f'<line x1="{left}" y1="{20 + height}" x2="{left + width}" y2="{20 + height}" stroke="#888"/>',
             f'<line x1="{left}" y1="20" x2="{left}" y2="{20 + height}" stroke="#888"/>']
    parts += [f'<text x="{x(c) - 6:.1f}" y="{height + 38}" font-size="11">{c}</text>' for c in levels]
    parts.append(f'<text x="{left + width / 2 - 40:.1f}" y="{height + 54}" font-size="11">concurrency</text>')
    for tick in range(0, int(top) + 1, max(1000, int(top / 5) // 1000 * 1000)):
        parts.append(f'<text x="5" y="{y(tick) + 4:.1f}" font-size="11">{tick}</text>')
    for i, m in enumerate(served):
        color = colors[i % len(colors)]
        points = " ".join(f"{x(o['concurrency']):.1f},{y(o['output_tok_s']):.1f}" for o in m["online"])
        parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        label_y = 20 + height + 72 + 16 * i
        parts.append(f'<rect x="{left}" y="{label_y - 9}" width="12" height="3" fill="{color}"/>'
                     f'<text x="{left + 18}" y="{label_y}" font-size="11">{m["name"]}: output tok/s served'
                     + (f"; dashed: its batch-64 step in-process ({ceilings[m['name']]:.0f})" if m["name"] in ceilings
                        else "") + "</text>")
        if m["name"] in ceilings:
            parts.append(f'<line x1="{left}" y1="{y(ceilings[m["name"]]):.1f}" x2="{left + width}" '
                         f'y2="{y(ceilings[m["name"]]):.1f}" stroke="{color}" stroke-dasharray="4 3"/>')
    total = 20 + height + 72 + 16 * len(served)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="620" height="{total}" font-family="sans-serif">'
            + "".join(parts) + "</svg>\n")


if __name__ == "__main__":
    main()
