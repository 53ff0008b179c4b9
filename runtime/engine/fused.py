"""The decoder's small ops fused into Triton kernels on CUDA, with the torch code they replace as the reference.

A decode step is a few large matrix products and, between them, dozens of small elementwise kernels per layer
(RMSNorm alone is seven in torch). At small batches those launches and round trips through memory cost more
than the products; fused, each of these is one kernel. Each kernel rounds to the model's dtype where the torch
reference (and transformers) does, through `_round`: a plain `.to(bf16).to(fp32)` round trip is folded away by
Triton's compiler, and the kernels then drifted from transformers (teacher-forced agreement 0.945 where torch
gives 0.957). The CPU and every test without a GPU run the reference.

Triton compiles each kernel on its first call into TRITON_CACHE_DIR, which kernels.install() points into the
kernel directory that ships with the snapshots (EMBER_HOME/kernels/triton), so a replica's start loads them.
"""
import os

import torch
import torch.nn.functional as F

from . import fp8, pdl
from .pdl import start as _pdl_start

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs: the reference paths below run instead
    triton = None


def enabled(x: torch.Tensor, per_head: bool = False) -> bool:
    """On CUDA with Triton; per-head kernels cover a head in one block, so its size must be a power of two."""
    return triton is not None and x.is_cuda and (not per_head or x.shape[-1] & (x.shape[-1] - 1) == 0)


def fit_to(device: torch.device) -> None:
    """Turns PACKED_ROUND off for a GPU older than Ampere (compute capability 8.0), where its conversion instruction
    (cvt.rn.bf16x2.f32) does not exist and the kernels would not compile: there they round in integer arithmetic,
    to the same bits. The engine calls it for its device before any kernel compiles (Triton keys a kernel by the
    constexpr globals it reads, so one compiled before would keep its rounding)."""
    global PACKED_ROUND
    if triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        PACKED_ROUND = tl.constexpr(False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not enabled(x):
        return _rms_norm_reference(x, weight, eps)
    out = torch.empty_like(x)
    rows = x.reshape(-1, x.shape[-1])
    _rms_norm_kernel[(rows.shape[0],)](rows, rows, out, out, weight, rows.shape[-1], eps, HAS_RESIDUAL=False,
                                       BLOCK=triton.next_power_of_2(rows.shape[-1]),
                                       **_norm_warps(rows.shape[0], False), **pdl.args(x.device))
    return out


def add_rms_norm(x: "torch.Tensor | fp8.Unscaled", residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual + x): the sum is the next residual. x may be an FP8 product's Unscaled
    output, whose scales the kernel applies as it loads it."""
    x, scales = _scales_of(x)
    if not enabled(x):
        total = residual + x
        return _rms_norm_reference(total, weight, eps), total
    out, total = torch.empty_like(x), torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, residual, out, total, weight, x.shape[-1], eps, HAS_RESIDUAL=True,
                                    BLOCK=triton.next_power_of_2(x.shape[-1]), **_scale_args(scales),
                                    **_norm_warps(x.shape[0], False), **pdl.args(x.device))
    return out, total


def _scales_of(x: "torch.Tensor | fp8.Unscaled") -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(the tensor a kernel loads, the (row, column) scales it applies as it loads it, or None). An Unscaled output
    that no kernel here will take (on the CPU) is scaled first."""
    if not isinstance(x, fp8.Unscaled):
        return x, None
    if not enabled(x.raw):
        return x.materialize(), None
    return x.raw, (x.row_scale, x.col_scale)


def _scale_args(scales: tuple[torch.Tensor, torch.Tensor] | None) -> dict:
    return {} if scales is None else {"row_scale_ptr": scales[0], "col_scale_ptr": scales[1], "SCALED": True}


def _norm_warps(rows: int, quantizes: bool) -> dict:
    """The RMSNorm kernel's warps for a call of `rows` rows: NORM_WARPS where set; else up to NORM_DECODE_ROWS rows
    NORM_FP8_DECODE_WARPS where it quantizes its output (the FP8 engine's), NORM_DECODE_WARPS where not (None:
    Triton's default); past them Triton's default (4)."""
    if NORM_WARPS is not None:
        return {"num_warps": NORM_WARPS}
    warps = NORM_FP8_DECODE_WARPS if quantizes else NORM_DECODE_WARPS
    return {"num_warps": warps} if warps is not None and rows <= NORM_DECODE_ROWS else {}


def rms_norm_fp8(x: "torch.Tensor | fp8.Unscaled", residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x) quantized per row to e4m3, its scales [T, 1], residual + x) as add_rms_norm and then
    fp8.quantize_tokens compute them, in one kernel on CUDA: the input of an FP8 product (fp8.py) without its own
    quantizing kernel and the round trip through memory of the normed rows. Without a residual, of x alone. x may
    be an FP8 product's Unscaled output (with a residual, which the scaled values are added to)."""
    if residual is None and isinstance(x, fp8.Unscaled):
        x = x.materialize()   # the sum returned is x itself
    x, scales = _scales_of(x)
    if not enabled(x):
        h, total = (rms_norm(x, weight, eps), x) if residual is None else add_rms_norm(x, residual, weight, eps)
        return (*fp8.quantize_tokens(h), total)
    out = torch.empty(x.shape, dtype=fp8.FP8, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    total = x if residual is None else torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, x if residual is None else residual, out, total, weight, x.shape[-1], eps,
                                    HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(x.shape[-1]),
                                    scale_ptr=scale, QUANT=True, **_scale_args(scales), **_norm_warps(x.shape[0], True),
                                    **pdl.args(x.device))
    return out, scale, total


def silu_mul_fp8(gate_up: "torch.Tensor | fp8.Unscaled", one_pass: bool | None = None,
                 warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_mul's rows quantized per row to e4m3 and their scales [T, 1], as silu_mul and then fp8.quantize_tokens
    compute them; one kernel on CUDA, a program a row. `one_pass` (rows of up to SILU_ONE_PASS_MAX values) reads
    the row once and holds it in registers while its amax is taken; otherwise the kernel reads it twice, its
    amax and then its values again from L2: the same bytes either way (None: SILU_ONE_PASS where the row fits;
    `warps`, the warps a program: bench/engine/kernel_bench.py --parts silu sweeps them). gate_up may be an FP8
    product's Unscaled output, whose scales the kernel applies as it loads it."""
    gate_up, scales = _scales_of(gate_up)
    t, n = gate_up.shape[0], gate_up.shape[-1] // 2
    if one_pass is None:
        one_pass = SILU_ONE_PASS and n <= SILU_ONE_PASS_MAX
    if one_pass and n > SILU_ONE_PASS_MAX:
        raise ValueError(f"one_pass holds rows of at most {SILU_ONE_PASS_MAX} values in registers, not {n}")
    if not enabled(gate_up):
        return fp8.quantize_tokens(silu_mul(gate_up))
    out = torch.empty((t, n), dtype=fp8.FP8, device=gate_up.device)
    scale = torch.empty((t, 1), dtype=torch.float32, device=gate_up.device)
    if warps is None:
        warps = SILU_ONE_PASS_WARPS if one_pass else 8
    block, chunks = one_pass_chunks(n, 32 * warps) if one_pass else (min(triton.next_power_of_2(n), 4096), 1)
    _silu_mul_fp8_kernel[(t,)](gate_up, out, scale, n, BLOCK=block, ONE_PASS=one_pass, CHUNKS=chunks,
                               num_warps=warps, **_scale_args(scales), **pdl.args(gate_up.device))
    return out, scale


def one_pass_chunks(n: int, threads: int, most: int = 8) -> tuple[int, int]:
    """(block, chunks): how silu_mul_fp8's one-pass kernel holds a row of `n` values, in `chunks` blocks of `block`
    (a power of two, at least a value a thread of the program's `threads`), at most `most` blocks, padded least
    (then the fewest blocks). Every padded value costs the program its arithmetic: the 8B shape's 12,288-wide rows
    in one block of 16,384 left a quarter of its lanes computing nothing, in three of 4,096 none."""
    block = 1 << max(threads - 1, 0).bit_length()
    best: tuple[int, int] | None = None
    while True:
        chunks = -(-n // block)
        if chunks <= most and (best is None or block * chunks <= best[0] * best[1]):
            best = (block, chunks)
        if chunks == 1:   # one block holds the row: it always fits, so best is set
            assert best is not None
            return best
        block *= 2


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of the merged projection's output [T, 2n] (gate in the first n columns): [T, n]."""
    n = gate_up.shape[-1] // 2
    if not enabled(gate_up):
        return F.silu(gate_up[..., :n]) * gate_up[..., n:]
    out = gate_up.new_empty(gate_up.shape[:-1] + (n,))
    block = 1024
    _silu_mul_kernel[(out.shape[0], triton.cdiv(n, block))](gate_up, out, n, BLOCK=block, **pdl.args(out.device))
    return out


def norm_rope_store_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, kv_cache: torch.Tensor,
                     slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                     scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """In place on q [T, Hq, D] and k [T, Hk, D]: an RMSNorm per head when weights are given (Qwen3), then
    rotate-half RoPE with cos/sin [T, 1, D]; then K and V [T, Hk, D] (v read only) into kv_cache [blocks, 2,
    block_size, Hk, D] at each token's block and offset (an FP8 cache takes them as fp8.to_cache rounds them: K
    after its RoPE in q's dtype). One kernel on CUDA, each K head stored to its slot as it
    is rotated: a layer launches one kernel where it launched two (norm/RoPE, then the KV write), one node fewer
    per layer in a decode graph, whose launch costs the host about a microsecond a node. `scales`: q, k and v are
    views of an fp8.Unscaled product's raw output (merged q/k/v columns), whose (row [T, 1], column [Hq D + 2 Hk D])
    scales the kernel applies as it loads them, rounded as the product would have rounded them; v too is left
    scaled in place."""
    if scales is not None and not enabled(q, per_head=True):   # the values the product would have written
        row_scale, col_scale = scales
        start = 0
        for x in (q, k, v):
            n = x.shape[1] * x.shape[2]
            x.copy_((x.float() * (row_scale[:, :, None] * col_scale[start:start + n].view(1, *x.shape[1:])))
                    .to(x.dtype))
            start += n
    if not enabled(q, per_head=True):
        for x, weight in ((q, q_weight), (k, k_weight)):
            h = _rms_norm_reference(x, weight, eps) if weight is not None else x
            x.copy_(_rope_reference(h, cos, sin))
        kv_cache[slot_blocks, 0, slot_offsets] = fp8.to_cache(k, kv_cache.dtype)
        kv_cache[slot_blocks, 1, slot_offsets] = fp8.to_cache(v, kv_cache.dtype)
        return
    t, hq, d = q.shape
    hk = k.shape[1]
    has_norm = q_weight is not None
    heads = rope_heads_per_program(t, hk)
    groups = triton.cdiv(hq, heads) + 2 * triton.cdiv(hk, heads)
    _norm_rope_store_kernel[(t, groups)](
        q, k, v, cos, sin, q_weight if has_norm else q, k_weight if has_norm else k, kv_cache, slot_blocks,
        slot_offsets, hq, hk, q.stride(0), k.stride(0), v.stride(0), cos.stride(0), kv_cache.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), eps, HAS_NORM=has_norm, D=d, HEADS=heads,
        **_scale_args(scales), **pdl.args(q.device))


def rope_heads_per_program(tokens: int, kv_heads: int) -> int:
    """Heads per program of norm_rope_store_'s kernel. A program per head moved 128 elements and left the kernel
    bound by its programs: on the H200 it took 15 ms of a 200 ms prefill step of 8192 tokens through the 8B shape
    (bench/engine/decode_profile.py --prefill), and 0.5 ms of a 15 ms decode step of 256 sequences. Per layer of that
    shape (kernel_bench.py --parts rope, in CUDA graphs), one head a program against 4 / 8: 1 token 1.8 us / 1.5 /
    1.8, 64 tokens 4.3 / 2.4 / 2.4, 256 tokens 11.9 / 4.8 / 4.0, 8192 tokens 354 / 108 / 84 (floor 51)."""
    return min(8 if tokens >= ROPE_WIDE_FROM else 4, triton.next_power_of_2(kv_heads))


# The RMSNorm kernels' warps a program (a row): NORM_WARPS for every call where set (None: the rule of _norm_warps).
# The FP8 engine's calls of up to 256 rows take 16, the rest Triton's default (4). On an H100 (kernel_bench.py --parts
# norm, session 55; us at 4 against 16 warps) the FP8 kernel took 2.49/2.42 at 1 row, 2.76/2.60 at 64, 3.64/3.54 at
# 256, on an Unscaled input 3.70/3.05 at 128 and 4.63/4.03 at 256; at 1,024 rows 8.41/9.15 (so 4 past 256 rows), at
# 8,192 81.0/81.2. The norms that do not quantize (the bf16 engine's; the FP8 engine's last, before the head) keep
# Triton's default until timed (NORM_DECODE_WARPS; ab.py --b runtime.engine.fused.NORM_DECODE_WARPS=16 -- --models 8B
# --parts b1,offline). With SILU_ONE_PASS_WARPS 32, both against neither end to end (ab.py --a
# runtime.engine.fused.SILU_ONE_PASS_WARPS=16 runtime.engine.fused.NORM_WARPS=4, two rounds,
# bench/results/engine_ab.json): offline 13,178.5 against 13,266.2 output tok/s, graphs 8.45 against 8.37 s.
NORM_WARPS: int | None = None
NORM_FP8_DECODE_WARPS = 16
NORM_DECODE_WARPS: int | None = None
NORM_DECODE_ROWS = 256
ROPE_WIDE_FROM = 128   # tokens from which programs take 8 heads (fewer: 4, spread wider; measured 1 to 8192 tokens)
# silu_mul_fp8's default where a row fits SILU_ONE_PASS_MAX. The 8B shape's 12,288-wide rows on an H100 (kernel_bench.py
# --parts silu, session 54), twice against once at 16 warps: 256 tokens 10.1 against 7.8 us, 8,192 tokens 243.8
# against 197.3 (floor 166.8); end to end (bench/engine/ab.py --b runtime.engine.fused.SILU_ONE_PASS=True -- --models
# 8B --parts fp8_kv, two rounds in one call) offline 12,385.9 against 12,789.1 output tok/s, the decode graphs' GPU
# time 8.86 against 8.77 s; with DEFERRED_MIN_ROWS 65, both against neither in one later call 12,642.2 against 12,897.4.
SILU_ONE_PASS = True
SILU_ONE_PASS_MAX = 16384   # silu_mul_fp8(one_pass=True): the longest row it holds in registers
# ... with this many warps a program (a row of 16,384 values: 16 a thread; the 8B shape's 12,288, in three blocks of
# 4,096 (one_pass_chunks), 12, where one block of 16,384 left a quarter of the lanes computing padding: a thread's
# instructions on an fp8.Unscaled input 824 -> 640, on bf16 584 -> 472, compiled for sm_90 by Triton 3.6). On an
# H100 (kernel_bench.py --parts silu, session 55, one block; us at 16 against 32 warps) 7.78/7.41 at 256 tokens,
# 12.96/11.88 on an Unscaled input, 29.65/27.06 at 1,024, 196.1/186.2 at 8,192; end to end (ab.py --b
# runtime.engine.fused.SILU_ONE_PASS_WARPS=32 -- --models 8B --parts fp8_kv, two rounds) offline 13,259.2 against
# 13,288.3 output tok/s, decode graphs 8.425 against 8.40 s.
SILU_ONE_PASS_WARPS = 32


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


if triton is not None:
    # PACKED_ROUND: _round's bf16 rounding in one conversion instruction for two values (cvt.rn.bf16x2.f32) and a
    # shift or a mask to widen each back, 1.5 instructions a value, where the same rounding in integer arithmetic takes
    # four (shift, bit extract, add, mask); both round to nearest even, the same bits for every finite value. At a
    # decode step's rows these kernels take longer than their bytes (the FP8 SiLU-mul of 256 rows of the 8B shape:
    # 11.9 us on the H200 against ~4 us for its bytes), and their instructions alone would take ~6 us of the
    # multiprocessors' issue slots. Compiled for sm_90 by Triton 3.6 (bench/engine/kernel_sass.py --fused, then
    # --packed-round), a thread's instructions without and with it:
    # the SiLU-mul at 32 warps (a 12,288-wide row) 640 -> 520 on an fp8.Unscaled input (42 -> 32 registers) and
    # 472 -> 416 on bf16; the FP8 RMSNorm of a 4,096-wide row at 16 warps 416 -> 344 (Unscaled) and 368 -> 304, at
    # 4 warps 1,080 -> 840; the RoPE/KV-store kernel (8 heads a program, Unscaled) 624 -> 496.
    # On since session 58: every rounding kernel's bits the same either way on the GPU (tests/gpu/test_fused_gpu.py
    # -k packed_rounding), and timed with paged_decode.QUANTIZED_OUT and LONGEST_FIRST, the three together against
    # none on an H100 (paged_decode.py's comment on QUANTIZED_OUT has the numbers): offline +1.5%, and where only this
    # of the three reaches (the other two change the decode graphs' streamed attention of 16 sequences and more),
    # batch 1 271.5 against 265.9 and 265.8 tok/s, the prefill steps' GPU time 2.04 and 2.05 against 2.07 and 2.06 s.
    # Triton's interpreter runs no PTX: there, the integer arithmetic either way.
    PACKED_ROUND = tl.constexpr(True)
    _INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """fp32 `x` rounded to `dtype` (to nearest even) and back; for bf16 in integer arithmetic or a conversion
        (PACKED_ROUND) that the compiler cannot fold away, as it folds a `.to(bf16).to(fp32)` round trip."""
        if dtype == tl.bfloat16:
            if PACKED_ROUND and not _INTERPRETED:
                bits = tl.inline_asm_elementwise(
                    "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; and.b32 $1, t, 0xffff0000; }",
                    "=r,=r,r,r", [x.to(tl.uint32, bitcast=True)], dtype=tl.uint32, is_pure=True, pack=2)
            else:
                bits = x.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def _unscale(x, row_scale_ptr, col_scale_ptr, row, cols, mask, dtype: tl.constexpr):
        """Values of an fp8.Unscaled product output as the product would have written them: times their row's and
        column's scales, rounded to the model's dtype."""
        scale = tl.load(row_scale_ptr + row) * tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
        return _round(x * scale, dtype)

    @triton.jit
    def _rms_norm_kernel(x_ptr, residual_ptr, out_ptr, total_ptr, weight_ptr, n, eps, HAS_RESIDUAL: tl.constexpr,
                         BLOCK: tl.constexpr, scale_ptr=None, QUANT: tl.constexpr = False, row_scale_ptr=None,
                         col_scale_ptr=None, SCALED: tl.constexpr = False, PDL: tl.constexpr = False):
        """One row; with QUANT, the normed row (rounded to the model's dtype) quantized to e4m3 into out_ptr with
        its scale (fp8.quantize_tokens' arithmetic); with SCALED, x is an fp8.Unscaled output's raw values."""
        _pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64) * n
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        dtype = total_ptr.dtype.element_ty
        h = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            h = _unscale(h, row_scale_ptr, col_scale_ptr, tl.program_id(0), cols, mask, dtype)
        if HAS_RESIDUAL:   # the residual stream is kept in the model's dtype
            h = _round(h + tl.load(residual_ptr + row + cols, mask=mask, other=0.0).to(tl.float32), dtype)
            tl.store(total_ptr + row + cols, h.to(dtype), mask=mask)
        h = h * tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if QUANT:
            y = _round(_round(h, dtype) * w, dtype)
            scale = tl.maximum(tl.max(tl.abs(y), axis=0) / 448.0, 1.0 / (448.0 * 512))
            tl.store(scale_ptr + tl.program_id(0), scale)
            y = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
            tl.store(out_ptr + row + cols, y.to(tl.float8e4nv), mask=mask)
        else:
            tl.store(out_ptr + row + cols, (_round(h, dtype) * w).to(dtype), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(gate_up_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
        silu = _round(g / (1.0 + tl.exp(-g)), out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * n + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_fp8_kernel(gate_up_ptr, out_ptr, scale_ptr, n, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                             row_scale_ptr=None, col_scale_ptr=None, SCALED: tl.constexpr = False,
                             CHUNKS: tl.constexpr = 1, PDL: tl.constexpr = False):
        """With SCALED, gate_up is an fp8.Unscaled output's raw values."""
        _pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        gate = gate_up_ptr + row * 2 * n
        dtype = gate_up_ptr.dtype.element_ty
        if ONE_PASS:   # the row held in CHUNKS blocks of BLOCK values (BLOCK * CHUNKS >= n, one_pass_chunks)
            ys = ()   # type: tuple
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for c in tl.static_range(CHUNKS):
                cols = c * BLOCK + tl.arange(0, BLOCK)
                g, u = _gate_up(gate, n, cols, row_scale_ptr, col_scale_ptr, row, SCALED, dtype)
                y = _round(_round(g / (1.0 + tl.exp(-g)), dtype) * u, dtype)
                ys = ys + (y,)
                amax = tl.maximum(amax, tl.abs(y))
            scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1.0 / (448.0 * 512))
            tl.store(scale_ptr + row, scale)
            for c in tl.static_range(CHUNKS):
                cols = c * BLOCK + tl.arange(0, BLOCK)
                y = tl.minimum(tl.maximum(ys[c] / scale, -448.0), 448.0)
                tl.store(out_ptr + row * n + cols, y.to(tl.float8e4nv), mask=cols < n)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for c0 in range(0, n, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                g, u = _gate_up(gate, n, cols, row_scale_ptr, col_scale_ptr, row, SCALED, dtype)
                amax = tl.maximum(amax, tl.abs(_round(_round(g / (1.0 + tl.exp(-g)), dtype) * u, dtype)))
            scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1.0 / (448.0 * 512))
            tl.store(scale_ptr + row, scale)
            for c0 in range(0, n, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                g, u = _gate_up(gate, n, cols, row_scale_ptr, col_scale_ptr, row, SCALED, dtype)
                y = _round(_round(g / (1.0 + tl.exp(-g)), dtype) * u, dtype) / scale
                y = tl.minimum(tl.maximum(y, -448.0), 448.0)
                tl.store(out_ptr + row * n + cols, y.to(tl.float8e4nv), mask=cols < n)

    @triton.jit
    def _gate_up(gate, n, cols, row_scale_ptr, col_scale_ptr, row, SCALED: tl.constexpr, dtype: tl.constexpr):
        """A row's gate and up values at `cols` (fp32), scaled where they are an fp8.Unscaled output's."""
        mask = cols < n
        g = tl.load(gate + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate + n + cols, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            g = _unscale(g, row_scale_ptr, col_scale_ptr, row, cols, mask, dtype)
            u = _unscale(u, row_scale_ptr, col_scale_ptr + n, row, cols, mask, dtype)
        return g, u

    @triton.jit
    def _to_cache(x, cache_ptr):
        """K or V values as the cache stores them: as they are, or for an FP8 cache clamped to e4m3's range and
        rounded (fp8.to_cache)."""
        if cache_ptr.dtype.element_ty == tl.float8e4nv:
            x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
        return x.to(cache_ptr.dtype.element_ty)

    @triton.jit
    def _norm_rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, cache_ptr, blocks_ptr,
                                offsets_ptr, num_q_heads, num_kv_heads, q_stride, k_stride, v_stride, cs_stride,
                                s_block, s_kv, s_slot, s_head, eps, HAS_NORM: tl.constexpr, D: tl.constexpr,
                                HEADS: tl.constexpr, row_scale_ptr=None, col_scale_ptr=None,
                                SCALED: tl.constexpr = False, PDL: tl.constexpr = False):
        """Programs (token, group of HEADS heads) over the q heads, then the k heads, then the v heads; heads are
        D apart. With SCALED, q, k and v hold an fp8.Unscaled output's raw values, their columns q's, k's, v's."""
        _pdl_start(PDL)
        token = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        q_groups = tl.cdiv(num_q_heads, HEADS)
        kv_groups = tl.cdiv(num_kv_heads, HEADS)
        dtype = q_ptr.dtype.element_ty
        half = tl.arange(0, D // 2)[None, :]
        rows = tl.arange(0, HEADS)[:, None]
        slot = cache_ptr + tl.load(blocks_ptr + token) * s_block + tl.load(offsets_ptr + token) * s_slot
        if group >= q_groups + kv_groups:   # V heads: copied to their slot as they are
            heads = (group - q_groups - kv_groups) * HEADS + rows
            mask = heads < num_kv_heads
            src = v_ptr + token * v_stride + heads * D
            dst = slot + s_kv + heads * s_head
            v1 = tl.load(src + half, mask=mask)
            v2 = tl.load(src + D // 2 + half, mask=mask)
            if SCALED:
                cols = (num_q_heads + num_kv_heads + heads) * D + half
                v1 = _unscale(v1.to(tl.float32), row_scale_ptr, col_scale_ptr, token, cols, mask, dtype).to(dtype)
                v2 = _unscale(v2.to(tl.float32), row_scale_ptr, col_scale_ptr, token, cols + D // 2, mask,
                              dtype).to(dtype)
                tl.store(src + half, v1, mask=mask)   # v too is left scaled, for a reader of the step's own V
                tl.store(src + D // 2 + half, v2, mask=mask)
            tl.store(dst + half, _to_cache(v1, cache_ptr), mask=mask)
            tl.store(dst + D // 2 + half, _to_cache(v2, cache_ptr), mask=mask)
        else:
            if group < q_groups:
                heads = group * HEADS + rows
                mask = heads < num_q_heads
                base = q_ptr + token * q_stride + heads * D
                w_ptr = qw_ptr
                cols = heads * D + half
            else:
                heads = (group - q_groups) * HEADS + rows
                mask = heads < num_kv_heads
                base = k_ptr + token * k_stride + heads * D
                w_ptr = kw_ptr
                cols = (num_q_heads + heads) * D + half
            x1 = tl.load(base + half, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(base + D // 2 + half, mask=mask, other=0.0).to(tl.float32)
            if SCALED:
                x1 = _unscale(x1, row_scale_ptr, col_scale_ptr, token, cols, mask, dtype)
                x2 = _unscale(x2, row_scale_ptr, col_scale_ptr, token, cols + D // 2, mask, dtype)
            if HAS_NORM:
                r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
                w1 = tl.load(w_ptr + half).to(tl.float32)
                w2 = tl.load(w_ptr + D // 2 + half).to(tl.float32)
                x1 = _round(_round(x1 * r, dtype) * w1, dtype)
                x2 = _round(_round(x2 * r, dtype) * w2, dtype)
            c = tl.load(cos_ptr + token * cs_stride + half).to(tl.float32)
            s = tl.load(sin_ptr + token * cs_stride + half).to(tl.float32)
            out1 = (_round(x1 * c, dtype) + _round(-x2 * s, dtype)).to(dtype)
            out2 = (_round(x2 * c, dtype) + _round(x1 * s, dtype)).to(dtype)
            tl.store(base + half, out1, mask=mask)
            tl.store(base + D // 2 + half, out2, mask=mask)
            if group >= q_groups:   # K heads: also to their slot
                dst = slot + heads * s_head
                tl.store(dst + half, _to_cache(out1, cache_ptr), mask=mask)
                tl.store(dst + D // 2 + half, _to_cache(out2, cache_ptr), mask=mask)
