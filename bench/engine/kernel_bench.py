"""The decode step's kernels against the library kernels they could replace, side by side on one GPU.

    python bench/engine/kernel_bench.py [--parts gemv,fused,decode,attention,silu,norm,gemm,...] [--record]

  - gemv: runtime/engine/gemv.py's Triton product over a sweep of its configurations against F.linear (cuBLAS),
    for the Qwen3-8B shape's products (--gemv-shapes: also the 4B's and 0.6B's) at 1 row (and 2 and 4 with the best
    of 1), each timed inside a CUDA graph (as the decode graphs run them) over enough copies of the weight that
    none is read from L2; the weight-read floor at the device copy bandwidth measured in the same run beside them,
    the configuration gemv.config_for() picks, and whether gemv.applies() takes the product at all;
  - fused: at 1 row, the q/k/v and gate/up products with the residual add and RMSNorm before them in one kernel
    (gemv.norm_linear) against the two apart, with cuBLAS's product and with gemv's;
  - attention: one decode step's attention over the paged KV cache (32 query heads, 8 KV heads, head_dim 128,
    pages in a shuffled order) at several batch sizes and context lengths, each kernel replayed from a CUDA graph:
    flashinfer's decode kernel (16-token pages, also without split-KV, and with 64-token pages), its tensor-core
    decode (its prefill kernel, fa3 on Hopper), and paged_decode.py's Triton kernels (from batch 16 also its
    streamed kernel over a sweep of tiles, warps and pipeline stages, and its time with the engine's), against the
    KV bytes' read time at the copy bandwidth; and skewed batches (long contexts among short ones), flashinfer
    against the streamed kernel's sweep;
  - attention_order: the streamed decode attention over uneven contexts (an offline run's decode steps), its
    programs in batch order and longest first (paged_decode.LONGEST_FIRST), over a bf16 and an FP8 cache;
  - attention_small: decode graphs of 1-16 sequences, the split kernel and its merge kernel (the engine's up to 8)
    and flashinfer's decode kernel (9-15) against the streamed kernel with its pool cutting each context into up
    to 4, 8, 16 pieces or as many as fill the multiprocessors (paged_decode.SMALL_BATCH_PIECES), over a bf16 and an
    FP8 cache;
  - decode: each product at 8 to 256 rows (the decode graphs' batch sizes) with cuBLAS, against the longer of its
    weight read and its FLOPs at the bandwidth and product rate measured in the same run (--decode-ways: also
    with torch's cuBLASLt backend, and with the weight stored transposed);
  - silu: the FP8 engine's SiLU-mul kernel (fused.silu_mul_fp8) at 16 to 8,192 tokens, reading each row twice and
    once (one_pass, the engine's), also on a deferred product's fp8.Unscaled output at the rows that take one,
    against its bytes' read and write at the bandwidth;
  - norm: the FP8 engine's residual-add RMSNorm with its e4m3 quantizing (fused.rms_norm_fp8) at 1 to 8,192
    tokens, at 4, 8 and 16 warps a row, also on a deferred product's fp8.Unscaled output, against its bytes;
  - prefill_attention: a prefill step's attention (prompts of 128 to 4,096 tokens, ~8,192 a step) with
    flashinfer's paged prefill over a bf16 and an FP8 cache, and its ragged prefill over the step's bf16 K and V,
    against the causal products' FLOPs at the bf16 product rate;
  - gemm: the bf16 matrix product's best rate at prefill sizes (the compute floor of an offline run);
  - overlap: a decode forward and a prefill forward of the 8B shape one after the other, as one step, on two
    streams and on green contexts that split the SMs (whether the offline floor's sum of reads and products can
    be beaten by running both at once; bench_overlap says how).
--record writes the parts run into bench/results/kernels.json (the parts it did not run stay as they were);
otherwise it only prints.
"""
import argparse
import functools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"

# (name, rows N, columns K) of the Qwen3-8B shape's decode products
PRODUCTS = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 24576, 4096),
            ("down_proj", 4096, 12288), ("lm_head", 151936, 4096)]
# hidden, intermediate, query heads, KV heads of the Qwen3 shapes (head_dim 128, vocabulary 151936)
SHAPES = {"8B": (4096, 12288, 32, 8), "4B": (2560, 9728, 32, 8), "0.6B": (1024, 3072, 16, 8)}


def products(shape: str) -> list[tuple[str, int, int]]:
    """The decode products of a Qwen3 shape, as PRODUCTS lists the 8B's."""
    hidden, intermediate, heads, kv_heads = SHAPES[shape]
    return [("qkv_proj", (heads + 2 * kv_heads) * 128, hidden), ("o_proj", hidden, heads * 128),
            ("gate_up_proj", 2 * intermediate, hidden), ("down_proj", hidden, intermediate),
            ("lm_head", 151936, hidden)]
ATTENTION_CASES = [(1, 384), (4, 1024), (16, 1024), (64, 512), (64, 1024), (128, 1024), (256, 1024), (256, 2048)]


def log(*args) -> None:
    print(*args, flush=True)


def copy_bandwidth() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(10):
        best = min(best, timed(lambda: dst.copy_(src), 1))
    return 2 * (2 << 30) / best


def timed(fn, reps: int = 20) -> float:
    """Seconds per call of fn, best of 5 rounds of `reps` calls timed with CUDA events."""
    fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / reps)
    return best


def in_graph(calls, reps: int = 3) -> float:
    """Seconds per call of a list of calls captured in one CUDA graph, best of several replays."""
    for call in calls:   # loads kernels and settles the allocator outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return timed(graph.replay, reps) / len(calls)


def bench_gemv(bandwidth: float, shapes: tuple[str, ...] = ("8B",), fp8_weights: bool = False) -> list[dict]:
    """gemv.py's kernel at each configuration against cuBLAS, per product; `fp8_weights`: the kernel reading FP8
    weights with row scales (EngineConfig(quantization="fp8")), its floor the FP8 bytes, cuBLAS's bf16 product
    beside it, and the configurations with twice the columns per iteration too (an iteration reads half the bytes)."""
    from ember.runtime.engine import fp8, gemv

    widths = (256, 512, 1024, 2048) if fp8_weights else (256, 512, 1024)
    configs = [gemv.Config(n, k, w) for n in (4, 8, 16, 32) for k in widths for w in (4, 8)]
    rows = []
    best_config = gemv.Config()
    for shape, (name, n, k) in [(s, product) for s in shapes for product in products(s)]:
        weight_bytes = n * k * (1 if fp8_weights else 2)
        copies = max(2, math.ceil((512 << 20) / weight_bytes))   # far more than the L2 cache
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
        scales = [None] * copies
        if fp8_weights:
            bf16_weights = weights[:max(2, math.ceil((512 << 20) / (n * k * 2)))]
            weights, scales = map(list, zip(*(fp8.quantize_rows(w) for w in weights)))
        else:
            bf16_weights = weights
        floor_us = weight_bytes / bandwidth * 1e6
        for m in (1, 2, 4):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            cublas = in_graph([functools.partial(F.linear, x, w) for w in bf16_weights]) * 1e6
            tried = []
            for config in configs if m == 1 else [best_config]:
                try:
                    us = in_graph([functools.partial(gemv.gemv, x, w, config, s)
                                   for w, s in zip(weights, scales)]) * 1e6
                except Exception as err:  # noqa: BLE001 - a configuration the GPU cannot run (registers, shared memory)
                    log(f"  {name} m={m} {config}: {type(err).__name__}: {str(err)[:120]}")
                    continue
                tried.append((us, config))
            us, config = min(tried, key=lambda t: t[0])
            picked_us = next((t for t, c in tried if c == gemv.config_for(n, k, fp8_weights)), None)
            if m == 1:
                best_config = config
            if fp8_weights:   # against the product of the dequantized weight, in fp32
                expected = x.float() @ (weights[0].float() * scales[0][:, None]).t()
            else:
                expected = F.linear(x, weights[0]).float()
            check = (gemv.gemv(x, weights[0], config, scales[0]).float() - expected).abs().max()
            row = {"shape": shape, "product": name, "n": n, "k": k, "rows": m, "floor_us": round(floor_us, 2),
                   "cublas_us": round(cublas, 2), "triton_us": round(us, 2), "config": vars(config),
                   "picked": vars(gemv.config_for(n, k, fp8_weights)), "picked_us": picked_us and round(picked_us, 2),
                   "applies": m == 1 and gemv.applies(x, weights[0], None),
                   "triton_of_floor": round(floor_us / us, 3), "cublas_of_floor": round(floor_us / cublas, 3),
                   "max_abs_diff": float(check), **({"fp8_weights": True} if fp8_weights else {})}
            rows.append(row)
            log(f"gemv {shape} {name:13s} m={m}: floor {floor_us:7.2f} us, "
                f"cuBLAS {cublas:7.2f} ({floor_us / cublas:.0%}), Triton {us:7.2f} ({floor_us / us:.0%}) "
                f"{vars(config)} (picked {picked_us and round(picked_us, 2)}), max diff {float(check):.3g}")
        del weights
        torch.cuda.empty_cache()
    return rows


def max_diffs(outputs: dict[str, torch.Tensor], reference: str) -> dict[str, float]:
    """Each way's output's largest difference from the `reference` way's ({} where that one did not run)."""
    want = outputs.get(reference)
    return {} if want is None else {k: float((v - want).abs().max()) for k, v in outputs.items()}


def bench_attention(bandwidth: float, fa2: bool = False) -> list[dict]:
    """Each kernel replayed from a CUDA graph (as the decode graphs run it), so small cases time the kernel rather
    than its launch from Python. `fa2`: also flashinfer's tensor-core decode on its fa2 prefill kernel (what SGLang
    runs for grouped-query attention), whose module a node without it compiles first (minutes)."""
    import flashinfer

    from ember.runtime.engine.paged_decode import PagedDecode

    heads, kv_heads, dim = 32, 8, 128
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    # name: (page size, wrapper options, plan options)
    variants = {"flashinfer_decode": (16, {}, {}),
                "flashinfer_decode_no_split": (16, {}, {"disable_split_kv": True}),
                "flashinfer_decode_page64": (64, {}, {}),
                "flashinfer_tensor_cores_fa3": (16, {"use_tensor_cores": True, "backend": "fa3"}, {})}
    if fa2:
        variants["flashinfer_tensor_cores_fa2"] = (16, {"use_tensor_cores": True, "backend": "fa2"}, {})
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch, ctx in ATTENTION_CASES:
        kv_bytes = batch * ctx * kv_heads * dim * 2 * 2
        row = {"batch": batch, "context": ctx, "kv_mb": round(kv_bytes / 1e6, 1),
               "floor_us": round(kv_bytes / bandwidth * 1e6, 2)}
        q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
        caches = {}
        for page in (16, 64):
            per_seq = -(-ctx // page)
            order = torch.randperm(batch * per_seq, generator=g).to(torch.int32)
            caches[page] = (torch.randn(batch * per_seq, 2, page, kv_heads, dim, dtype=torch.bfloat16, device="cuda"),
                            order, per_seq)
        outputs = {}
        for name, (page, options, plan_options) in variants.items():
            kv, order, per_seq = caches[page]
            try:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_cuda_graph=True, **options,
                    paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
                    paged_kv_indices_buffer=torch.empty(len(order), dtype=torch.int32, device="cuda"),
                    paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device="cuda"))
                wrapper.plan(torch.arange(batch + 1, dtype=torch.int32) * per_seq, order,
                             torch.full((batch,), (ctx - 1) % page + 1, dtype=torch.int32), heads, kv_heads, dim,
                             page, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **plan_options)
                row[f"{name}_us"] = round(in_graph([functools.partial(wrapper.run, q, kv)] * 10) * 1e6, 2)
                if page == 16:
                    outputs[name] = wrapper.run(q, kv).float()
            except Exception as err:  # noqa: BLE001 - the row says which kernel could not run
                log(f"  {name} b={batch} ctx={ctx}: {type(err).__name__}: {str(err)[:200]}")
        kv, order, per_seq = caches[16]
        try:
            decode = PagedDecode(batch, -(-4096 // 16), 16, heads, kv_heads, dim, q.device)
            decode.prepare(order.view(batch, per_seq).tolist(), [ctx] * batch)
            run = functools.partial(decode.forward, q, kv, dim ** -0.5)
            row["triton_split_us"] = round(in_graph([run] * 10) * 1e6, 2)
            outputs["triton_split"] = run().float()
        except Exception as err:  # noqa: BLE001
            log(f"  triton_split b={batch} ctx={ctx}: {type(err).__name__}: {str(err)[:200]}")
        if batch >= STREAM_MIN_BATCH:
            row.update(sweep_streamed(q, kv, order.view(batch, per_seq).tolist(), [ctx] * batch, outputs))
        row["max_abs_diff"] = max_diffs(outputs, "flashinfer_decode")
        rows.append(row)
        log("attention " + json.dumps(row))
    return rows


def bench_attention_fp8(bandwidth: float) -> list[dict]:
    """The decode graphs' attention over a bf16 KV cache against the same over its FP8 copy
    (EngineConfig(kv_cache_dtype="fp8")): the Triton split kernel at batches the graphs give it, the streamed one
    (the engine's configuration, then STREAM_CONFIGS swept on the FP8 cache) from STREAM_MIN_BATCH, each in a CUDA
    graph, against the bandwidth floor of each cache's bytes."""
    from ember.runtime.engine import fp8
    from ember.runtime.engine.paged_decode import PagedDecode, StreamedDecode, streamed_config, streamed_pool

    heads, kv_heads, dim = 32, 8, 128
    rows = []
    g = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, ctx in ATTENTION_CASES:
        per_seq = -(-ctx // 16)
        order = torch.randperm(batch * per_seq, generator=g).to(torch.int32)
        tables = order.view(batch, per_seq).tolist()
        q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
        bf16 = torch.randn(batch * per_seq, 2, 16, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
        caches = {"bf16": bf16, "fp8": fp8.to_cache(bf16, fp8.FP8)}
        kv_bytes = batch * ctx * kv_heads * dim * 2 * 2
        row = {"batch": batch, "context": ctx, "floor_bf16_us": round(kv_bytes / bandwidth * 1e6, 2),
               "floor_fp8_us": round(kv_bytes / 2 / bandwidth * 1e6, 2)}
        outputs = {}
        for name, kv in caches.items():
            if batch < STREAM_MIN_BATCH:
                decode = PagedDecode(batch, -(-4096 // 16), 16, heads, kv_heads, dim, q.device)
            else:
                decode = StreamedDecode(batch, -(-max(16384, ctx) // 16), 16, heads, kv_heads, dim, q.device,
                                        pool=streamed_pool(batch, kv_heads, sms), **streamed_config(kv.dtype))
            decode.prepare(tables, [ctx] * batch)
            run = functools.partial(decode.forward, q, kv, dim ** -0.5)
            row[f"{name}_us"] = round(in_graph([run] * 10) * 1e6, 2)
            outputs[name] = run().float()
        if batch >= STREAM_MIN_BATCH:
            swept: dict = {}
            row.update({f"fp8_{k}": v for k, v in sweep_streamed(q, caches["fp8"], tables, [ctx] * batch,
                                                                 swept).items()})
            # the FP8 cache's kernel without kv_a and f16 (session 46's), and with the head dimension permuted
            # (`perm`) at a few tiles
            for variant, (block_t, warps, stages) in VARIANT_TILES:
                key = "fp8" + "".join(f"_{k}" if v is True else f"_{k}{v}" for k, v in variant.items())
                key += f"_{block_t}/{warps}/{stages}"
                try:
                    decode = StreamedDecode(batch, -(-max(16384, ctx) // 16), 16, heads, kv_heads, dim, q.device,
                                            pool=streamed_pool(batch, kv_heads, sms), block_t=block_t, warps=warps,
                                            stages=stages, **variant)
                    decode.prepare(tables, [ctx] * batch)
                    run = functools.partial(decode.forward, q, kv, dim ** -0.5)
                    row[f"{key}_us"] = round(in_graph([run] * 10) * 1e6, 2)
                except Exception as err:  # noqa: BLE001 - a tile the device cannot hold (shared memory) is skipped
                    log(f"  {key} b={batch} ctx={ctx}: {type(err).__name__}: {str(err)[:200]}")
                    continue
                row[f"{key}_max_abs_diff"] = round(float((run().float() - outputs["fp8"]).abs().max()), 4)
        row["max_abs_diff_fp8_bf16"] = round(float((outputs["fp8"] - outputs["bf16"]).abs().max()), 4)
        rows.append(row)
        log("attention_fp8 " + json.dumps(row))
    return rows


# bench_attention_small's steps: (sequences, tokens each), the decode graphs' batch sizes under and at the streamed
# kernel's start (EngineConfig.streamed_decode_min_batch, 16)
SMALL_CASES = [(1, 384), (1, 1024), (1, 4096), (2, 1024), (4, 1024), (8, 1024), (8, 4096), (12, 1024), (16, 1024)]
SMALL_PIECES = (4, 8, 16, None)   # paged_decode.SMALL_BATCH_PIECES' values to time (4: the default)
SPLIT_LONGEST = (4096, 40960)


def bench_attention_small(bandwidth: float) -> list[dict]:
    """Decode graphs of few sequences: the split kernel and its merge kernel (PagedDecode, what the engine runs up to 8
    sequences), its grid sized for a longest context of SPLIT_LONGEST (the engine's max_model_len), and flashinfer's
    decode kernel in its graph wrapper (what the engine runs at 9-15), against the streamed kernel, whose pool cuts
    each context into up to SMALL_PIECES pieces (paged_decode.SMALL_BATCH_PIECES; None: as many as fill the
    multiprocessors) and whose last piece merges them, over each cache (bf16; FP8, the engine's FP8 configuration)
    on SMALL_CASES, in graphs, against the KV bytes' read; and each streamed output's largest difference from the
    split kernel's."""
    import flashinfer

    from ember.runtime.engine import fp8, paged_decode
    from ember.runtime.engine.paged_decode import PagedDecode, StreamedDecode, streamed_config, streamed_pool

    heads, kv_heads, dim, page = 32, 8, 128, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    cap = paged_decode.SMALL_BATCH_PIECES
    try:
        for batch, ctx in SMALL_CASES:
            g = torch.Generator().manual_seed(batch * ctx)
            per_seq = -(-ctx // page)
            tables = torch.randperm(batch * per_seq, generator=g).to(torch.int32).view(batch, per_seq).tolist()
            q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
            bf16 = torch.randn(batch * per_seq, 2, page, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
            kv_bytes = batch * ctx * kv_heads * dim * 2 * 2
            row = {"batch": batch, "context": ctx, "floor_bf16_us": round(kv_bytes / bandwidth * 1e6, 2),
                   "floor_fp8_us": round(kv_bytes / 2 / bandwidth * 1e6, 2)}
            for name, kv in (("bf16", bf16), ("fp8", fp8.to_cache(bf16, fp8.FP8))):
                # the split kernel's grid and its merge's loop cover the longest context a graph may take (the
                # engine's max_model_len): speed.py's 4,096, and Qwen3's 40,960 (a model's default)
                for longest in SPLIT_LONGEST:
                    split = PagedDecode(batch, -(-max(longest, ctx) // page), page, heads, kv_heads, dim, q.device)
                    split.prepare(tables, [ctx] * batch)
                    run = functools.partial(split.forward, q, kv, dim ** -0.5)
                    row[f"{name}_split_{longest}_us"] = round(in_graph([run] * 10) * 1e6, 2)
                    reference = run().float()
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_cuda_graph=True,
                    paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
                    paged_kv_indices_buffer=torch.empty(batch * per_seq, dtype=torch.int32, device="cuda"),
                    paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device="cuda"))
                wrapper.plan(torch.arange(batch + 1, dtype=torch.int32) * per_seq,
                             torch.tensor(tables, dtype=torch.int32).flatten(),
                             torch.full((batch,), (ctx - 1) % page + 1, dtype=torch.int32), heads, kv_heads, dim,
                             page, q_data_type=torch.bfloat16, kv_data_type=kv.dtype)
                run = functools.partial(wrapper.run, q, kv)
                row[f"{name}_flashinfer_us"] = round(in_graph([run] * 10) * 1e6, 2)
                row[f"{name}_flashinfer_max_abs_diff"] = round(float((run().float() - reference).abs().max()), 4)
                for pieces in SMALL_PIECES:
                    paged_decode.SMALL_BATCH_PIECES = pieces
                    pool = streamed_pool(batch, kv_heads, sms)
                    streamed = StreamedDecode(batch, per_seq, page, heads, kv_heads, dim, q.device, pool=pool,
                                              **streamed_config(kv.dtype))
                    streamed.prepare(tables, [ctx] * batch)
                    run = functools.partial(streamed.forward, q, kv, dim ** -0.5)
                    key = f"{name}_streamed_{pieces or 'fill'}"
                    row[f"{key}_us"] = round(in_graph([run] * 10) * 1e6, 2)
                    row[f"{key}_pool"] = pool
                    row[f"{key}_max_abs_diff"] = round(float((run().float() - reference).abs().max()), 4)
            rows.append(row)
            log("attention_small " + json.dumps(row))
            del bf16
            torch.cuda.empty_cache()
    finally:
        paged_decode.SMALL_BATCH_PIECES = cap
    return rows


# bench_attention_order's steps: (sequences, tokens each has made), contexts its prompt (uniform in [100, 1,024],
# seeded, as the offline run's) plus those tokens, in the order the prompts came: an offline decode step's.
ORDER_CASES = [(256, 100), (256, 600), (192, 300), (160, 800), (128, 500), (96, 900), (64, 400)]


def bench_attention_order(bandwidth: float) -> list[dict]:
    """paged_decode.LONGEST_FIRST: the streamed decode attention with its first-piece programs in batch order and
    longest first, over each cache (bf16; FP8, the engine's FP8 configuration) on ORDER_CASES' uneven contexts, in
    graphs, against the KV bytes' read; whether the two give the same bits."""
    from ember.runtime.engine import fp8
    from ember.runtime.engine.paged_decode import StreamedDecode, streamed_config, streamed_pool

    heads, kv_heads, dim, page = 32, 8, 128, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, made in ORDER_CASES:
        g = torch.Generator().manual_seed(batch + made)
        contexts = (torch.randint(100, 1025, (batch,), generator=g) + made).tolist()
        pages = [-(-n // page) for n in contexts]
        shuffled = torch.randperm(sum(pages), generator=g).to(torch.int32)
        tables, used = [], 0
        for n in pages:
            tables.append(shuffled[used:used + n].tolist())
            used += n
        q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
        bf16 = torch.randn(sum(pages), 2, page, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
        kv_bytes = sum(contexts) * kv_heads * dim * 2 * 2
        row = {"batch": batch, "made": made, "context_min": min(contexts), "context_mean": round(sum(contexts) / batch),
               "context_max": max(contexts), "floor_bf16_us": round(kv_bytes / bandwidth * 1e6, 2),
               "floor_fp8_us": round(kv_bytes / 2 / bandwidth * 1e6, 2)}
        for name, kv in (("bf16", bf16), ("fp8", fp8.to_cache(bf16, fp8.FP8))):
            outputs = {}
            for way, longest_first in (("batch_order", False), ("longest_first", True)):
                decode = StreamedDecode(batch, -(-max(contexts) // page), page, heads, kv_heads, dim, q.device,
                                        pool=streamed_pool(batch, kv_heads, sms), longest_first=longest_first,
                                        **streamed_config(kv.dtype))
                decode.prepare(tables, contexts)
                run = functools.partial(decode.forward, q, kv, dim ** -0.5)
                row[f"{name}_{way}_us"] = round(in_graph([run] * 10) * 1e6, 2)
                outputs[way] = run()
            row[f"{name}_same_bits"] = bool(torch.equal(outputs["batch_order"], outputs["longest_first"]))
        rows.append(row)
        log("attention_order " + json.dumps(row))
        del bf16
        torch.cuda.empty_cache()
    return rows


def bench_skewed_attention(bandwidth: float) -> list[dict]:
    """Long contexts among short ones (SKEWED_CASES), where a kernel that gives each sequence the same number of
    programs leaves the long one's programs running alone: flashinfer's decode (its plan splits the KV by length)
    against the streamed kernel's sweep (its plan cuts a long context into pieces from a pool of programs), in
    graphs."""
    import flashinfer

    heads, kv_heads, dim, page = 32, 8, 128, 16
    rows = []
    for contexts in SKEWED_CASES:
        batch = len(contexts)
        pages = [-(-n // page) for n in contexts]
        order = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(1)).to(torch.int32)
        tables, used = [], 0
        for n in pages:
            tables.append(order[used:used + n].tolist())
            used += n
        kv = torch.randn(sum(pages), 2, page, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
        kv_bytes = sum(contexts) * kv_heads * dim * 2 * 2
        row = {"batch": batch, "contexts": ", ".join(f"{n} x{contexts.count(n)}" for n in dict.fromkeys(contexts)),
               "kv_mb": round(kv_bytes / 1e6, 1), "floor_us": round(kv_bytes / bandwidth * 1e6, 2)}
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(256 << 20, dtype=torch.uint8, device="cuda"), "NHD", use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
            paged_kv_indices_buffer=torch.empty(len(order), dtype=torch.int32, device="cuda"),
            paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device="cuda"))
        indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        wrapper.plan(indptr, order, torch.tensor([(n - 1) % page + 1 for n in contexts], dtype=torch.int32), heads,
                     kv_heads, dim, page, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        row["flashinfer_decode_us"] = round(in_graph([functools.partial(wrapper.run, q, kv)] * 10) * 1e6, 2)
        outputs = {"flashinfer_decode": wrapper.run(q, kv).float()}
        row.update(sweep_streamed(q, kv, tables, contexts, outputs))
        if "triton_stream" in outputs:
            row["max_abs_diff"] = float((outputs["triton_stream"] - outputs["flashinfer_decode"]).abs().max())
        rows.append(row)
        log("skewed attention " + json.dumps({k: v for k, v in row.items() if k != "triton_stream_sweep"}))
        del kv
        torch.cuda.empty_cache()
    return rows


STREAM_MIN_BATCH = 16
# skewed batches: one long context among short ones, several, and one long one in an offline-sized batch
SKEWED_CASES = ([16384] + [512] * 63, [4096] * 4 + [256] * 124, [16384] * 2 + [512] * 62, [16384] + [256] * 15,
                [32768] + [843] * 255)
# StreamedDecode's variants bench_attention_fp8 times on the FP8 cache besides the engine's (streamed_config),
# (options, (block_t, warps, stages)): session 46's kernel (no kv_a, no f16) and session 48's (kv_a and f16 at 128
# tokens a tile); then the engine's options, which session 50 picked here on the H100, with each left out in turn:
# the products over the head dimension permuted so each thread's values of a tile lie side by side in shared
# memory (`perm`), each tile's blocks loaded an iteration ahead so stages - 1 tiles are in flight
# (`prefetch_table`), the softmax sums added up once (`defer_sum`); and at other tiles, stages and register caps
# (`maxnreg`: 96 fits 5 programs of 4 warps a multiprocessor where the engine's 126 registers fit 4; Triton 3.6
# spills 8 bytes with defer_sum, none without). kernel_sass.py prints what each compiles to.
# Session 48 timed 2 and 4 KV heads a program (`heads`; kernels.json's attention_fp8 note), session 50 32-token
# and 8-warp tiles with the engine's options (results/h100/kernels.json, attention_fp8_round2): they lost.
_FAST = {"kv_a": True, "f16": True}
_PERM = _FAST | {"perm": True}
_AHEAD = _PERM | {"prefetch_table": True}
_ENGINE = _AHEAD | {"defer_sum": True}
VARIANT_TILES = ([({}, (128, 4, 2)), (_FAST, (128, 4, 2))]
                 + [(_PERM | {"defer_sum": True}, (64, 4, 2)), (_AHEAD, (64, 4, 3)),
                    (_FAST | {"prefetch_table": True, "defer_sum": True}, (64, 4, 3))]
                 + [(_ENGINE, tile) for tile in [(64, 4, 4), (128, 4, 3), (128, 4, 4)]]
                 + [(_ENGINE | {"maxnreg": 96}, (64, 4, 3)), (_AHEAD | {"maxnreg": 96}, (64, 4, 3))])
# paged_decode.StreamedDecode's configurations swept: (tokens per tile, warps, stages); sweep_streamed times the
# engine's (streamed_config) first. 256-token tiles fit only an FP8 cache's shared memory (the others are skipped).
STREAM_CONFIGS = [(block_t, warps, stages) for block_t in (32, 64, 128, 256) for warps in (4, 8) for stages in (2, 3)]


def sweep_streamed(q: torch.Tensor, kv: torch.Tensor, tables: list[list[int]], contexts: list[int],
                   outputs: dict) -> dict:
    """paged_decode.StreamedDecode over STREAM_CONFIGS with the engine's variant for the cache's dtype
    (streamed_config's options besides its tile, warps and stages), each in a graph with the engine's pool: the engine's
    configuration's time, the best time, its configuration and every configuration's time ("block_t/warps/stages":
    us); the best one's output joins `outputs`."""
    from ember.runtime.engine.paged_decode import StreamedDecode, streamed_config, streamed_pool

    batch, heads, dim = q.shape
    pool = streamed_pool(batch, kv.shape[3], torch.cuda.get_device_properties(q.device).multi_processor_count)
    config = streamed_config(kv.dtype)
    variant = {k: v for k, v in config.items() if k not in ("block_t", "warps", "stages")}
    engine_tile = (config["block_t"], config["warps"], config["stages"])
    times, best = {}, None
    for block_t, warps, stages in [engine_tile] + [c for c in STREAM_CONFIGS if c != engine_tile]:
        name = f"{block_t}/{warps}/{stages}"
        try:
            decode = StreamedDecode(batch, -(-max(16384, *contexts) // 16), 16, heads, kv.shape[3], dim, q.device,
                                    pool=pool, block_t=block_t, warps=warps, stages=stages, **variant)
            decode.prepare(tables, contexts)
            run = functools.partial(decode.forward, q, kv, dim ** -0.5)
            times[name] = round(in_graph([run] * 10) * 1e6, 2)
        except Exception as err:  # noqa: BLE001 - a configuration the device cannot run (shared memory) is skipped
            log(f"  triton_stream {name} b={batch} ctx={max(contexts)}: {type(err).__name__}: {str(err)[:200]}")
            continue
        if best is None or times[name] < times[best[0]]:
            best = (name, run)
    if best is None:
        return {}
    outputs["triton_stream"] = best[1]().float()
    engine = "/".join(map(str, engine_tile))
    return {"triton_stream_engine_us": times.get(engine), "triton_stream_us": times[best[0]],
            "triton_stream_config": best[0], "triton_stream_sweep": times}


def fused_ways(x: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor) -> dict:
    """bench_fused's three ways to the product of a weight `w`: in one kernel, apart with cuBLAS, apart with gemv."""
    from ember.runtime.engine import fused, gemv

    def normed() -> torch.Tensor:
        return fused.add_rms_norm(x, residual, norm, 1e-6)[0]

    return {"fused": lambda w: gemv.norm_gemv(x, residual, norm, 1e-6, w),
            "apart_cublas": lambda w: F.linear(normed(), w), "apart_triton": lambda w: gemv.gemv(normed(), w)}


def bench_fused(bandwidth: float, shapes: tuple[str, ...] = ("8B",)) -> list[dict]:
    """At batch 1, each product a layer's norm feeds, fused with it (gemv.norm_linear) against the two kernels
    apart (fused.add_rms_norm, then cuBLAS, and then gemv.py's kernel), each
    timed inside a CUDA graph over enough copies of the weight that none is read from L2."""
    from ember.runtime.engine import gemv

    rows = []
    for shape in shapes:
        for name, n, k in products(shape):
            if name not in ("qkv_proj", "gate_up_proj"):
                continue
            copies = max(2, math.ceil((512 << 20) / (n * k * 2)))
            weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
            x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
            residual, norm = torch.randn_like(x), torch.ones(k, dtype=torch.bfloat16, device="cuda")
            ways = fused_ways(x, residual, norm)
            times = {way: round(in_graph([functools.partial(fn, w) for w in weights]) * 1e6, 2)
                     for way, fn in ways.items()}
            floor_us = n * k * 2 / bandwidth * 1e6
            rows.append({"shape": shape, "product": name, "n": n, "k": k, "floor_us": round(floor_us, 2),
                         **{f"{way}_us": t for way, t in times.items()},
                         "applies": gemv.applies(x, weights[0], None)})
            log(f"fused {shape} {name:13s}: floor {floor_us:7.2f} us, "
                + ", ".join(f"{w} {t}" for w, t in times.items()) + f" (gemv.applies: {rows[-1]['applies']})")
            del weights
            torch.cuda.empty_cache()
    return rows


DECODE_ROWS = (8, 16, 32, 64, 96, 128, 192, 256)


DECODE_WAYS = ("cublas", "cublaslt", "transposed", "fp8", "fp8_fast", "fp8_mm", "fp8_rows", "fp8_tensor",
               "fp8_tensor_halves", "fp8_small")
# fp8.small_linear's tiles the fp8_small way sweeps: (block_n, block_k, warps, stages, f16[, split_k[, block_m]])
SMALL_SWEEP = [(16, 256, 4, 3, True), (16, 512, 4, 3, True), (32, 256, 4, 3, True), (32, 512, 4, 2, True),
               (64, 256, 4, 3, True), (64, 128, 4, 4, False), (64, 256, 4, 3, False), (128, 128, 4, 4, False),
               (128, 256, 8, 3, False), (64, 256, 4, 3, False, 2), (64, 256, 4, 3, False, 4),
               (64, 128, 4, 4, False, 2), (32, 256, 4, 3, True, 2), (64, 128, 4, 4, False, 1, 64),
               (128, 128, 4, 4, False, 1, 64), (128, 128, 8, 4, False, 1, 128), (64, 256, 4, 3, False, 1, 128),
               (64, 256, 4, 3, False, 2, 64), (64, 128, 4, 4, False, 2, 128)]


def bench_decode_products(bandwidth: float, shapes: tuple[str, ...] = ("8B",),
                          rows_list: tuple[int, ...] = DECODE_ROWS, ways: tuple[str, ...] = ("cublas",)) -> list[dict]:
    """Each decode product of a shape at the batch sizes a decode graph runs (cuBLAS, as the graphs of 2 rows and
    more run them), inside a CUDA graph over enough copies of the weight that none is read from L2, against its
    floor: the longer of the weight's read at the copy bandwidth and its FLOPs at the product rate measured here
    (with FP8 ways alone, the FP8 weight's bytes and _scaled_mm's rate). The offline run's decode steps take longer
    than the floor of their reads and products (speed.py); this says how much of that the products leave. `ways`:
    cublas (F.linear, as the engine runs it), cublaslt (the same with torch's preferred BLAS library set to
    cuBLASLt), transposed (x @ w with w stored K x N, the other layout cuBLAS reads),
    fp8 (the weight FP8 with row scales, as EngineConfig(quantization="fp8") runs it: gemv.py's kernel for a row,
    fp8.small_linear where fp8.small_config gives a tile, else the input quantized per row and torch._scaled_mm with
    fast accumulation), fp8_fast (quantizing and _scaled_mm with fast accumulation at every size),
    fp8_mm (_scaled_mm alone, its input quantized before), fp8_rows (the same with fast accumulation: the
    engine's product past fp8.small_config's rows, whose input its RMSNorm or SiLU-mul kernel quantizes),
    fp8_tensor (_scaled_mm alone with one scale for the input and one for the weight, which torch runs through
    cuBLASLt where row scales take its own CUTLASS kernel: what the product would take if the engine's scales
    allowed it, not the engine's arithmetic), fp8_tensor_halves (the same as two products of half the rows each:
    whether cuBLASLt's choice for a product of 129-256 rows loses to its choice for half of them), fp8_small
    (fp8.small_linear on an input quantized before, the best of SMALL_SWEEP's tiles; every tile's time in the row's
    fp8_small_sweep)."""
    from ember.runtime.engine import fp8, gemv
    a = torch.randn(8192, 4096, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(12288, 4096, dtype=torch.bfloat16, device="cuda")
    fp8_only = all(w.startswith("fp8") for w in ways)   # then the floor is the FP8 weight's bytes and product rate
    if fp8_only:
        (aq, a_scale), (bq, b_scale) = fp8.quantize_rows(a), fp8.quantize_rows(b)
        product = functools.partial(torch._scaled_mm, aq, bq.t(), scale_a=a_scale[:, None],
                                    scale_b=b_scale[None, :], out_dtype=torch.bfloat16, use_fast_accum=True)
    else:
        product = functools.partial(F.linear, a, b)
    rate = 2 * 8192 * 4096 * 12288 / timed(product, 10)
    weight_bytes = 1 if fp8_only else 2
    del a, b, product
    log(f"product rate {rate / 1e12:.0f} TFLOPS{' (FP8)' * fp8_only}")
    rows = []
    for shape in shapes:
        for name, n, k in products(shape):
            if name == "lm_head" and fp8_only:
                continue   # the engine keeps the head in the model's dtype under FP8 weights
            copies = max(2, math.ceil((512 << 20) / (n * k * 2)))
            weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
            transposed = [w.t().contiguous() for w in weights] if "transposed" in ways else []
            quantized = [fp8.quantize_rows(w) for w in weights] if any(w.startswith("fp8") for w in ways) else []
            for m in rows_list:
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                reads, flops = n * k * weight_bytes / bandwidth, 2 * m * n * k / rate
                floor_us = max(reads, flops) * 1e6
                timings = {}
                for way in ways:
                    if way == "fp8_small":
                        timings.update(_sweep_small(x, quantized))
                        continue
                    if way == "transposed":
                        calls = [functools.partial(torch.matmul, x, t) for t in transposed]
                    elif way == "fp8":
                        calls = [functools.partial(gemv.linear, x, w, scale=s) for w, s in quantized]
                    elif way in ("fp8_fast", "fp8_mm", "fp8_rows"):
                        xq, xs = fp8.quantize_tokens(x)
                        calls = [functools.partial(_fp8_product, x, xq, xs, w, s, way == "fp8_fast",
                                                   fast_accum=way != "fp8_mm") for w, s in quantized]
                    elif way == "fp8_tensor":
                        xq, _ = fp8.quantize_tokens(x)
                        one = torch.ones((), dtype=torch.float32, device="cuda")
                        calls = [functools.partial(torch._scaled_mm, xq, w.t(), scale_a=one, scale_b=one,
                                                   out_dtype=torch.bfloat16, use_fast_accum=True)
                                 for w, _ in quantized]
                    elif way == "fp8_tensor_halves":
                        if m < 32:
                            continue
                        xq, _ = fp8.quantize_tokens(x)
                        one = torch.ones((), dtype=torch.float32, device="cuda")
                        calls = [functools.partial(torch._scaled_mm, half, w.t(), scale_a=one, scale_b=one,
                                                   out_dtype=torch.bfloat16, use_fast_accum=True)
                                 for w, _ in quantized for half in (xq[:m // 2], xq[m // 2:])]
                    else:
                        calls = [functools.partial(F.linear, x, w) for w in weights]
                    torch.backends.cuda.preferred_blas_library("cublaslt" if way == "cublaslt" else "cublas")
                    try:
                        per_product = 2 if way == "fp8_tensor_halves" else 1   # in_graph's time is a call's
                        timings[f"{way}_us"] = round(in_graph(calls) * per_product * 1e6, 2)
                    finally:
                        torch.backends.cuda.preferred_blas_library("cublas")
                first = timings[f"{ways[0]}_us"]
                rows.append({"shape": shape, "product": name, "m": m, "n": n, "k": k, "floor_us": round(floor_us, 2),
                             "bound": "reads" if reads >= flops else "flops", **timings,
                             "of_floor": round(floor_us / first, 3)})
                log(f"decode {shape} {name:13s} m={m:3d}: floor {floor_us:7.2f} us ({rows[-1]['bound']}), " +
                    ", ".join(f"{way} {timings[f'{way}_us']:7.2f} ({floor_us / timings[f'{way}_us']:.0%})"
                              for way in ways if f"{way}_us" in timings)
                    + (f" [small {timings['fp8_small_config']}]" if "fp8_small_config" in timings else ""))
            del weights, transposed, quantized
            torch.cuda.empty_cache()
    return rows


def _sweep_small(x: torch.Tensor, quantized: list) -> dict:
    """fp8.small_linear over SMALL_SWEEP on x quantized before: the best time, its tile, every tile's time, and the
    best one's largest difference from _scaled_mm's output (fast accumulation, as the engine runs it)."""
    from ember.runtime.engine import fp8
    xq, xs = fp8.quantize_tokens(x)
    times, best = {}, None
    for tile in SMALL_SWEEP:
        config = fp8.SmallConfig(*tile)
        name = "/".join(str(int(v)) for v in tile)
        if x.shape[1] % (config.block_k * config.split_k):
            continue
        calls = [functools.partial(fp8.small_linear, xq, xs, w, s, torch.bfloat16, config) for w, s in quantized]
        try:
            times[name] = round(in_graph(calls) * 1e6, 2)
        except Exception as err:  # noqa: BLE001 - a tile the device cannot hold (shared memory) is skipped
            log(f"  fp8_small {name} m={x.shape[0]}: {type(err).__name__}: {str(err)[:200]}")
            continue
        if best is None or times[name] < times[best[0]]:
            best = (name, calls[0])
    if best is None:
        return {}
    w, s = quantized[0]
    reference = _fp8_product(x, xq, xs, w, s, True).float()
    return {"fp8_small_us": times[best[0]], "fp8_small_config": best[0], "fp8_small_sweep": times,
            "fp8_small_max_abs_diff": round(float((best[1]().float() - reference).abs().max()), 4)}


def _fp8_product(x, xq, xs, weight, scale, quantize: bool, fast_accum: bool | None = None):
    """fp8.linear with fast accumulation (`quantize`: x quantized here), or _scaled_mm alone on the input quantized
    before, with fast accumulation where `fast_accum` (default: as `quantize`)."""
    from ember.runtime.engine import fp8
    if quantize:
        xq, xs = fp8.quantize_tokens(x)
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16,
                            use_fast_accum=quantize if fast_accum is None else fast_accum)


def bench_rope(bandwidth: float) -> list[dict]:
    """fused.norm_rope_store_ (Qwen3-8B heads: 32 q, 8 kv, 128 wide, q/k norms) at several token counts with 1 to 8
    heads a program, in CUDA graphs, against the read and write of q, k and v and the K/V write at the copy
    bandwidth."""
    from ember.runtime.engine import fused

    hq, hk, d = 32, 8, 128
    rows = []
    chosen = fused.rope_heads_per_program
    try:
        for t in (1, 4, 16, 64, 128, 256, 1024, 8192):
            qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=torch.bfloat16, device="cuda")
            q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
            angles = torch.arange(t, device="cuda")[:, None] * torch.rand(d // 2, device="cuda")
            emb = torch.cat((angles, angles), -1)
            cos, sin = emb.cos().bfloat16()[:, None, :], emb.sin().bfloat16()[:, None, :]
            w = torch.ones(d, dtype=torch.bfloat16, device="cuda")
            blocks = -(-t // 16) + 1
            cache = torch.zeros(blocks, 2, 16, hk, d, dtype=torch.bfloat16, device="cuda")
            slots = torch.arange(t, device="cuda")
            floor_us = (2 * (hq + hk) + hk + 2 * hk) * d * 2 * t / bandwidth * 1e6
            row = {"tokens": t, "floor_us": round(floor_us, 2), "chosen_heads": chosen(t, hk)}
            for heads in (1, 2, 4, 8):
                fused.rope_heads_per_program = lambda tokens, kv_heads, heads=heads: heads
                call = functools.partial(fused.norm_rope_store_, q, k, v, cos, sin, w, w, 1e-6, cache,
                                         slots // 16, slots % 16)
                row[f"heads_{heads}_us"] = round(in_graph([call] * 20) * 1e6, 2)
            rows.append(row)
            log(f"rope t={t:5d}: floor {floor_us:7.2f} us " + " ".join(
                f"{h}:{row[f'heads_{h}_us']:.2f}" for h in (1, 2, 4, 8)) + f" (chosen {row['chosen_heads']})")
    finally:
        fused.rope_heads_per_program = chosen
    return rows


def bench_silu(bandwidth: float) -> list[dict]:
    """fused.silu_mul_fp8 (Qwen3-8B's 12,288-wide MLP) at decode and prefill token counts, in CUDA graphs: the row
    read twice (two_pass: its amax, then its values from L2) against read once and held in registers (one_pass, at
    8, 16 and 32 warps; the engine's at fused.SILU_ONE_PASS_WARPS since session 54), against reading the gate and
    up rows and writing the e4m3 row and its scale at the copy bandwidth. `_same`: whether a way's bytes and scales
    equal two_pass's. At the token counts whose
    gate/up product leaves its scales to this kernel (fp8.DEFERRED_MIN_ROWS to DEFERRED_MAX_ROWS), the same ways
    again on an fp8.Unscaled input (`scaled_`), which also reads a row scale and the 2 x 12,288 column scales a
    row."""
    from ember.runtime.engine import fp8, fused

    n = 12288
    ways = {"two_pass": {"one_pass": False}} | {f"one_pass_{w}": {"one_pass": True, "warps": w} for w in (8, 16, 32)}
    rows = []
    for t in (16, 64, 128, 256, 1024, 8192):
        gate_up = torch.randn(t, 2 * n, dtype=torch.bfloat16, device="cuda") * 3
        floor_us = (2 * n * 2 + n + 4) * t / bandwidth * 1e6
        row = {"tokens": t, "n": n, "floor_us": round(floor_us, 2)}
        inputs = {"": gate_up}
        if fp8.DEFERRED_MIN_ROWS <= t <= fp8.DEFERRED_MAX_ROWS:
            inputs["scaled_"] = fp8.Unscaled(gate_up, torch.rand(t, 1, device="cuda") + 0.5,
                                             torch.rand(2 * n, device="cuda") + 0.5)
        for prefix, source in inputs.items():
            want = fused.silu_mul_fp8(source, one_pass=False)
            for way, options in ways.items():
                call = functools.partial(fused.silu_mul_fp8, source, **options)
                out, scale = call()
                row[f"{prefix}{way}_same"] = bool(torch.equal(out.view(torch.uint8), want[0].view(torch.uint8))
                                                  and torch.equal(scale, want[1]))
                row[f"{prefix}{way}_us"] = round(in_graph([call] * 20) * 1e6, 2)
        rows.append(row)
        log(f"silu t={t:5d}: floor {floor_us:7.2f} us " + " ".join(
            f"{p}{w}:{row[f'{p}{w}_us']:.2f}{'' if row[f'{p}{w}_same'] else ' (DIFFERS)'}"
            for p in inputs for w in ways))
    return rows


def bench_norm(bandwidth: float) -> list[dict]:
    """fused.rms_norm_fp8 with a residual (the 8B shape's 4,096-wide rows: the add, the RMSNorm and the e4m3
    quantizing of an FP8 product's input) at 1 to 8,192 tokens, in CUDA graphs, at 4 (Triton's default), 8 and 16
    warps (fused.NORM_WARPS; the engine's rule, fused._norm_warps, takes 16 up to 256 rows), against reading x and
    the residual and writing the sum, the e4m3 row and its scale at the copy bandwidth; where a deferred product
    passes one (fp8.DEFERRED_MIN_ROWS to DEFERRED_MAX_ROWS rows), also on an fp8.Unscaled x (`scaled_`), which reads
    a row scale and 4,096 column scales a row. `_same`: whether a way's bytes, scales and sum equal 4 warps' (the
    sum of squares adds in another order at other warps, which can move a last bit)."""
    from ember.runtime.engine import fp8, fused

    h = 4096
    ways = {"warps_4": 4, "warps_8": 8, "warps_16": 16}
    rows, before = [], fused.NORM_WARPS
    try:
        for t in (1, 16, 64, 128, 256, 1024, 8192):
            x = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
            residual, weight = torch.randn_like(x), torch.rand(h, dtype=torch.bfloat16, device="cuda") + 0.5
            floor_us = (h * (2 + 2 + 2 + 1) + 4) * t / bandwidth * 1e6
            row = {"tokens": t, "hidden": h, "floor_us": round(floor_us, 2)}
            inputs = {"": x}
            if fp8.DEFERRED_MIN_ROWS <= t <= fp8.DEFERRED_MAX_ROWS:
                inputs["scaled_"] = fp8.Unscaled(x, torch.rand(t, 1, device="cuda") + 0.5,
                                                 torch.rand(h, device="cuda") + 0.5)
            for prefix, source in inputs.items():
                call = functools.partial(fused.rms_norm_fp8, source, residual, weight, 1e-6)
                fused.NORM_WARPS = 4
                want = call()
                for way, warps in ways.items():
                    fused.NORM_WARPS = warps
                    got = call()
                    row[f"{prefix}{way}_same"] = bool(
                        torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                        and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]))
                    row[f"{prefix}{way}_us"] = round(in_graph([call] * 20) * 1e6, 2)
            rows.append(row)
            log(f"norm t={t:5d}: floor {floor_us:7.2f} us " + " ".join(
                f"{p}{w}:{row[f'{p}{w}_us']:.2f}{'' if row[f'{p}{w}_same'] else ' (DIFFERS)'}"
                for p in inputs for w in ways))
    finally:
        fused.NORM_WARPS = before
    return rows


def bench_prefill_attention(rate: float) -> list[dict]:
    """A prefill step's attention for one layer of the 8B shape (32 query heads, 8 KV heads, head_dim 128), prompts
    with no cached prefix, causal, timed eagerly (as the engine runs prefill steps past its prefill graphs):
    flashinfer's paged prefill over the cache as the engine runs it, bf16 (fa3 on Hopper) and FP8
    (EngineConfig(kv_cache_dtype="fp8"): flashinfer's fa3 takes an FP8 cache only with an FP8 query, so fa2), and
    its ragged prefill over the step's own bf16 K and V (fa3), which an FP8 engine could run where no prompt has
    context in the cache; against the causal products' FLOPs at the bf16 product rate measured in this run.
    `max_abs_diff`: each way against the paged bf16 one."""
    import flashinfer

    from ember.runtime.engine import fp8

    heads, kv_heads, dim, page = 32, 8, 128, 16
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for sequences, length in ((14, 585), (8, 1024), (64, 128), (2, 4096)):
        t = sequences * length
        q = torch.randn(t, heads, dim, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(t, kv_heads, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        per_seq = -(-length // page)
        order = torch.randperm(sequences * per_seq).to(torch.int32)   # pages in no order, as a cache hands them out
        cache = torch.zeros(sequences * per_seq, 2, page, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
        tokens = torch.arange(t, device="cuda")
        position = tokens % length   # within its prompt
        pages = order.cuda().view(sequences, per_seq)[tokens // length, position // page]
        cache[pages, 0, position % page], cache[pages, 1, position % page] = k, v
        caches = {"bf16": cache, "fp8": fp8.to_cache(cache, fp8.FP8)}
        qo_indptr = torch.arange(sequences + 1, dtype=torch.int32) * length
        kv_indptr = torch.arange(sequences + 1, dtype=torch.int32) * per_seq
        last = torch.full((sequences,), (length - 1) % page + 1, dtype=torch.int32)
        flops = 4 * heads * dim * sequences * length * (length + 1) / 2
        row = {"sequences": sequences, "length": length, "tokens": t,
               "floor_us": round(flops / rate * 1e6, 2)}
        outputs = {}
        for name in ("paged_bf16", "paged_fp8", "ragged_bf16"):
            try:
                if name.startswith("paged"):
                    kv = caches[name.split("_")[1]]
                    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
                    wrapper.plan(qo_indptr, kv_indptr, order, last, heads, kv_heads, dim, page, causal=True,
                                 sm_scale=dim ** -0.5, q_data_type=torch.bfloat16, kv_data_type=kv.dtype)
                    call = functools.partial(wrapper.run, q, kv)
                else:
                    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
                    wrapper.plan(qo_indptr, qo_indptr, heads, kv_heads, dim, causal=True, sm_scale=dim ** -0.5,
                                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                    call = functools.partial(wrapper.run, q, k, v)
                outputs[name] = call().float()
                row[f"{name}_us"] = round(timed(call, 10) * 1e6, 2)
                row[f"{name}_backend"] = getattr(wrapper, "_backend", None)
            except Exception as err:  # noqa: BLE001 - the row says which kernel could not run
                log(f"  {name} {sequences}x{length}: {type(err).__name__}: {str(err)[:200]}")
        row["max_abs_diff"] = max_diffs(outputs, "paged_bf16")
        rows.append(row)
        log("prefill_attention " + json.dumps(row))
    return rows


def bench_gemm() -> list[dict]:
    rows = []
    for m, k, n in ((8192, 4096, 12288), (8192, 4096, 4096), (8192, 12288, 4096), (4096, 4096, 24576)):
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        seconds = timed(functools.partial(F.linear, a, b), 10)
        rows.append({"m": m, "k": k, "n": n, "tflops": round(2 * m * k * n / seconds / 1e12, 1)})
        log(f"gemm {m}x{k}x{n}: {rows[-1]['tflops']} TFLOPS")
    return rows


def bench_overlap(prefill_tokens: tuple[int, ...] = (512, 1024, 2048), batch: int = 256, context: int = 843,
                  decode_sms: tuple[int, ...] = (32, 48, 66, 88)) -> list[dict]:
    """Whether a decode step and a prefill chunk gain by running at once: the offline floor (speed.py) adds a
    decode step's K/V reads to its products, and only work that overlaps them could pass it. On the 8B shape (36
    layers, random weights), a decode forward of `batch` sequences of `context` tokens (its products at `batch`
    rows, each layer's attention by paged_decode's streamed kernel over one layer's worth of pages, read again by
    every layer: ~0.9 GB, far over L2) and a prefill forward of M tokens (its products; the prefill attention, a
    few % of a 512-token chunk's FLOPs, is left out), timed: each alone, one after the other, as one step whose
    products take both parts' rows (as a mixed step does), on two streams at once (also with the decode stream at
    high priority), and on two green contexts splitting the SMs (`decode_sms` to the decode, the rest to the
    prefill). Both forwards run eager: each enqueues in a few ms and runs for 11-55 ms, so the host stays ahead.
    Norms, RoPE and sampling are left out of both: they are the same work either way."""
    import numpy as np

    from ember.runtime.engine.paged_decode import StreamedDecode, streamed_pool

    hidden, intermediate, heads, kv_heads = SHAPES["8B"]
    layers, dim, page, dtype, device = 36, 128, 16, torch.bfloat16, torch.device("cuda")
    qkv_width = (heads + 2 * kv_heads) * dim
    generator = torch.Generator(device=device).manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, dtype=dtype, device=device, generator=generator) * 0.02

    weights = [(weight(qkv_width, hidden), weight(hidden, heads * dim), weight(2 * intermediate, hidden),
                weight(hidden, intermediate)) for _ in range(layers)]
    pages = -(-context // page)
    kv = torch.randn(batch * pages, 2, page, kv_heads, dim, dtype=dtype, device=device, generator=generator)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    attention = StreamedDecode(batch, pages, page, heads, kv_heads, dim, device,
                               pool=streamed_pool(batch, kv_heads, sms))
    attention.stage(np.arange(batch * pages, dtype=np.int32).reshape(batch, pages), np.full(batch, context, np.int32))

    def mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, gate_up)
        return F.linear(F.silu(h[:, :intermediate]) * h[:, intermediate:], down)

    def forward(x: torch.Tensor, decode_rows: int) -> torch.Tensor:
        """The first `decode_rows` rows of x decode (attention over the pages), the rest are prefill tokens."""
        for qkv_w, o_w, gate_up_w, down_w in weights:
            qkv = F.linear(x, qkv_w)
            parts = []
            if decode_rows:
                q = qkv[:decode_rows].view(decode_rows, heads + 2 * kv_heads, dim)[:, :heads]
                parts.append(attention.forward(q, kv, dim ** -0.5).reshape(decode_rows, heads * dim))
            if decode_rows < x.shape[0]:
                parts.append(qkv[decode_rows:, :heads * dim] * 1.0)
            x = mlp(F.linear(parts[0] if len(parts) == 1 else torch.cat(parts), o_w), gate_up_w, down_w)
        return x

    def run(jobs: list[tuple[torch.cuda.Stream, functools.partial]], rounds: int = 5) -> float:
        """Milliseconds (median of `rounds`) from enqueueing each job on its stream, all at once, to the last end."""
        current = torch.cuda.current_stream()
        times = []
        for _ in range(rounds + 1):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(current)
            for stream, job in jobs:
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    job()
            for stream, _ in jobs:
                current.wait_stream(stream)
            end.record(current)
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times[1:])[rounds // 2]   # the first round loads the kernels

    decode_x = torch.randn(batch, hidden, dtype=dtype, device=device, generator=generator)
    decode = functools.partial(forward, decode_x, batch)
    one, two, urgent = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    decode_ms = run([(one, decode)])
    log(f"overlap: decode forward of {batch} x {context} tokens {decode_ms:.2f} ms")
    green = None
    try:
        from torch.cuda.green_contexts import GreenContext
        green = GreenContext
    except ImportError:
        log("overlap: this torch has no green contexts")
    rows = []
    for m in prefill_tokens:
        prefill = functools.partial(forward, torch.randn(m, hidden, dtype=dtype, device=device, generator=generator), 0)
        mixed = functools.partial(forward, torch.randn(batch + m, hidden, dtype=dtype, device=device,
                                                       generator=generator), batch)
        prefill_ms = run([(two, prefill)])
        row = {"batch": batch, "context": context, "prefill_tokens": m, "decode_ms": round(decode_ms, 2),
               "prefill_ms": round(prefill_ms, 2), "serial_ms": round(decode_ms + prefill_ms, 2),
               "one_step_ms": round(run([(one, mixed)]), 2),
               "two_streams_ms": round(run([(one, decode), (two, prefill)]), 2),
               "two_streams_decode_urgent_ms": round(run([(urgent, decode), (two, prefill)]), 2)}
        log(f"overlap M={m}: prefill {prefill_ms:.2f} ms, one after the other {row['serial_ms']:.2f}, one step "
            f"{row['one_step_ms']:.2f}, two streams {row['two_streams_ms']:.2f} (decode urgent "
            f"{row['two_streams_decode_urgent_ms']:.2f})")
        row["green"] = []
        for n in decode_sms if green is not None else ():
            decode_ctx, prefill_ctx = green.create(num_sms=n), green.create(num_sms=sms - n)
            split = {"decode_sms": n, "decode_ms": round(run([(decode_ctx.Stream(), decode)]), 2),
                     "prefill_ms": round(run([(prefill_ctx.Stream(), prefill)]), 2),
                     "both_ms": round(run([(decode_ctx.Stream(), decode), (prefill_ctx.Stream(), prefill)]), 2)}
            row["green"].append(split)
            log(f"   green contexts, {n} SMs to the decode, {sms - n} to the prefill: decode {split['decode_ms']:.2f}"
                f" ms, prefill {split['prefill_ms']:.2f}, both at once {split['both_ms']:.2f}")
        rows.append(row)
    return rows


def record(path: Path, result: dict) -> None:
    """Writes this run's parts into `path`, keeping the parts of earlier runs that this one did not run (each
    part's rows are one run's; `machine` and `copy_bandwidth_gb_s` are the latest run's)."""
    kept = json.loads(path.read_text()) if path.exists() else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**kept, **result}, indent=1) + "\n")


PARTS = ("gemv", "fused", "attention", "attention_fp8", "attention_order", "attention_small", "decode", "rope",
         "silu", "norm", "prefill_attention", "gemm", "overlap")


def parts_arg(text: str) -> set[str]:
    """--parts: a comma-separated subset of PARTS (a misspelt part ran nothing and said nothing)."""
    parts = {p.strip() for p in text.split(",") if p.strip()}
    if unknown := parts - set(PARTS):
        raise argparse.ArgumentTypeError(f"unknown {', '.join(sorted(unknown))}; choose from {','.join(PARTS)}")
    if not parts:
        raise argparse.ArgumentTypeError(f"name at least one of {','.join(PARTS)}")
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=parts_arg, default="gemv,attention,gemm",
                        help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--gemv-shapes", nargs="+", default=["8B"], choices=list(SHAPES),
                        help="gemv: the products of these Qwen3 shapes")
    parser.add_argument("--gemv-fp8", action="store_true",
                        help="gemv: FP8 weights with row scales (EngineConfig(quantization='fp8')), recorded as "
                             "gemv_fp8")
    parser.add_argument("--decode-rows", nargs="+", type=int, default=list(DECODE_ROWS),
                        help="decode: the row counts to time each product at")
    parser.add_argument("--decode-ways", default="cublas",
                        help=f"decode: comma-separated, of {','.join(DECODE_WAYS)} (the first gives of_floor)")
    parser.add_argument("--record", action="store_true", help="write bench/results/kernels.json")
    parser.add_argument("--fa2", action="store_true",
                        help="attention: also flashinfer's tensor-core decode on fa2 (compiles its module if missing)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernel_bench.py needs a CUDA GPU: run it on the GPU machine")
    from ember.runtime.engine import kernels
    kernels.install()
    began = time.perf_counter()
    bandwidth = copy_bandwidth()
    log(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    parts = args.parts
    result = {"machine": f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores, {platform.machine()}; "
                         f"torch {torch.__version__}", "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1)}
    if "gemv" in parts:
        result["gemv_fp8" if args.gemv_fp8 else "gemv"] = bench_gemv(bandwidth, tuple(args.gemv_shapes), args.gemv_fp8)
    if "fused" in parts:
        result["fused"] = bench_fused(bandwidth, tuple(args.gemv_shapes))
    if "attention" in parts:
        result["attention"] = bench_attention(bandwidth, args.fa2)
        result["attention_skewed"] = bench_skewed_attention(bandwidth)
    if "attention_fp8" in parts:
        result["attention_fp8"] = bench_attention_fp8(bandwidth)
    if "attention_order" in parts:
        result["attention_order"] = bench_attention_order(bandwidth)
    if "attention_small" in parts:
        result["attention_small"] = bench_attention_small(bandwidth)
    if "decode" in parts:
        ways = tuple(w.strip() for w in args.decode_ways.split(","))
        if unknown := set(ways) - set(DECODE_WAYS):
            sys.exit(f"--decode-ways: unknown {', '.join(sorted(unknown))}; choose from {', '.join(DECODE_WAYS)}")
        # FP8 ways alone are their own record (decode_products_fp8), beside the bf16 products'
        key = "decode_products_fp8" if all(w.startswith("fp8") for w in ways) else "decode_products"
        result[key] = bench_decode_products(bandwidth, tuple(args.gemv_shapes), tuple(args.decode_rows),
                                                          ways)
    if "rope" in parts:
        result["rope"] = bench_rope(bandwidth)
    if "silu" in parts:
        result["silu"] = bench_silu(bandwidth)
    if "norm" in parts:
        result["norm"] = bench_norm(bandwidth)
    if "gemm" in parts or "prefill_attention" in parts:
        gemm = bench_gemm()
        if "gemm" in parts:
            result["gemm"] = gemm
        if "prefill_attention" in parts:
            result["prefill_attention"] = bench_prefill_attention(max(r["tflops"] for r in gemm) * 1e12)
    if "overlap" in parts:
        result["overlap"] = bench_overlap()
    log(f"done in {time.perf_counter() - began:.0f} s")
    if args.record:
        record(args.results / "kernels.json", result)


if __name__ == "__main__":
    main()
