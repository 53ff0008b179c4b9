"""The Triton kernels of runtime/engine/fused.py against their torch reference paths, in bf16 on the GPU."""
import pytest
import torch

from ember.runtime.engine import fused

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(fused.triton is None, reason="needs Triton")]


def randn(*shape) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=torch.Generator("cuda").manual_seed(sum(shape))).bfloat16()


def close(a: torch.Tensor, b: torch.Tensor, equal_fraction: float = 0.98) -> None:
    """Within a bf16 rounding step of the reference, and mostly equal to it."""
    assert (a.float() - b.float()).abs().max().item() <= 2 ** -6 * b.float().abs().max().item()
    assert (a == b).float().mean().item() > equal_fraction


@pytest.mark.parametrize("hidden", [1024, 2560, 4096])
def test_rms_norm_and_residual_add(hidden):
    x, residual, weight = randn(37, hidden), randn(37, hidden), randn(hidden)
    close(fused.rms_norm(x, weight, 1e-6), fused._rms_norm_reference(x, weight, 1e-6))
    out, total = fused.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, residual + x)
    close(out, fused._rms_norm_reference(residual + x, weight, 1e-6))


def test_silu_mul_of_the_merged_gate_up_product():
    gate_up = randn(19, 2 * 12288)
    close(fused.silu_mul(gate_up), torch.nn.functional.silu(gate_up[:, :12288]) * gate_up[:, 12288:])


def rope_tables(t: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(t, device="cuda")[:, None] * torch.rand(d // 2, device="cuda")
    emb = torch.cat((angles, angles), -1)   # RoPE's cos and sin repeat across the halves of a head
    return emb.cos().bfloat16()[:, None, :], emb.sin().bfloat16()[:, None, :]


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("t, hq, hk", [(23, 32, 8), (5, 32, 8), (300, 32, 8), (40, 16, 8), (37, 12, 2), (9, 12, 2),
                                       (64, 40, 8), (200, 40, 8)])
def test_norm_rope_store_rotates_q_and_k_in_place_and_stores_k_and_v_in_their_slots(with_norm, t, hq, hk):
    """q, k and v as the engine passes them: strided views into one [T, q + 2 kv] product; batches below and above
    fused.ROPE_WIDE_FROM (4 heads a program, 8), head counts not a multiple of a group."""
    d = 128
    qkv = randn(t, (hq + 2 * hk) * d)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    v_before = v.clone()
    cos, sin = rope_tables(t, d)
    weights = (randn(d), randn(d)) if with_norm else (None, None)
    expected = []
    for x, w in zip((q, k), weights):
        h = fused._rms_norm_reference(x, w, 1e-6) if w is not None else x
        expected.append(fused._rope_reference(h, cos, sin))
    cache = torch.zeros(40, 2, 16, hk, d, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(40 * 16, device="cuda")[:t]   # distinct slots, in no order
    blocks, offsets = slots // 16, slots % 16
    fused.norm_rope_store_(q, k, v, cos, sin, *weights, 1e-6, cache, blocks, offsets)
    close(q, expected[0])
    close(k, expected[1])
    assert torch.equal(v, v_before)
    assert torch.equal(cache[blocks, 0, offsets], k) and torch.equal(cache[blocks, 1, offsets], v)
    assert cache.float().abs().sum().item() == pytest.approx((k.float().abs().sum() + v.float().abs().sum()).item(),
                                                             rel=1e-3)   # nothing written outside the slots


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 12288), (151936, 4096), (1000, 4100), (32768, 1024),
                                  (6144, 2560), (2560, 9728), (19456, 2560), (1024, 2048), (1000, 1030)])
def test_single_row_products_match_cublas(n, k):
    """gemv.py's kernel where it applies (a reduction of 1024 or more, or a vocabulary), including sizes that are
    not a multiple of its tiles; each output is the fp32 sum rounded once, so it sits within a rounding step of
    cuBLAS's and mostly equals it."""
    from ember.runtime.engine import gemv

    x, weight = randn(1, k), randn(n, k) * 0.05
    assert gemv.applies(x, weight, None)
    reference = torch.nn.functional.linear(x, weight)
    close(gemv.linear(x, weight), reference, equal_fraction=0.9)
    layer = gemv.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
    assert torch.equal(layer(x), gemv.linear(x, weight))


def test_products_the_kernel_does_not_take_are_cublas_s():
    from ember.runtime.engine import gemv

    weight = randn(4096, 4096)
    for x in (randn(2, 4096), randn(1, 4096)[:, :512]):   # two rows; a reduction too short for the kernel
        w = weight[:, :x.shape[1]].contiguous()
        assert not gemv.applies(x, w, None)
        assert torch.equal(gemv.linear(x, w), torch.nn.functional.linear(x, w))
    x = randn(1, 4096)
    assert not gemv.applies(x, weight, randn(4096))   # a bias
    assert not gemv.applies(x, weight.t(), None)      # a weight not in rows


@pytest.mark.parametrize("n, k", [(6144, 4096), (24576, 4096), (1000, 4100), (6144, 2560), (4096, 1024)])
@pytest.mark.parametrize("first", [False, True])
def test_a_single_rows_norm_and_product_in_one_kernel_match_them_apart(n, k, first):
    """gemv.norm_linear: the residual sum as add_rms_norm writes it, and the product of the normed row as the
    kernel computes it from add_rms_norm's output (the row's sum of squares summed in another order: within a
    rounding step, mostly equal)."""
    from ember.runtime.engine import gemv

    x, residual, norm, weight = randn(1, k), randn(2, k)[1:], randn(k), randn(n, k) * 0.05
    assert gemv.applies(x, weight, None)
    out, total = gemv.norm_linear(x, None if first else residual, norm, 1e-6, weight)
    if first:
        h, expected_total = fused.rms_norm(x, norm, 1e-6), x
    else:
        h, expected_total = fused.add_rms_norm(x, residual, norm, 1e-6)
    assert torch.equal(total, expected_total)
    close(out, gemv.gemv(h, weight), equal_fraction=0.95)
    close(out, torch.nn.functional.linear(h, weight), equal_fraction=0.9)
    wide = randn(2, k)   # two rows: the kernels apart
    out, total = gemv.norm_linear(wide, None if first else randn(2, k), norm, 1e-6, weight)
    assert out.shape == (2, n)



# Every kernel that rounds through fused._round, on fixed inputs; run in a fresh process (Triton keys a compiled
# kernel by the constexpr globals it reads and refuses one changed under it), its outputs saved to argv[1].
ROUNDING_KERNELS = '''
import sys
import torch
import triton.language as tl
from ember.runtime.engine import fp8, fused, gemv
fused.PACKED_ROUND = tl.constexpr(sys.argv[2] == "packed")
g = torch.Generator("cuda").manual_seed(0)
def randn(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()
out = {}
x, residual, weight = randn(300, 4096, scale=3.0), randn(300, 4096, scale=3.0), randn(4096) + 1
unscaled = fp8.Unscaled(randn(300, 4096, scale=300.0), torch.rand(300, 1, device="cuda", generator=g) * 1e-2,
                        torch.rand(4096, device="cuda", generator=g) * 1e-2)
for rows in (1, 64, 256, 300):
    out[f"norm{rows}"] = fused.rms_norm(x[:rows], weight, 1e-6)
    out[f"add_norm{rows}"] = fused.add_rms_norm(x[:rows], residual[:rows], weight, 1e-6)
    out[f"norm_fp8{rows}"] = fused.rms_norm_fp8(x[:rows], residual[:rows], weight, 1e-6)
    part = fp8.Unscaled(unscaled.raw[:rows], unscaled.row_scale[:rows], unscaled.col_scale)
    out[f"norm_fp8_unscaled{rows}"] = fused.rms_norm_fp8(part, residual[:rows], weight, 1e-6)
gate_up = randn(300, 2 * 12288, scale=3.0)
gate_scaled = fp8.Unscaled(randn(300, 2 * 12288, scale=300.0), unscaled.row_scale,
                           torch.rand(2 * 12288, device="cuda", generator=g) * 1e-2)
for rows in (1, 256, 300):
    out[f"silu{rows}"] = fused.silu_mul(gate_up[:rows])
    for one_pass in (True, False):
        out[f"silu_fp8{rows}{one_pass}"] = fused.silu_mul_fp8(gate_up[:rows], one_pass)
        part = fp8.Unscaled(gate_scaled.raw[:rows], gate_scaled.row_scale[:rows], gate_scaled.col_scale)
        out[f"silu_fp8_unscaled{rows}{one_pass}"] = fused.silu_mul_fp8(part, one_pass)
hq, hk, d = 32, 8, 128
for rows in (1, 256):
    qkv = fp8.Unscaled(randn(rows, (hq + 2 * hk) * d, scale=300.0), unscaled.row_scale[:rows],
                       torch.rand((hq + 2 * hk) * d, device="cuda", generator=g) * 1e-2)
    q, k, v = (t.view(rows, -1, d) for t in qkv.raw.split([hq * d, hk * d, hk * d], dim=-1))
    cos, sin = randn(rows, 1, d), randn(rows, 1, d)
    cache = torch.zeros(-(-rows // 16), 2, 16, hk, d, device="cuda", dtype=fp8.FP8)
    slots = torch.arange(rows, device="cuda")
    fused.norm_rope_store_(q, k, v, cos, sin, randn(d) + 1, randn(d) + 1, 1e-6, cache, slots // 16, slots % 16,
                           (qkv.row_scale, qkv.col_scale))
    out[f"rope{rows}"] = (qkv.raw, cache.view(torch.uint8))
w = randn(6144, 4096, scale=0.02)
out["norm_gemv"] = gemv.norm_gemv(x[:1], residual[:1], weight, 1e-6, w)
torch.save(out, sys.argv[1])
'''


def test_packed_rounding_gives_every_kernel_the_integer_roundings_bits(tmp_path):
    """fused.PACKED_ROUND: _round's bf16 rounding as a packed conversion (cvt.rn.bf16x2.f32) in place of the integer
    arithmetic: the RMSNorm kernels (with the residual add, quantizing, on an fp8.Unscaled input), the SiLU-mul ones
    (one pass and two, quantizing, Unscaled), the RoPE/KV-store kernel on an Unscaled q/k/v product and the fused
    norm and single-row product, at decode and prefill rows, give the same bits both ways."""
    import subprocess
    import sys

    script = tmp_path / "kernels.py"
    script.write_text(ROUNDING_KERNELS)
    results = {}
    for way in ("integer", "packed"):
        path = tmp_path / f"{way}.pt"
        done = subprocess.run([sys.executable, str(script), str(path), way], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        results[way] = torch.load(path)

    def flat(value):
        return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in
                (value if isinstance(value, (tuple, list)) else (value,))]

    assert results["integer"].keys() == results["packed"].keys()
    for name, value in results["integer"].items():
        for a, b in zip(flat(value), flat(results["packed"][name])):
            assert torch.equal(a, b), name


def test_packed_rounding_stays_on_from_ampere_and_turns_off_before(monkeypatch):
    """fused.fit_to, which the engine calls for its device: the packed conversion is an sm_80 instruction, so a GPU
    of compute capability under 8.0 gets the integer rounding (the kernels would not compile otherwise); this GPU,
    and any from 8.0, keeps the packed one."""
    device = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setattr(fused, "PACKED_ROUND", fused.tl.constexpr(True))
    fused.fit_to(device)
    assert fused.PACKED_ROUND.value is (torch.cuda.get_device_capability(device) >= (8, 0))
    monkeypatch.setattr(fused, "PACKED_ROUND", fused.tl.constexpr(True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    fused.fit_to(device)
    assert fused.PACKED_ROUND.value is False
    fused.fit_to(torch.device("cpu"))   # not a GPU: nothing to fit
    assert fused.PACKED_ROUND.value is False
