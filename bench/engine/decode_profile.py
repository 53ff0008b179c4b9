"""Where a batch-1 decode step's time goes, against the floor of reading every weight once.

    python bench/engine/decode_profile.py --models 8B [--workdir DIR]
    python bench/engine/decode_profile.py --models 8B --batch 128 --context 768 [--streamed-decode 16] [--host]
    python bench/engine/decode_profile.py --models 8B --prefill 8192 --context 585

On a random-weight model of a Qwen3 shape (bench/engine/speed.py builds it; a model already in --workdir is
reused) this prints, side by side:
  - the floor: the weight bytes a step reads (all but an untied embedding, of which it gathers its tokens' rows)
    over the device copy bandwidth measured here;
  - the engine's step (wall) split into schedule / prepare (inputs + attention plan) / GPU wait / postprocess,
    and the GPU time of one decode graph replayed back to back (no host in between);
  - each weight shape's product at batch 1 (x[1, in] @ W.T, replayed in a CUDA graph) in GB/s, also for the
    merged QKV and gate_up shapes;
  - torch.profiler's kernel table of a few engine steps: which kernels the GPU time goes to, and the host ops.
With --batch N, only the last, for decode steps of N sequences of about --context tokens each, with the GPU time
summed by kind of kernel (products, attention, the rest) against the step's floor (weights and KV read once).
With --prefill T, only the kernel profile of prefill steps of T tokens (prompts of --context tokens each), by kind
against the floor of their products at the product rate measured here.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import speed  # noqa: E402 - the bench's model builder and engine settings


def log(*args) -> None:
    print(*args, flush=True)


def gpu_ms(fn, repeat: int = 20, rounds: int = 5) -> float:
    """Median milliseconds of `fn`, captured `repeat` times in one CUDA graph so launches do not count."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeat)
    return statistics.median(times)


def products(hf_config, dtype=torch.bfloat16) -> None:
    """Batch-1 products of each weight shape: achieved GB/s of the weight read."""
    h, i, hd = hf_config.hidden_size, hf_config.intermediate_size, 128
    q, kv = hf_config.num_attention_heads * hd, hf_config.num_key_value_heads * hd
    shapes = {"q": (q, h), "k / v": (kv, h), "qkv merged": (q + 2 * kv, h), "o": (h, q), "gate / up": (i, h),
              "gate_up merged": (2 * i, h), "down": (h, i), "lm_head": (hf_config.vocab_size, h)}
    log(f"{'product':16} {'shape':>14} {'us':>8} {'GB/s':>7}")
    for name, (out_f, in_f) in shapes.items():
        w = torch.randn(out_f, in_f, dtype=dtype, device="cuda")
        x = torch.randn(1, in_f, dtype=dtype, device="cuda")
        ms = gpu_ms(lambda x=x, w=w: F.linear(x, w))
        log(f"{name:16} {str((out_f, in_f)):>14} {ms * 1000:8.1f} {w.nbytes / ms / 1e6:7.0f}")


def attention(hf_config, max_model_len: int = 4096) -> None:
    """Decode attention alone, as the graphs run it: flashinfer's graph-safe decode (CUDA cores, and tensor cores
    through its sm90 prefill kernel) against paged_decode's Triton kernels, per batch size and context."""
    log(f"{'batch':>5} {'context':>7} {'flashinfer us':>13} {'fi tensor-core us':>17} {'triton us':>9} "
        f"{'max |triton - fi|':>17}")
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    for batch, context in ((1, 256), (1, 2048), (16, 1024), (64, 512), (256, 1024)):
        attention_case(hf_config, workspace, batch, context, max_model_len)


def attention_case(hf_config, workspace: torch.Tensor, batch: int, context: int, max_model_len: int) -> None:
    import flashinfer

    from ember.runtime.engine import paged_decode

    heads, kv_heads, d, page = hf_config.num_attention_heads, hf_config.num_key_value_heads, 128, 16
    max_blocks = max_model_len // page
    blocks = -(-context // page)
    cache = torch.randn(batch * blocks + 1, 2, page, kv_heads, d, device="cuda").bfloat16()
    tables = torch.randperm(batch * blocks).view(batch, blocks).tolist()
    q = torch.randn(batch, heads + 2 * kv_heads, d, device="cuda").bfloat16()[:, :heads]
    indptr = torch.arange(0, batch * blocks + 1, blocks, dtype=torch.int32)
    indices = torch.tensor(tables, dtype=torch.int32).view(-1)
    last = torch.full((batch,), (context - 1) % page + 1, dtype=torch.int32)

    def buffer(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device="cuda")

    times, outs = [], []
    for tensor_cores in (False, True):
        try:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=buffer(batch + 1), paged_kv_indices_buffer=buffer(batch * max_blocks),
                paged_kv_last_page_len_buffer=buffer(batch), backend="fa3" if tensor_cores else "auto")
            wrapper.plan(indptr, indices, last, heads, kv_heads, d, page, q_data_type=torch.bfloat16,
                         kv_data_type=torch.bfloat16)
            times.append(gpu_ms(lambda w=wrapper: w.run(q, cache)) * 1000)
            outs.append(wrapper.run(q, cache))
        except Exception as e:  # noqa: BLE001 - a variant this flashinfer cannot run is reported, not fatal
            log(f"  flashinfer (tensor cores={tensor_cores}) failed: {e!r}"[:300])
            times.append(float("nan"))
    decode = paged_decode.PagedDecode(batch, max_blocks, page, heads, kv_heads, d, torch.device("cuda"))
    decode.prepare(tables, [context] * batch)
    times.append(gpu_ms(lambda: decode.forward(q, cache, d ** -0.5)) * 1000)
    diff = (decode.forward(q, cache, d ** -0.5).float() - outs[0].float()).abs().max().item() if outs else -1
    log(f"{batch:5} {context:7} {times[0]:13.1f} {times[1]:17.1f} {times[2]:9.1f} {diff:17.4f}")


def step_breakdown(eng, prompt: list[int], steps: int) -> None:
    """Wall time per decode step of one request, split by the engine's phases (median over `steps`)."""
    from ember.runtime.engine.sampling import SamplingParams

    parts: dict[str, list[float]] = {"schedule": [], "run": [], "postprocess": [], "observer": []}
    runs = []

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            out = fn(*args, **kwargs)
            parts[name].append(time.perf_counter() - began)
            if name == "run":
                runs.append(out)
            return out
        return wrapper

    originals = (eng.scheduler.schedule, eng.runner.run, eng._postprocess, eng.observer.stepped)
    eng.scheduler.schedule = timed("schedule", originals[0])
    eng.runner.run = timed("run", originals[1])
    eng._postprocess = timed("postprocess", originals[2])
    eng.observer.stepped = timed("observer", originals[3])
    walls = []
    try:
        eng.add_request("profile", prompt, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
        while eng.has_unfinished_requests():
            began = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - began)
    finally:
        eng.scheduler.schedule, eng.runner.run, eng._postprocess, eng.observer.stepped = originals
    if len(runs) < 2:   # an overlapping engine launches and collects instead (host_profile.py splits those)
        log(f"engine decode step at batch 1 (median of {len(walls) - 1}): wall "
            f"{1000 * statistics.median(walls[1:]):.3f} ms (overlapped: no split by phase)")
        return
    decode = slice(1, None)   # the first step is the prefill
    med = {k: 1000 * statistics.median(v[decode]) for k, v in parts.items()}
    prepare = 1000 * statistics.median(r.prepare_seconds for r in runs[decode])
    wait = 1000 * statistics.median(r.wait_seconds for r in runs[decode])
    gpu = 1000 * statistics.median(r.gpu_seconds for r in runs[decode])
    wall = 1000 * statistics.median(walls[decode])
    log(f"engine decode step at batch 1 (median of {len(walls) - 1}): wall {wall:.3f} ms = schedule "
        f"{med['schedule']:.3f} + run {med['run']:.3f} (prepare {prepare:.3f}, wait {wait:.3f}; GPU events "
        f"{gpu:.3f}) + postprocess {med['postprocess']:.3f} + observer {med['observer']:.3f}")


def graph_only(eng) -> float:
    """GPU ms of the batch-1 decode graph replayed back to back (inputs as last prepared)."""
    graphs = eng.runner.graphs
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graphs.replay(1, 1)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def full_batch(eng, prompts: list[list[int]], name: str) -> list[str]:
    """Starts the prompts' sequences and steps until every one decodes, with every decode graph captured: the steps
    that follow are decode steps of all of them, at one graph size. Their lengths run past any profile (the first
    admitted ones decode while the last prefill, and a shrinking batch would replay other graphs, even capture
    them, inside the profile); `end` aborts them. Returns the request ids."""
    from ember.runtime.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=eng.max_model_len - max(map(len, prompts)), ignore_eos=True)
    ids = [f"{name}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        eng.add_request(request_id, prompt, params)
    while any(seq.num_output_tokens < 3 for seq in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()   # the prefills and a few decode steps outside the trace
    while eng.capture_idle():
        pass
    return ids


def end(eng, ids: list[str]) -> None:
    for request_id in ids:
        eng.abort_request(request_id)
    while eng.has_unfinished_requests():
        eng.step()


def profile(eng, prompts: list[list[int]], steps: int) -> object:
    """The profiler's averages over `steps` decode steps of the prompts' sequences (after their prefill)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ids = full_batch(eng, prompts, "profiled")
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    end(eng, ids)
    table = prof.key_averages()
    log(f"--- GPU time over {steps} decode steps, by kernel ---")
    log(table.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))
    log(f"--- host time over {steps} decode steps, by op ---")
    log(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=90))
    return table


def host_profile(eng, prompts: list[list[int]], steps: int, rows: int = 20) -> None:
    """Python's profile of `steps` engine steps of the prompts' sequences, all decoding: which functions the
    host's share of a step goes to (scheduling, inputs, the plan, launching, the tokens' bookkeeping). The
    profiler slows every Python call, so read the shares, not the milliseconds."""
    import cProfile
    import pstats

    ids = full_batch(eng, prompts, "host")
    profiler = cProfile.Profile()
    began = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        eng.step()
    profiler.disable()
    elapsed = time.perf_counter() - began
    end(eng, ids)
    stats = pstats.Stats(profiler)
    log(f"--- host functions over {steps} decode steps of {len(prompts)} sequences "
        f"({1000 * elapsed / steps:.3f} ms a step under the profiler), by own time ---")
    stats.sort_stats("tottime").print_stats(rows)


KINDS = [("products", ("nvjet", "gemm", "gemv", "cutlass", "splitkreduce", "sm90_xmma", "_small_kernel")),
         ("attention", ("decode", "_split_kernel", "_merge_kernel", "_stream_kernel", "mergestates", "attention")),
         ("sampling", ("argmax", "reduce_kernel", "softmax", "topk", "sort", "sampl"))]


def by_kind(table, steps: int, floor_ms: float) -> None:
    """GPU ms per step by kind of kernel (by name: products, attention, sampling, the rest)."""
    sums: dict[str, float] = {}
    for event in table:
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if not us or event.key.startswith(("aten::", "cuda", "Memcpy", "Memset")) and "kernel" not in event.key:
            continue
        name = event.key.lower()
        kind = next((k for k, needles in KINDS if any(n in name for n in needles)), "other")
        sums[kind] = sums.get(kind, 0.0) + us / 1000 / steps
    total = sum(sums.values())
    if not total:
        log("--- no GPU kernel time in the profile (not on a GPU?) ---")
        return
    log(f"--- GPU ms per decode step by kind (floor {floor_ms:.3f} ms: weights and KV read once) ---")
    for kind, ms in sorted(sums.items(), key=lambda kv: -kv[1]):
        log(f"  {kind:10s} {ms:8.3f} ms  {ms / total:5.1%}")
    log(f"  {'total':10s} {total:8.3f} ms  ({floor_ms / total:.0%} of the floor's speed)")


def prefill_profile(eng, tokens: int, context: int, flops: float, steps: int = 4) -> None:
    """GPU time of prefill steps of `tokens` tokens (prompts of `context` tokens), by kind of kernel, against the
    floor of the step's products at the product rate measured here (2 FLOPs a weight a token, the embedding and
    lm_head left out: a prefill samples one row a sequence)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from ember.runtime.engine.sampling import SamplingParams

    per_step = max(1, tokens // context)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def add(name: str, n: int, seed: int) -> None:
        for i, prompt in enumerate(speed.random_prompts(n, context, context, seed=seed)):
            eng.add_request(f"{name}-{i}", prompt, params)

    add("warm", per_step, 7)
    while eng.has_unfinished_requests():
        eng.step()
    add("prefill", per_step * steps, 8)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        while eng.has_unfinished_requests():
            eng.step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    log(f"--- GPU time over {steps} prefill steps of {per_step} prompts of {context} tokens, by kernel ---")
    log(table.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))
    # the decoder's product weights (by count: FP8 weights are a byte each), the embedding and lm_head left out
    weights = sum(p.numel() for name, p in eng.runner.model.named_parameters()
                  if p.ndim == 2 and "embed" not in name and "lm_head" not in name)
    floor_ms = 1000 * 2 * weights * per_step * context / flops
    log(f"product rate {flops / 1e12:.0f} TFLOPS")
    by_kind(table, steps, floor_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["8B"], choices=list(speed.SHAPES))
    parser.add_argument("--workdir", default=None, help="model directories (reused when present)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1,
                        help="above 1: only the kernel profile, of decode steps with this many sequences")
    parser.add_argument("--context", type=int, default=768, help="with --batch: each sequence's prompt tokens")
    parser.add_argument("--streamed-decode", type=int, metavar="N",
                        help="EngineConfig(streamed_decode_min_batch=N): graphs of N or more run the streamed kernel; "
                             "0: flashinfer's decode kernel at every batch size")
    parser.add_argument("--prefill", type=int, metavar="TOKENS",
                        help="only the kernel profile of prefill steps: prompts of --context tokens, TOKENS a step")
    parser.add_argument("--quantization", choices=["fp8"], default=None, help="EngineConfig(quantization=...)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="EngineConfig(kv_cache_dtype=...)")
    parser.add_argument("--host", action="store_true",
                        help="with --batch: also Python's profile of the host side of the steps, by function")
    args = parser.parse_args()
    bandwidth = speed.copy_bandwidth()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ember-profile-"))
    for shape in args.models:
        model_dir = speed.model_directory(workdir, shape)
        eng = speed.ember_engine(model_dir, max_num_seqs=256, streamed_decode=args.streamed_decode,
                                 quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
        model = eng.runner.model
        weight_bytes = sum(p.nbytes for p in model.parameters())
        embedding = model.model.embed_tokens.weight   # a step gathers its tokens' rows of an untied one
        read_bytes = weight_bytes - (0 if embedding is model.lm_head.weight else embedding.nbytes)
        floor = 1000 * read_bytes / bandwidth
        log(f"[{shape}] weights {weight_bytes / 1e9:.2f} GB, {read_bytes / 1e9:.2f} GB read a step; copy "
            f"{bandwidth / 1e9:.0f} GB/s; weight-read floor {floor:.3f} ms per step ({1000 / floor:.0f} tok/s)")
        if args.prefill:
            prefill_profile(eng, args.prefill, args.context, speed.matmul_rate(fp8=args.quantization == "fp8"))
            del eng
            torch.cuda.empty_cache()
            continue
        if args.batch > 1:
            runner = eng.runner
            kv_bytes = (args.batch * (args.context + 4) * runner.num_layers * 2 * runner.num_kv_heads
                        * runner.model.head_dim * runner.kv_dtype.itemsize)
            steps = min(args.steps, 16)
            table = profile(eng, speed.random_prompts(args.batch, args.context, args.context, seed=5), steps)
            by_kind(table, steps, floor + 1000 * kv_bytes / bandwidth)
            if args.host:
                host_profile(eng, speed.random_prompts(args.batch, args.context, args.context, seed=6), steps)
            while eng.has_unfinished_requests():
                eng.step()
            del eng
            torch.cuda.empty_cache()
            continue
        prompt = speed.random_prompts(1, 128, 128, seed=1)[0]
        step_breakdown(eng, prompt, args.steps)
        ms = graph_only(eng)
        log(f"[{shape}] batch-1 decode graph alone: {ms:.3f} ms GPU ({floor / ms:.0%} of the floor)")
        products(eng.runner.hf_config)
        attention(eng.runner.hf_config)
        profile(eng, [prompt], steps=5)
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
