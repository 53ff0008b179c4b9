"""FP8 weights and the FP8 KV cache on a CUDA GPU (runtime/engine/fp8.py): the kernels against the arithmetic they
stand for. Run on the GPU machine:
    python -m pytest tests/gpu/test_fp8_gpu.py -m gpu -s

An FP8 engine's answers are checked against transformers on trained weights
(test_engine_gpu.py::test_greedy_free_running_agreement_on_trained_weights) and, in fp32 on the CPU, against
transformers whose products run the same arithmetic (tests/runtime/engine/test_fp8.py). Random bf16 weights say
little here: rounding to e4m3 magnifies bf16's last-bit differences between any two implementations (one value in
~16 lands on the other side of an e4m3 rounding boundary and moves by an eighth), as much noise as the quantization
itself, and the random models' logits are flat enough that this swaps the top token. Measured on an H100 (session
45, 128 prompts x 32 tokens, teacher-forced): transformers with the same quantization picked the engine's token
0.59-0.69 of the time, unquantized transformers 0.44-0.61, where trained weights agree at 1.0.
"""
import numpy as np
import pytest
import torch

from ember.runtime.engine import cublaslt, fp8, fused, gemv, paged_decode
from ember.runtime.engine.attention import AttentionBatch, FlashInferBackend, SdpaBackend
from tests.gpu.test_paged_decode_gpu import (
    HEADS,
    KV_HEADS,
    MAX_BLOCKS,
    PAGE,
    STREAMED_CLOSE,
    D,
    padded,
    paged,
    scattered,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def dequantized_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What fp8.linear stands for, in fp32: the input quantized per row, times the dequantized weight."""
    xq, xs = fp8.quantize_tokens(x)
    return (xq.float() * xs) @ (weight.float() * scale[:, None]).t()


def same_quantization(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Equal scales, and e4m3 values equal but for the rare one on a rounding boundary, a step apart at most."""
    (q, scale), (expected_q, expected_scale) = got, expected
    assert torch.allclose(scale, expected_scale, rtol=1e-6, atol=0)
    differ = q.float() != expected_q.float()
    assert differ.float().mean() < 1e-3
    step = (expected_q.float().abs() * 2.0 ** -3).clamp(min=2.0 ** -9)
    assert ((q.float() - expected_q.float()).abs() <= step)[differ].all()


def test_the_token_quantizer_kernel_rounds_as_torch_does():
    torch.manual_seed(0)
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16) * torch.logspace(-2, 2, 300, device="cuda")[:, None]
    x[5] = 0
    expected_q, expected_scale = fp8.quantize_rows(x)
    same_quantization(fp8.quantize_tokens(x), (expected_q, expected_scale[:, None]))


@pytest.mark.parametrize("rows", [1, 2, 16, 100, 256])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (1040, 1536)])
def test_fp8_products_compute_the_dequantized_product(rows, n, k):
    """Batches of two rows or more through torch._scaled_mm, a single row through gemv.py's kernel (the weight FP8,
    the row in bf16, each output scaled), and a row through the kernel that adds the residual and norms first."""
    torch.manual_seed(rows + n)
    weight, scale = fp8.quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = gemv.linear(x, weight, scale=scale)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    if rows == 1 and gemv.applies(x, weight, None):
        expected = x.float() @ (weight.float() * scale[:, None]).t()   # the row is not quantized
    else:
        expected = dequantized_product(x, weight, scale)
    assert torch.allclose(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().mean().item())
    if rows == 1 and gemv.applies(x, weight, None):
        residual, norm = torch.randn_like(x), torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        fused_out, total = gemv.norm_linear(x, residual, norm, 1e-6, weight, scale=scale)
        h = torch.nn.functional.rms_norm(residual.float() + x.float(), (k,), norm.float(), 1e-6)
        unfused = h @ (weight.float() * scale[:, None]).t()
        assert torch.allclose(fused_out.float(), unfused, rtol=3e-2, atol=3e-2 * unfused.abs().mean().item())
        assert torch.equal(total, residual + x)


@pytest.mark.parametrize("rows", [2, 5, 16, 33, 64, 128, 200])
@pytest.mark.parametrize("tile", [(16, 256, 4, 3, True), (32, 512, 4, 2, True), (64, 256, 4, 3, False),
                                  (128, 128, 4, 4, False), (64, 256, 4, 3, False, 2), (16, 256, 4, 3, True, 4),
                                  (64, 128, 4, 4, False, 1, 32), (64, 256, 4, 3, False, 2, 16)])
def test_the_small_product_kernel_computes_the_dequantized_product(rows, tile):
    """fp8.small_linear (the weight's rows the products' left operand, fp16 or FP8 MMA, K in one program or split
    among several, the input rows in one program or in blocks) at the row counts decode graphs run, over an output
    width no tile divides: every output scaled by both scales, nothing past the rows; a split product's counts are
    back at zero for the next one."""
    if rows > fp8.SMALL_MAX_ROWS and len(tile) < 7:
        pytest.skip("past SMALL_MAX_ROWS rows only tiles of a few input rows a program are swept")
    torch.manual_seed(rows)
    weight, scale = fp8.quantize_rows(torch.randn(1040, 4096, device="cuda") * 0.02)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    xq, xs = fp8.quantize_tokens(x)
    config = fp8.SmallConfig(*tile)
    out = fp8.small_linear(xq, xs, weight, scale, torch.bfloat16, config)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 1040)
    if config.split_k > 1:
        assert torch.equal(fp8.small_linear(xq, xs, weight, scale, torch.bfloat16, config), out)
        assert not fp8._ARRIVED[out.device].any()
    expected = dequantized_product(x, weight, scale)
    if config.f16:   # fp16 products of values exact in fp16, summed in fp32: bf16's rounding of the output
        torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=2 ** -7 * expected.abs().mean().item())
    else:   # FP8 MMA sums as _scaled_mm's fast accumulation: test_fp8_products_compute_the_dequantized_product's bound
        assert torch.allclose(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().mean().item())
    engine_config = fp8.small_config(rows, 1040, 4096, fp8.multiprocessors(x.device))
    if engine_config is not None:   # the engine's products of these rows take the kernel, split where few blocks
        assert torch.equal(gemv.linear(x, weight, scale=scale),
                           fp8.small_linear(xq, xs, weight, scale, torch.bfloat16, engine_config))


@pytest.mark.parametrize("lt", ["off", "LT_CHOICE", "LT_SCALED"])
@pytest.mark.parametrize("rows", [64, 65, 96, 129, 192, 200, 256, 300])
@pytest.mark.parametrize("n,k", [(4096, 4096), (24576, 4096), (4096, 12288)])
def test_a_deferred_product_reads_as_the_row_scaled_one_in_the_kernels_that_scale_it(rows, n, k, lt, monkeypatch):
    """fp8.deferred_linear: from DEFERRED_MIN_ROWS to DEFERRED_MAX_ROWS rows, the FP8 sums with their scales
    left to the next kernel (torch._scaled_mm with one scale a tensor, or with LT_CHOICE cuBLASLt's algorithm timed
    fastest for the shape); scaled, quantized_linear's output to bf16's rounding, and the norm and SiLU-mul kernels
    scale it as they load it, bit for bit as they read it scaled. With LT_SCALED, at the rows cuBLASLt takes (a
    multiple of 16), the scaled output itself, quantized_linear's to the order of its sums. Other rows:
    quantized_linear's output itself."""
    monkeypatch.setattr(fp8, "DEFERRED", True)
    monkeypatch.setattr(fp8, "LT_CHOICE", lt == "LT_CHOICE")
    monkeypatch.setattr(fp8, "LT_SCALED", lt == "LT_SCALED")
    torch.manual_seed(rows + n + k)
    weight, scale = fp8.quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    q, q_scale = fp8.quantize_tokens(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
    out = fp8.quantized_linear(q, q_scale, weight, scale, None, torch.bfloat16)
    deferred = fp8.deferred_linear(q, q_scale, weight, scale, None, torch.bfloat16)
    if not fp8.DEFERRED_MIN_ROWS <= rows <= fp8.DEFERRED_MAX_ROWS:
        assert isinstance(deferred, torch.Tensor) and torch.equal(deferred, out)
        return
    if lt == "LT_SCALED" and rows % 16 == 0:
        assert isinstance(deferred, torch.Tensor) and deferred.shape == out.shape
        torch.testing.assert_close(deferred.float(), out.float(), rtol=2 ** -6,
                                   atol=2 ** -6 * out.abs().mean().item())
        return
    assert isinstance(deferred, fp8.Unscaled) and deferred.shape == out.shape
    scaled = deferred.materialize()
    torch.testing.assert_close(scaled.float(), out.float(), rtol=2 ** -6, atol=2 ** -6 * out.abs().mean().item())
    residual = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    norm = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    for kernel in (fused.add_rms_norm, fused.rms_norm_fp8):
        got, want = kernel(deferred, residual, norm, 1e-6), kernel(scaled, residual, norm, 1e-6)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    for one_pass in (False, True):
        got, want = fused.silu_mul_fp8(deferred, one_pass), fused.silu_mul_fp8(scaled, one_pass)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("rows,n,k", [(96, 4096, 4096), (256, 24576, 4096), (160, 4096, 12288)])
def test_cublaslt_runs_the_algorithm_it_chose_for_a_shape_and_a_graph_replays_it(rows, n, k, scaled):
    """cublaslt.matmul: _scaled_mm's product (one scale a tensor, fast accumulation; `scaled`, the token and weight
    row scales applied, as quantized_linear's) to the order of its sums, through the algorithm its first call timed
    fastest of the heuristic's first CANDIDATES (kept for the shape); a graph captured after it replays the same
    bits; a shape with no choice yet is left to _scaled_mm inside a capture, and a row count that is not a multiple
    of 16 always."""
    torch.manual_seed(rows + n + scaled)
    weight, w_scale = fp8.quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
    q, q_scale = fp8.quantize_tokens(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16))
    scales = (q_scale, w_scale) if scaled else ()
    if scaled:
        want = torch._scaled_mm(q, weight.t(), scale_a=q_scale, scale_b=w_scale.view(1, -1),
                                out_dtype=torch.bfloat16, use_fast_accum=True)
    else:
        one = torch.ones((), device="cuda")
        want = torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                use_fast_accum=True)
    got = cublaslt.matmul(q, weight, *scales)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.abs().mean().item())
    choice = cublaslt.choices()[(torch.cuda.current_device(), rows, n, k, scaled)]
    assert choice is not None and 0 <= choice.index < len(choice.medians_us) <= cublaslt.CANDIDATES
    assert min(choice.medians_us) > 0 and "tile" in choice.config
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cublaslt.matmul(q, weight, *scales)
        unchosen = cublaslt.matmul(q[:rows - 16], weight, *(s[:rows - 16] if s is q_scale else s for s in scales))
    graph.replay()
    assert captured is not None and torch.equal(captured, got)
    assert unchosen is None
    assert cublaslt.matmul(q[:rows - 1], weight, *(s[:rows - 1] if s is q_scale else s for s in scales)) is None


@pytest.mark.parametrize("rows", [65, 128, 256])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, fp8.FP8])
@pytest.mark.parametrize("qk_norms", [True, False])
def test_a_deferred_qkv_product_reads_as_the_scaled_one_in_the_rope_kernel(rows, kv_dtype, qk_norms, monkeypatch):
    """fp8.DEFERRED_QKV: the merged q/k/v product of the 8B shape left unscaled, and fused.norm_rope_store_ (q/k
    norms where the family has them, as Qwen3 does and Llama does not; RoPE; the K/V write) applying its scales as
    it loads it: q and k rotated in place, v scaled in place and the cache's K and V bit for bit as from the
    product's output scaled (materialize, the values quantized_linear rounds to)."""
    monkeypatch.setattr(fp8, "DEFERRED", True)
    torch.manual_seed(rows)
    hq, hk, d = 32, 8, 128
    weight, scale = fp8.quantize_rows(torch.randn((hq + 2 * hk) * d, 4096, device="cuda") * 0.02)
    q_in, q_scale = fp8.quantize_tokens(torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16))
    deferred = fp8.deferred_linear(q_in, q_scale, weight, scale, None, torch.bfloat16)
    assert isinstance(deferred, fp8.Unscaled)
    scaled = deferred.materialize()
    cos, sin = (torch.rand(rows, 1, d, device="cuda").bfloat16() for _ in range(2))
    norms = tuple(torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5 if qk_norms else None for _ in range(2))
    slots = torch.randperm(rows, device="cuda")   # a slot a token
    blocks, offsets = slots // 16, slots % 16
    results = []
    for qkv, scales in ((deferred.raw, (deferred.row_scale, deferred.col_scale)), (scaled, None)):
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(rows, hq, d), k.view(rows, hk, d), v.view(rows, hk, d)
        cache = torch.zeros(-(-rows // 16), 2, 16, hk, d, device="cuda", dtype=kv_dtype)
        fused.norm_rope_store_(q, k, v, cos, sin, *norms, 1e-6, cache, blocks, offsets, scales)
        results.append((q.clone(), k.clone(), v.clone(), cache.view(torch.uint8)))
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_the_norm_and_silu_kernels_quantize_as_their_unfused_kernels_then_the_quantizer(rows):
    """An FP8 product's input straight from the RMSNorm (with and without the residual add) and SiLU-mul kernels:
    what fused.add_rms_norm / rms_norm / silu_mul and then fp8.quantize_tokens give."""
    from ember.runtime.engine import fused

    torch.manual_seed(rows)
    x, residual = (torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(2))
    norm = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    q, scale, total = fused.rms_norm_fp8(x, residual, norm, 1e-6)
    h, expected_total = fused.add_rms_norm(x, residual, norm, 1e-6)
    same_quantization((q, scale), fp8.quantize_tokens(h))
    assert torch.equal(total, expected_total)
    q, scale, total = fused.rms_norm_fp8(x, None, norm, 1e-6)
    same_quantization((q, scale), fp8.quantize_tokens(fused.rms_norm(x, norm, 1e-6)))
    assert total is x
    gate_up = torch.randn(rows, 2 * 12288, device="cuda", dtype=torch.bfloat16) * 2
    same_quantization(fused.silu_mul_fp8(gate_up), fp8.quantize_tokens(fused.silu_mul(gate_up)))


@pytest.mark.parametrize("n", [12288, 1000])
def test_the_silu_kernel_read_once_gives_the_bytes_of_reading_twice(n):
    """fused.silu_mul_fp8(one_pass=True), at any warps, holds each row in registers and gives the e4m3 bytes and
    scales that the two-pass kernel gives, which match the unfused kernels'."""
    torch.manual_seed(n)
    gate_up = torch.randn(33, 2 * n, device="cuda", dtype=torch.bfloat16) * 3
    out, scale = fused.silu_mul_fp8(gate_up)
    same_quantization((out, scale), fp8.quantize_tokens(fused.silu_mul(gate_up)))
    for warps in (4, 16, 32):
        other, other_scale = fused.silu_mul_fp8(gate_up, one_pass=True, warps=warps)
        assert torch.equal(other.view(torch.uint8), out.view(torch.uint8)), warps
        assert torch.equal(other_scale, scale), warps


# The FP8 KV cache (EngineConfig.kv_cache_dtype="fp8"): every kernel that writes or reads it against the same
# arithmetic on the dequantized values

def test_the_kv_write_kernel_stores_what_fp8_to_cache_rounds():
    torch.manual_seed(3)
    t, hq, hk, d, page = 37, 32, 8, 128, 16
    q = torch.randn(t, hq, d, device="cuda").bfloat16()
    k = torch.randn(t, hk, d, device="cuda").bfloat16()          # goes through the qk-norm: stays small
    v = (torch.randn(t, hk, d, device="cuda") * 300).bfloat16()  # many past e4m3's 448: clamped, never NaN
    angles = torch.rand(t, 1, d // 2, device="cuda") * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    norm = torch.rand(d, device="cuda").bfloat16() + 0.5
    cache = torch.zeros(4, 2, page, hk, d, dtype=fp8.FP8, device="cuda")
    slots = torch.randperm(4 * page, device="cuda")[:t]
    fused.norm_rope_store_(q, k, v, cos, sin, norm, norm, 1e-6, cache, slots // page, slots % page)
    # k now holds its normed and rotated values in bf16: the cache holds exactly those, rounded
    stored = cache.float()[slots // page, :, slots % page]   # [t, 2, hk, d]
    assert torch.equal(stored[:, 0], fp8.to_cache(k, fp8.FP8).float())
    assert torch.equal(stored[:, 1], fp8.to_cache(v, fp8.FP8).float())
    assert cache.float().abs().max() == fp8.FP8_MAX and not cache.float().isnan().any()


@pytest.mark.parametrize("batch_size", [1, 16, 200])
def test_the_decode_kernels_read_an_fp8_cache_as_its_dequantized_values(batch_size):
    lengths, tables, cache, q = scattered(batch_size)
    cache = fp8.to_cache(cache, fp8.FP8)
    scale = D ** -0.5
    expected = paged_decode.reference(q, cache.float(), tables, lengths, scale).float()
    split = paged_decode.PagedDecode(batch_size, MAX_BLOCKS, PAGE, HEADS, KV_HEADS, D, torch.device("cuda"))
    split.prepare(tables, lengths)
    torch.testing.assert_close(split.forward(q, cache, scale).float(), expected, atol=2 ** -7, rtol=2 ** -7)
    # the engine's configuration for an FP8 cache; K and V as the products' left operands; products in fp16; two
    # and four KV heads a program; the head dimension permuted (at tiles of 128, 64 and 256 tokens, and with
    # fewer registers: spilled); the softmax sums added up after the last tile; the table read a tile ahead
    variants = ({"kv_a": True}, {"f16": True}, {"kv_a": True, "f16": True}, {"kv_a": True, "f16": True, "heads": 2},
                {"kv_a": True, "f16": True, "heads": 4, "block_t": 32}, {"kv_a": True, "f16": True, "perm": True},
                {"kv_a": True, "f16": True, "perm": True, "block_t": 64, "stages": 3},
                {"kv_a": True, "f16": True, "perm": True, "block_t": 256},
                {"kv_a": True, "f16": True, "perm": True, "maxnreg": 96},
                {"kv_a": True, "f16": True, "perm": True, "defer_sum": True},
                {"kv_a": True, "f16": True, "heads": 2, "defer_sum": True},
                {"kv_a": True, "f16": True, "perm": True, "prefetch_table": True, "stages": 3},
                {"kv_a": True, "f16": True, "prefetch_table": True, "defer_sum": True, "block_t": 64, "stages": 4})
    for options in (paged_decode.streamed_config(cache.dtype),
                    *({"block_t": 128, "stages": 2} | variant for variant in variants)):
        streamed = paged_decode.StreamedDecode(batch_size, MAX_BLOCKS, PAGE, HEADS, KV_HEADS, D,
                                               torch.device("cuda"),
                                               pool=paged_decode.streamed_pool(batch_size, KV_HEADS, 132), **options)
        streamed.stage(padded(tables), np.array(lengths))
        torch.testing.assert_close(streamed.forward(q, cache, scale).float(), expected, **STREAMED_CLOSE)


def test_fp16_products_clamp_a_query_past_fp16s_range_instead_of_overflowing():
    """The engine's FP8-cache decode rounds q to fp16 (streamed_config's f16): a query value past fp16's 65,504,
    which bf16 holds, is clamped to it, so the output stays finite and equals the reference's with q clamped."""
    lengths, tables, cache, q = scattered(40)
    cache = fp8.to_cache(cache, fp8.FP8)
    q = q.clone()
    q[3, 5, 7], q[9, 0, 0] = 2.0 ** 17, -(2.0 ** 17)
    clamped = q.float().clamp(-65504, 65504)   # in fp32: bf16 would round 65,504 up to 65,536
    scale = D ** -0.5 / 1024   # the clamped heads' scores stay within a few units: their softmax is not one-hot
    expected = paged_decode.reference(clamped, cache.float(), tables, lengths, scale).float()
    streamed = paged_decode.StreamedDecode(40, MAX_BLOCKS, PAGE, HEADS, KV_HEADS, D, torch.device("cuda"),
                                           pool=paged_decode.streamed_pool(40, KV_HEADS, 132),
                                           **paged_decode.streamed_config(cache.dtype))
    streamed.stage(padded(tables), np.array(lengths))
    got = streamed.forward(q, cache, scale).float()
    assert got.isfinite().all()
    torch.testing.assert_close(got, expected, **STREAMED_CLOSE)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, fp8.FP8])
@pytest.mark.parametrize("query_lens", [[17, 300, 400, 1000], [17, 45, 1, 200], [10, 300, 45, 200],
                                        [5, 300, 400, 1000]])
def test_a_prefill_step_attends_over_its_own_k_and_v_merged_with_the_cached_prefixes(query_lens, kv_dtype,
                                                                                      monkeypatch):
    """attention.RAGGED_PREFILL: flashinfer's ragged prefill over the step's own K and V (bf16), merged where a
    sequence has a cached prefix with a paged attention over the prefix's pages (over the rows of the sequences from
    the first with a prefix to the last), against SDPA over a cache whose prefix tokens are as the cache stores them
    and whose new tokens are the step's own bf16 values. The first case has no prefix (the ragged kernel alone); the
    second a prefix of 283 tokens, one of 399 before a single new token and one of 800 (the span's rows all have
    one); the third a sequence without one between two with one (its rows masked in the merge); the fourth only the
    first sequence has one, 12 tokens (a step that continues a prompt cut at the step before)."""
    from ember.runtime.engine import attention

    monkeypatch.setattr(attention, "RAGGED_PREFILL", True)
    g = torch.Generator().manual_seed(sum(query_lens))
    lengths, tables, cache, _ = paged([17, 300, 400, 1000], g)
    new = [(table[p // PAGE], p % PAGE) for table, n, m in zip(tables, lengths, query_lens) for p in range(n - m, n)]
    blocks = torch.tensor([b for b, _ in new], device="cuda")
    offsets = torch.tensor([o for _, o in new], device="cuda")
    k, v = cache[blocks, 0, offsets], cache[blocks, 1, offsets]   # [T, KV_HEADS, D], the step's own
    stored = fp8.to_cache(cache, kv_dtype)
    seen = stored.to(torch.bfloat16)
    seen[blocks, 0, offsets], seen[blocks, 1, offsets] = k, v
    q = torch.randn(len(new), HEADS, D, generator=g).bfloat16().cuda()
    batch = AttentionBatch(np.array(query_lens, dtype=np.int32), np.array(lengths, dtype=np.int32), padded(tables),
                           np.array([len(t) for t in tables], dtype=np.int32), blocks, offsets)
    backend = FlashInferBackend(HEADS, KV_HEADS, D, PAGE, D ** -0.5, dtype=torch.bfloat16,
                                device=torch.device("cuda"), kv_dtype=kv_dtype)
    backend.plan(batch)
    assert backend.fresh and (backend.prefix_span is None) == (query_lens == lengths)
    assert (backend.prefix_rows is not None) == (query_lens == [10, 300, 45, 200])   # a row masked in the span
    got = backend.attend(q, stored, k, v)
    sdpa = SdpaBackend(HEADS, KV_HEADS, D, PAGE, D ** -0.5)
    sdpa.plan(batch)
    torch.testing.assert_close(got.float(), sdpa.attend(q, seen).float(), **STREAMED_CLOSE)
    monkeypatch.setattr(attention, "RAGGED_PREFILL", False)   # the cache's own attention, unchanged
    backend.plan(batch)
    torch.testing.assert_close(backend.attend(q, stored, k, v).float(), sdpa.attend(q, stored).float(),
                               **STREAMED_CLOSE)


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 17, 45, 200]])
def test_flashinfer_reads_an_fp8_cache_as_its_dequantized_values(query_lens):
    """The eager decode and the prefill wrappers (planned with kv_data_type float8 e4m3) against SDPA over the
    cache dequantized to bf16."""
    g = torch.Generator().manual_seed(len(query_lens) + sum(query_lens))
    lengths, tables, cache, _ = paged([1, 17, 300, 1000], g)
    cache = fp8.to_cache(cache, fp8.FP8)
    q = torch.randn(sum(query_lens), HEADS, D, generator=g).bfloat16().cuda()
    slots = torch.zeros(sum(query_lens), dtype=torch.long, device="cuda")   # no K/V written: attention only
    batch = AttentionBatch(np.array(query_lens, dtype=np.int32), np.array(lengths, dtype=np.int32), padded(tables),
                           np.array([len(t) for t in tables], dtype=np.int32), slots, slots)
    backend = FlashInferBackend(HEADS, KV_HEADS, D, PAGE, D ** -0.5, dtype=torch.bfloat16,
                                device=torch.device("cuda"), kv_dtype=fp8.FP8)
    backend.plan(batch)
    sdpa = SdpaBackend(HEADS, KV_HEADS, D, PAGE, D ** -0.5)
    sdpa.plan(batch)
    torch.testing.assert_close(backend.attend(q, cache).float(), sdpa.attend(q, cache).float(), **STREAMED_CLOSE)
