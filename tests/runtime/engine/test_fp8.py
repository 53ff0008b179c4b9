"""FP8 weights (runtime/engine/fp8.py): the quantization's arithmetic, and an engine with quantization="fp8" against
transformers whose products run the same arithmetic (CPU, fp32; the GPU's kernels: tests/gpu/test_engine_gpu.py)."""
import copy
import dataclasses

import pytest
import torch
from torch import nn

from ember.runtime.engine import fp8
from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.models import loader
from ember.runtime.engine.sampling import SamplingParams
from ember.snapshot import LocalStore

from .hf_models import logprob_gaps, random_prompts

E4M3_HALF_ULP = 2.0 ** -4   # e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 1/16 of it


def test_weight_rows_quantize_to_e4m3_within_half_an_ulp_each():
    torch.manual_seed(0)
    w = torch.randn(48, 300) * torch.logspace(-3, 1, 48)[:, None]   # rows of very different sizes
    w[7] = 0.0
    q, scale = fp8.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (48,)
    assert torch.equal(scale[7], torch.tensor(fp8.MIN_SCALE)) and not q[7].float().any()
    # each row's largest value lands on e4m3's largest, so the row uses the whole range
    assert torch.equal(q.float().abs().amax(dim=1)[torch.arange(48) != 7], torch.full((47,), fp8.FP8_MAX))
    back = q.float() * scale[:, None]
    normal = w.abs() >= scale[:, None] * 2.0 ** -6   # e4m3's smallest normal, in each row's units
    assert ((back - w).abs() <= E4M3_HALF_ULP * w.abs() + 1e-12)[normal].all()
    assert ((back - w).abs() <= scale[:, None] * 2.0 ** -10)[~normal].all()   # subnormals: a fixed step


def test_a_product_quantizes_each_input_row_by_its_own_scale():
    torch.manual_seed(1)
    w, x = torch.randn(40, 256) * 0.05, torch.randn(6, 256)
    x[2] *= 1e5   # one loud row must not crush the others' precision (one scale for all would)
    q, scale = fp8.quantize_rows(w)
    out = fp8.linear(x, q, scale)
    exact = x @ w.t()
    relative = (out - exact).norm(dim=1) / exact.norm(dim=1)
    assert relative.max() < 0.08, relative
    # the arithmetic is exactly a product of the dequantized values
    xq, xs = fp8.quantize_tokens(x)
    assert torch.allclose(out, (xq.float() * xs) @ (q.float() * scale[:, None]).t(), rtol=1e-6, atol=1e-6)
    bias = torch.randn(40)
    assert torch.allclose(fp8.linear(x, q, scale, bias), out + bias, rtol=1e-6, atol=1e-6)


def fake_quantized(model):
    """A copy of the transformers model whose decoder products run fp8.linear's arithmetic: weights quantized per
    row, inputs per token (the head and embedding as they are)."""
    model = copy.deepcopy(model)

    class Quantized(nn.Module):
        def __init__(self, linear: nn.Linear):
            super().__init__()
            self.weight, self.scale = fp8.quantize_rows(linear.weight.detach())
            self.bias = linear.bias

        def forward(self, x):
            rows = x.reshape(-1, x.shape[-1])
            return fp8.linear(rows, self.weight, self.scale, self.bias).reshape(*x.shape[:-1], -1)

    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                setattr(parent, name, Quantized(getattr(parent, name)))
    return model


def engine(model_dir: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, **{"max_num_seqs": 8, "num_kv_blocks": 128, **overrides}))


def test_an_fp8_engine_computes_what_transformers_computes_with_the_same_quantization(model_family):
    model_dir, model = model_family
    eng = engine(model_dir, quantization="fp8")
    weights = {name: p for name, p in eng.runner.model.named_parameters()}
    products = [name for name in weights if name.endswith("proj.weight")]
    assert products and all(weights[name].dtype == torch.float8_e4m3fn for name in products)
    assert all(weights[name.replace(".weight", ".weight_scale")].dtype == torch.float32 for name in products)
    assert weights["model.embed_tokens.weight"].dtype == torch.float32   # the embedding (and head) as they were
    quantized = fake_quantized(model)
    prompts = random_prompts([5, 23, 40], seed=3)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)
    for prompt in prompts:
        eng.add_request(str(len(prompt)), prompt, greedy)
    outputs: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            outputs.setdefault(out.request_id, []).extend(out.new_logprobs or [])
    same_token, to_quantized, to_unquantized = logprob_gaps([outputs[str(len(p))] for p in prompts], prompts,
                                                             quantized, model)
    # Most logprobs equal the reference's to fp32 rounding; where the two sides' hidden states differ in the last
    # bit (their sums run in other orders), a value on an e4m3 rounding boundary can round the other way, which
    # moves a logprob by a few hundredths: quantization magnifies last-bit differences.
    assert sum(same_token) >= 0.9 * len(same_token)
    assert torch.tensor(to_quantized).median() < 1e-5 and max(to_quantized) < 0.1
    assert torch.tensor(to_unquantized).median() > 0.01, "the fp8 engine computes the unquantized model"


def test_an_fp8_snapshot_holds_the_quantized_weights_and_never_serves_the_unquantized_model(
        model_family, tmp_path, monkeypatch):
    model_dir, _ = model_family
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    monkeypatch.delenv("EMBER_SNAPSHOT_STORE", raising=False)
    prompts = random_prompts([9, 30], seed=4)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = engine(model_dir, snapshot_store="local")
    first = engine(model_dir, snapshot_store="local", quantization="fp8")
    assert first.runner.weights_start.source == "full"   # the bf16/fp32 snapshot is not its
    assert "-fp8." in first.runner.weights_start.captured.names[0]
    expected = first.generate(prompts, greedy)
    restored = engine(model_dir, snapshot_store="local", quantization="fp8")
    assert restored.runner.weights_start.source == "snapshot"
    assert restored.generate(prompts, greedy) == expected
    sizes = {name: ref.size for ref in LocalStore().ls() for name in ref.names}
    fp8_key, plain_key = loader.snapshot_key(model_dir, torch.float32, "fp8"), loader.snapshot_key(model_dir,
                                                                                                  torch.float32)
    assert plain.runner.weights_start.source == "full" and set(sizes) == {fp8_key, plain_key}
    assert sizes[fp8_key] < sizes[plain_key]   # one byte a product weight where fp32 takes four


def test_quantization_settings_are_checked():
    with pytest.raises(ValueError, match="use 'fp8'"):
        EngineConfig(model="unused", quantization="int4")
    assert fp8.unsupported(torch.device("cpu"), torch.float32) is None


def test_the_small_product_kernel_takes_only_the_rows_and_reductions_it_was_set_for(monkeypatch):
    assert fp8.small_config(2, 4096, 4096) == fp8.small_config(fp8.SMALL_MAX_ROWS, 4096, 12288) == fp8.SMALL_CONFIG
    # a single row is gemv.py's; more rows, or a reduction the tile does not divide, _scaled_mm's
    assert fp8.small_config(1, 4096, 4096) is fp8.small_config(fp8.SMALL_MAX_ROWS + 1, 4096, 4096) is None
    assert fp8.small_config(16, 4096, fp8.SMALL_CONFIG.block_k + 128) is None
    # given the multiprocessors, a product of few blocks of weight rows (o_proj's and down_proj's 64 on an H100's 132)
    # splits K: in 4 up to 16 rows, in 2 up to 64; never one of many blocks, nor where K does not divide
    base = fp8.SMALL_CONFIG
    assert fp8.small_config(16, 4096, 12288, 132) == dataclasses.replace(base, split_k=4)
    assert fp8.small_config(64, 4096, 4096, 132) == dataclasses.replace(base, split_k=2)
    assert fp8.small_config(65, 4096, 4096, 132) is fp8.small_config(16, 24576, 4096, 132) is base
    assert fp8.small_config(16, 4096, 768, 132) is base   # 768 is no multiple of 4 x 256
    assert fp8.small_config(16, 4096, 4096, 110) == dataclasses.replace(base, split_k=4)
    assert fp8.small_config(16, 4096, 4096, 100) is base   # 64 blocks fill most of 100 multiprocessors
    split = fp8.SmallConfig(block_k=256, split_k=2)   # each of 2 programs sums half of K, whole tiles
    monkeypatch.setattr(fp8, "SMALL_CONFIG", split)
    assert fp8.small_config(16, 4096, 4096) is split and fp8.small_config(16, 4096, 768) is None
    q, weight = torch.zeros(16, 768, dtype=fp8.FP8), torch.zeros(64, 768, dtype=fp8.FP8)
    with pytest.raises(ValueError, match="K=768 is not a multiple of block_k=256 x split_k=2"):
        fp8.small_linear(q, torch.ones(16, 1), weight, torch.ones(64), torch.bfloat16, split)
    for block_m in (8, 48):   # blocks of input rows take the MMA's narrow side: a power of 2, 16 or more
        with pytest.raises(ValueError, match=f"block_m={block_m} is not a power of 2 of 16 or more"):
            fp8.small_linear(q, torch.ones(16, 1), weight, torch.ones(64), torch.bfloat16,
                             fp8.SmallConfig(block_k=256, block_m=block_m))
    for prefetch in (100, 384, 1024):   # 128-byte lines, a power of 2 of them, within the program's 768 columns
        with pytest.raises(ValueError, match=f"prefetch={prefetch} is not a power of 2 of 128 or more bytes"):
            fp8.small_linear(q, torch.ones(16, 1), weight, torch.ones(64), torch.bfloat16,
                             fp8.SmallConfig(block_k=256, prefetch=prefetch))
    blocked = fp8.SmallConfig(block_n=128, block_k=128, block_m=64)   # past SMALL_MAX_ROWS, blocks of input rows
    monkeypatch.setattr(fp8, "BLOCKED_CONFIG", blocked)
    assert fp8.small_config(fp8.SMALL_MAX_ROWS + 1, 4096, 4096) is fp8.small_config(fp8.BLOCKED_MAX_ROWS, 4096, 4096)
    assert fp8.small_config(fp8.SMALL_MAX_ROWS + 1, 4096, 4096) is blocked
    assert fp8.small_config(fp8.BLOCKED_MAX_ROWS + 1, 4096, 4096) is None
    monkeypatch.setattr(fp8, "SMALL_CONFIG", None)
    assert fp8.small_config(16, 4096, 4096) is None   # unset: torch._scaled_mm for those rows
    assert fp8.small_config(fp8.SMALL_MAX_ROWS + 1, 4096, 4096) is blocked


def test_the_silu_kernel_reads_a_row_once_only_where_its_registers_hold_it(monkeypatch):
    """fused.silu_mul_fp8's one_pass holds a row in registers: a longer row is refused by name, before any kernel,
    and the module's default (SILU_ONE_PASS) reads it twice instead; on the CPU, either way gives the quantized
    SiLU-mul."""
    from ember.runtime.engine import fused

    gate_up = torch.randn(3, 2 * 40, dtype=torch.bfloat16)
    want = fp8.quantize_tokens(fused.silu_mul(gate_up))
    for one_pass in (False, True):
        out, scale = fused.silu_mul_fp8(gate_up, one_pass=one_pass)
        assert torch.equal(out.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scale, want[1])
    too_long = torch.zeros(1, 2 * (fused.SILU_ONE_PASS_MAX + 1), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"at most {fused.SILU_ONE_PASS_MAX} values"):
        fused.silu_mul_fp8(too_long, one_pass=True)
    assert fused.silu_mul_fp8(too_long)[0].shape == (1, fused.SILU_ONE_PASS_MAX + 1)
    monkeypatch.setattr(fused, "SILU_ONE_PASS", True)
    assert fused.silu_mul_fp8(too_long)[0].shape == (1, fused.SILU_ONE_PASS_MAX + 1)
    out, scale = fused.silu_mul_fp8(gate_up)
    assert torch.equal(out.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scale, want[1])


def test_the_fp8_engines_norms_take_more_warps_up_to_decode_rows_only(monkeypatch):
    """fused._norm_warps: the RMSNorm calls that quantize (the FP8 engine's) of up to NORM_DECODE_ROWS rows take
    NORM_FP8_DECODE_WARPS, longer ones Triton's default; the ones that do not quantize NORM_DECODE_WARPS where set;
    NORM_WARPS, where set, overrides every call (bench/engine/ab.py sets it to time the rule)."""
    from ember.runtime.engine import fused

    wide = {"num_warps": fused.NORM_FP8_DECODE_WARPS}
    assert fused.NORM_WARPS is None and fused.NORM_DECODE_WARPS is None and fused.NORM_FP8_DECODE_WARPS > 4
    assert fused._norm_warps(1, True) == wide == fused._norm_warps(fused.NORM_DECODE_ROWS, True)
    assert fused._norm_warps(fused.NORM_DECODE_ROWS + 1, True) == {}
    assert fused._norm_warps(1, False) == {} == fused._norm_warps(8192, False)
    monkeypatch.setattr(fused, "NORM_DECODE_WARPS", 8)
    assert fused._norm_warps(fused.NORM_DECODE_ROWS, False) == {"num_warps": 8}
    assert fused._norm_warps(fused.NORM_DECODE_ROWS + 1, False) == {}
    monkeypatch.setattr(fused, "NORM_WARPS", 4)
    assert fused._norm_warps(1, True) == fused._norm_warps(1, False) == {"num_warps": 4}
    assert fused._norm_warps(8192, True) == {"num_warps": 4}


def test_a_single_rows_fp8_o_and_down_products_take_thinner_programs(monkeypatch):
    """gemv.config_for: an FP8 weight's products of the 8B shape's o and down sizes take FP8_THIN (an iteration's
    FP8 columns are half bf16's bytes); bf16 weights, other sizes and FP8_THIN None keep bf16's configurations."""
    from ember.runtime.engine import gemv

    for n, k in ((4096, 4096), (4096, 12288)):
        assert gemv.config_for(n, k, fp8_weight=True) == gemv.FP8_THIN != gemv.config_for(n, k)
    for n, k in ((6144, 4096), (24576, 4096), (2560, 4096), (4096, 2048), (151936, 4096)):
        assert gemv.config_for(n, k, fp8_weight=True) == gemv.config_for(n, k)
    monkeypatch.setattr(gemv, "FP8_THIN", None)
    assert gemv.config_for(4096, 4096, fp8_weight=True) == gemv.config_for(4096, 4096)


def test_split_products_share_zeroed_counts_and_keep_the_ones_a_graph_may_hold(monkeypatch):
    """small_linear's split_k counts: one zeroed buffer a device, grown for a product with more blocks; the buffer it
    outgrew stays alive, since a CUDA graph captured with it still writes there."""
    monkeypatch.setattr(fp8, "_ARRIVED", {})
    monkeypatch.setattr(fp8, "_OUTGROWN", [])
    cpu = torch.device("cpu")
    first = fp8._arrival_counts(cpu, 64)
    assert first.dtype == torch.int32 and first.numel() >= 64 and not first.any()
    assert fp8._arrival_counts(cpu, first.numel()) is first
    grown = fp8._arrival_counts(cpu, first.numel() + 1)
    assert grown.numel() > first.numel() and not grown.any() and fp8._OUTGROWN == [first]


def test_an_unscaled_product_output_reads_as_its_scaled_values_everywhere_it_is_passed():
    """fp8.Unscaled (deferred_linear's output, whose scales the next kernel applies as it loads it): the norms, the
    SiLU-mul and the products after them give on it what they give on its scaled values; on the CPU, where no
    kernel takes it, deferred_linear returns quantized_linear's output itself."""
    from ember.runtime.engine import fused, gemv

    torch.manual_seed(4)
    rows, n = 5, 64
    raw = (torch.randn(rows, n) * 300).to(torch.bfloat16)
    row_scale, col_scale = torch.rand(rows, 1) * 1e-3 + 1e-4, torch.rand(n) * 1e-3 + 1e-4
    unscaled = fp8.Unscaled(raw, row_scale, col_scale)
    scaled = unscaled.materialize()
    assert unscaled.shape == raw.shape and unscaled.dtype == torch.bfloat16 and scaled.dtype == torch.bfloat16
    torch.testing.assert_close(scaled.float(), raw.float() * row_scale * col_scale, rtol=2 ** -8, atol=0)
    residual, norm = torch.randn(rows, n).to(torch.bfloat16), (torch.rand(n) + 0.5).to(torch.bfloat16)

    def same(got, want):
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))

    same(fused.add_rms_norm(unscaled, residual, norm, 1e-6), fused.add_rms_norm(scaled, residual, norm, 1e-6))
    same(fused.rms_norm_fp8(unscaled, residual, norm, 1e-6), fused.rms_norm_fp8(scaled, residual, norm, 1e-6))
    same(fused.rms_norm_fp8(unscaled, None, norm, 1e-6), fused.rms_norm_fp8(scaled, None, norm, 1e-6))
    gate_up = fp8.Unscaled(raw.repeat(1, 2), row_scale, col_scale.repeat(2) * 3)
    same(fused.silu_mul_fp8(gate_up), fused.silu_mul_fp8(gate_up.materialize()))
    weight, scale = fp8.quantize_rows(torch.randn(48, n) * 0.05)
    down, down_scale = fp8.quantize_rows(torch.randn(48, n) * 0.05)
    for residual_or_none in (residual, None):
        for defer in (False, True):
            same(gemv.norm_linear(unscaled, residual_or_none, norm, 1e-6, weight, scale=scale, defer=defer),
                 gemv.norm_linear(scaled, residual_or_none, norm, 1e-6, weight, scale=scale))
    plain, plain_down = weight.to(torch.bfloat16), down.to(torch.bfloat16)   # no FP8 product after it
    same(gemv.norm_linear(unscaled, residual, norm, 1e-6, plain),
         gemv.norm_linear(scaled, residual, norm, 1e-6, plain))
    same([gemv.silu_mul_linear(gate_up, down, scale=down_scale, defer=True)],
         [gemv.silu_mul_linear(gate_up.materialize(), down, scale=down_scale)])
    same([gemv.silu_mul_linear(gate_up, plain_down)], [gemv.silu_mul_linear(gate_up.materialize(), plain_down)])
    q, q_scale = fp8.quantize_tokens(torch.randn(200, n))
    same([fp8.deferred_linear(q, q_scale, weight, scale, None, torch.float32)],
         [fp8.quantized_linear(q, q_scale, weight, scale, None, torch.float32)])


@pytest.mark.parametrize("n", [12288, 9728, 3072, 4096, 1000, 1025, 40000, 1])
@pytest.mark.parametrize("threads", [128, 512, 1024])
def test_the_one_pass_silu_kernel_holds_a_row_in_the_blocks_that_pad_it_least(n, threads):
    """fused.one_pass_chunks: the blocks (a power of two, at least a value a thread, at most 8 of them) cover the
    row, and no other such blocks cover it with fewer values held, or as few in fewer blocks; the Qwen3 shapes' rows
    (8B 12,288, 4B 9,728, 0.6B 3,072) held with no padding or under 6%."""
    from ember.runtime.engine import fused

    block, chunks = fused.one_pass_chunks(n, threads)
    assert block & (block - 1) == 0 and block >= threads and 1 <= chunks <= 8 and block * chunks >= n
    assert block * (chunks - 1) < n   # no block is all padding
    for other in (1 << i for i in range(32)):
        if other >= threads and -(-n // other) <= 8:
            assert (block * chunks, chunks) <= (other * -(-n // other), -(-n // other))
    if n in (12288, 3072):
        assert block * chunks == n
    if n == 9728:
        assert block * chunks < 1.06 * n


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, fp8.FP8])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_the_rope_kernel_reads_an_unscaled_qkv_product_as_its_scaled_values(kv_dtype, qk_norm):
    """fused.norm_rope_store_ with `scales` (fp8.DEFERRED_QKV: the merged q/k/v product's Unscaled output, whose
    raw columns are q's, k's and v's): q and k rotated in place, v scaled in place, and the cache's K and V as from
    the scaled product."""
    from ember.runtime.engine import fused

    torch.manual_seed(5)
    t, hq, hk, d = 3, 4, 2, 8
    width = (hq + 2 * hk) * d
    raw = (torch.randn(t, width) * 300).to(torch.bfloat16)
    unscaled = fp8.Unscaled(raw.clone(), torch.rand(t, 1) * 1e-3 + 1e-4, torch.rand(width) * 1e-3 + 1e-4)
    scaled = unscaled.materialize()
    cos, sin = torch.rand(t, 1, d).to(torch.bfloat16), torch.rand(t, 1, d).to(torch.bfloat16)
    norms = ((torch.rand(d) + 0.5).to(torch.bfloat16), (torch.rand(d) + 0.5).to(torch.bfloat16)) if qk_norm \
        else (None, None)
    blocks, offsets = torch.tensor([0, 1, 1]), torch.tensor([3, 0, 2])
    caches = []
    for qkv, scales in ((unscaled.raw, (unscaled.row_scale, unscaled.col_scale)), (scaled, None)):
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
        cache = torch.zeros(2, 2, 4, hk, d, dtype=kv_dtype)
        fused.norm_rope_store_(q, k, v, cos, sin, *norms, 1e-6, cache, blocks, offsets, scales)
        caches.append((q.clone(), k.clone(), v.clone(), cache.view(torch.uint8) if kv_dtype == fp8.FP8 else cache))
    for got, want in zip(*caches):
        assert torch.equal(got, want)
    assert caches[1][3].any()
