"""FP8 weights (EngineConfig.quantization="fp8"): each decoder product's weight held as float8 e4m3 with a scale
per output row, quantized from the checkpoint as it loads; each product's input quantized per token as it runs,
by the RMSNorm and SiLU-mul kernels that write it (fused.rms_norm_fp8, fused.silu_mul_fp8) or, for o_proj's, by
`quantize_tokens`.

A decode step of a large batch is as much matrix product as weight reading (the 8B shape at 256 sequences: the
products ~6 ms against ~3.9 ms to read the weights), and a batch-1 step is nothing but weight reading. FP8 halves
the bytes read and doubles the rate of Hopper's tensor cores. Batches of two rows or more run `torch._scaled_mm`
(FP8 x FP8 summed in fp32, each output scaled by its row's and column's scales), up to SMALL_MAX_ROWS rows
`small_linear`'s kernel instead (the same sums, faster at decode sizes); past those rows and up to DEFERRED_MAX_ROWS
a product whose output a norm or SiLU-mul kernel reads next leaves both scales to that kernel (`deferred_linear`,
`Unscaled`) and takes _scaled_mm's faster path with one scale a tensor; a single row takes gemv.py's kernel, which
reads the FP8 weight and keeps the input in the model's dtype. The embedding and the head stay in the
model's dtype (vLLM's choice too: the head decides each token, and the tied head is the embedding).

Scales are amax / 448 (e4m3's largest finite value) per weight row and per input row, never below MIN_SCALE, so a
row of zeros quantizes to zeros. The CPU runs the same arithmetic on dequantized values (`quantized_linear`), which
is what tests without a GPU check; CUDA needs compute capability 8.9 or newer (Ada, Hopper) and bf16.

The FP8 KV cache (EngineConfig.kv_cache_dtype="fp8", independent of the weights') holds K and V as e4m3 with a scale
of 1 (`to_cache`: what vLLM and SGLang do for a checkpoint that ships no KV scales). A decode step of a large batch
reads more K/V than weights: the 8B shape at 256 sequences of 1,000 tokens reads 37.7 GB of bf16 K/V against 13.9 GB
of weights. Halving those bytes halves attention's time and doubles the tokens the same memory caches. Values past
448 are clamped; below 2^-6 e4m3 keeps fewer bits (subnormals), so K/V of very small magnitude lose precision.
"""
import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cublaslt, pdl
from .pdl import prefetch as _prefetch
from .pdl import start as _pdl_start

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs: the reference paths run instead
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512)   # vLLM's floor for a dynamic scale: a zero row must not divide by zero


def unsupported(device: torch.device, dtype: torch.dtype, setting: str = "quantization") -> str | None:
    """Why FP8 (weights, or the KV cache: `setting` names the option) cannot run on this device in this dtype, with
    the fix; None where it can."""
    undo = "drop quantization" if setting == "quantization" else f"set {setting}='auto'"
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"{setting}='fp8' runs on CUDA or the CPU, not {device.type}: {undo}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"{setting}='fp8' needs FP8 support (compute capability 8.9 or newer: Ada, Hopper); "
                f"{name} is {major}.{minor}: {undo}")
    if dtype != torch.bfloat16:
        return f"{setting}='fp8' on CUDA computes in bfloat16, not {dtype}: set dtype='bfloat16' or 'auto'"
    return None


def kv_cache_dtype(setting: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for EngineConfig.kv_cache_dtype in an engine computing in `dtype`."""
    return FP8 if setting == "fp8" else dtype


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V as an FP8 cache stores them (a scale of 1, clamped to e4m3's range, rounded to nearest); as they are
    for a cache of another dtype. What fused.norm_rope_store_'s kernel writes, for the CPU and tests."""
    if cache_dtype != FP8:
        return x.to(cache_dtype)
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, fp32 scale per row) of a weight [N, K]: weight ~= fp8.float() * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 x, fp32 scale [M, 1]) of x [M, K], a scale per row; one kernel on CUDA."""
    if triton is None or not x.is_cuda:
        w, scale = quantize_rows(x)
        return w, scale[:, None]
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    out = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    _quantize_tokens_kernel[(m,)](x, out, scale, k, x.stride(0), BLOCK=min(triton.next_power_of_2(k), 4096),
                                  num_warps=8, **pdl.args(x.device))
    return out, scale


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x [M, K] (the model's dtype) times an FP8 weight [N, K] with its row scales: [M, N] in x's dtype."""
    return quantized_linear(*quantize_tokens(x), weight, scale, bias, x.dtype)


@dataclass(frozen=True, eq=False)
class Unscaled:
    """An FP8 product's output before its scales: `raw` [M, N] (the model's dtype) is the sum of the FP8 operands'
    products as they are, and the output is raw * row_scale [M, 1] * col_scale [N] (fp32), rounded to raw's dtype.
    The kernel that reads the output applies them as it loads it (fused.rms_norm_fp8, add_rms_norm, silu_mul_fp8,
    and with DEFERRED_QKV norm_rope_store_), so the product can take torch._scaled_mm's path with one scale a tensor
    (cuBLASLt), which at 160-256 input rows of the 8B shape took 9-27% less time than its path with row scales
    (torch's own CUTLASS kernel) on an H100
    (kernel_bench.py --decode-ways fp8_rows,fp8_tensor, session 53: a layer's o, gate/up and down products 104.7
    against 76.7 us at 160 rows, 99.4 against 79.7 at 192, 94.2 against 85.7 at 256)."""
    raw: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.raw.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.raw.dtype

    def materialize(self) -> torch.Tensor:
        """The output itself, in raw's dtype (quantized_linear's output, to rounding)."""
        return (self.raw.float() * (self.row_scale * self.col_scale)).to(self.raw.dtype)


def quantized_linear(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """An input already quantized (q [M, K] and its scales [M, 1]: quantize_tokens, or fused.py's kernels that
    quantize as they norm) times an FP8 weight [N, K] with its row scales: [M, N] in `dtype`. On CUDA with fast
    accumulation (Hopper's FP8 MMA accumulates a few products in its own precision before adding them in fp32,
    as vLLM's and SGLang's FP8 products do): at 16 to 256 rows of the 8B shape's products 3-13% faster on an H100
    (bench/engine/kernel_bench.py --decode-ways fp8,fp8_fast)."""
    if not q.is_cuda:   # the same arithmetic on dequantized values in fp32, rounded once
        out = F.linear(q.float() * q_scale, weight.float() * scale[:, None])
        return (out if bias is None else out + bias.float()).to(dtype)
    n, k = weight.shape
    config = small_config(q.shape[0], n, k, multiprocessors(q.device))
    if config is not None and q.stride(-1) == weight.stride(-1) == 1:   # the kernel reads rows whole
        out = small_linear(q, q_scale, weight, scale, dtype, config)
    else:
        out = torch._scaled_mm(q, weight.t(), scale_a=q_scale, scale_b=scale.view(1, -1), out_dtype=dtype,
                               use_fast_accum=True)
    return out if bias is None else out + bias


def deferred_linear(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None, dtype: torch.dtype) -> "torch.Tensor | Unscaled":
    """quantized_linear for a caller whose next kernel applies the scales: on CUDA, without a bias, from
    DEFERRED_MIN_ROWS to DEFERRED_MAX_ROWS input rows an Unscaled output (in place of small_linear's kernel where
    their rows overlap), or with LT_SCALED the scaled output from cuBLASLt where it takes the shape; else
    quantized_linear's."""
    if DEFERRED and q.is_cuda and bias is None and DEFERRED_MIN_ROWS <= q.shape[0] <= DEFERRED_MAX_ROWS:
        if LT_SCALED and dtype == torch.bfloat16:
            scaled = cublaslt.matmul(q, weight, q_scale, scale)
            if scaled is not None:
                return scaled
        raw = cublaslt.matmul(q, weight) if LT_CHOICE and dtype == torch.bfloat16 else None
        if raw is None:
            one = _one(q.device)
            raw = torch._scaled_mm(q, weight.t(), scale_a=one, scale_b=one, out_dtype=dtype, use_fast_accum=True)
        return Unscaled(raw, q_scale, scale)
    return quantized_linear(q, q_scale, weight, scale, bias, dtype)


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    """A scale of 1 for _scaled_mm (one per device, made by the eager warm-up before any graph captures it)."""
    return torch.ones((), dtype=torch.float32, device=device)


@dataclass(frozen=True)
class SmallConfig:
    """small_linear's tile: `block_n` weight rows a program (the products' first operand, so a few input rows
    fill the MMA's narrow side), `block_k` columns a loop iteration, and `f16`: widen both FP8 operands to fp16
    (exact) for the product, which takes blocks of 16 or 32 weight rows (more programs over the multiprocessors),
    else FP8 products on Hopper's warpgroup MMA (64 rows or more). `split_k`: programs that share a block of weight
    rows, each summing its share of K, the last to finish adding the others' sums (from L2) and writing the outputs:
    a product with few weight rows (the 8B shape's o_proj and down_proj have 4,096: 64 programs of 64 rows, on an
    H200's 132 multiprocessors) then reads its weight with more programs at once. `block_m`: input rows a program
    (a power of 2, 16 or more), the programs of a block of weight rows launched side by side so that they read it
    from L2 once it is read; None takes every row in one program (padded to a power of 2). `prefetch`: bytes of
    each of a program's weight rows (from its share's start; a power of 2, 128 or more) asked into L2 before the
    program waits for the kernel before it, where kernels launch as dependents (pdl.py): the weight depends on no
    kernel, so its first reads overlap the end of the one before. 0, or PDL off: none."""
    block_n: int = 64
    block_k: int = 256
    warps: int = 4
    stages: int = 3
    f16: bool = False
    split_k: int = 1
    block_m: int | None = None
    prefetch: int = 0


# the most input rows small_linear takes, and its tile (None: torch._scaled_mm for every product). Measured on the
# H200 (bench/engine/kernel_bench.py --parts decode --decode-ways fp8_fast,fp8_small, session 48): with FP8 products
# on 64 weight rows a program, 256 columns an iteration, 4 warps, 3 stages, the 8B shape's four products of a layer
# take 70.8 us at 8 rows against _scaled_mm's 103.4, 80.6 against 102.5 at 64, 94.9 against 104.2 at 128 (its
# outputs equal to _scaled_mm's with fast accumulation); 16-weight-row fp16 tiles win o_proj and down_proj at 8-16
# rows by 0.3-2.6 us more, not worth a second tile.
SMALL_MAX_ROWS = 128
SMALL_CONFIG: SmallConfig | None = SmallConfig(block_n=64, block_k=256, warps=4, stages=3, f16=False)
# deferred_linear returns an Unscaled from DEFERRED_MIN_ROWS to DEFERRED_MAX_ROWS input rows, where it takes the place
# of small_linear's kernel (up to 128 rows) and of the row-scaled product (129 on). At 160-256 rows: the Unscaled
# docstring. DEFERRED on against off, 8B shape with FP8 weights and KV cache on the H200 (bench/engine/speed.py --parts
# fp8_kv, two pairs, session 53): offline 14,051.8 and 14,085.7 output tok/s against 13,611.1 and 13,609.3, the decode
# graphs' GPU time 7.75 and 7.74 s against 8.08 and 8.09; batch 1 unchanged (298.3 against 298.0). From 65 rows, on an
# H100 (kernel_bench.py --parts decode --decode-ways fp8_tensor,fp8_small, session 54), one scale a tensor against
# small_linear's best tile: o_proj 9.52 against 10.45 us at 64 rows, 8.93 against 11.64 at 128; gate_up 40.65 against
# 40.69 at 64, 42.92 against 45.64 at 128; down 21.85 against 24.56 at 64, 22.28 against 26.39 at 128 (at 32 rows
# gate_up and down lost or tied); end to end (bench/engine/ab.py --b runtime.engine.fp8.DEFERRED_MIN_ROWS=65, two
# rounds) offline 12,626.6 against 12,698.4 output tok/s, decode graphs 8.86 against 8.80 s. Not past 256 rows: at a
# prefill's thousands the row-scaled product wins (8,192 rows: gate_up 1,156.5 against 1,198.1 us, qkv 276.7
# against 331.7, down 563.8 against 613.5; at 512 and 2,048 rows within a few percent either way).
DEFERRED = True
DEFERRED_MIN_ROWS = 65
DEFERRED_MAX_ROWS = 256
# Those products through cuBLASLt with the algorithm each shape timed fastest at its first call (cublaslt.py), not
# the heuristic's first that _scaled_mm runs. Off until timed end to end (bench/engine/lt_algos.py shows what each
# algorithm takes; ab.py --b runtime.engine.fp8.LT_CHOICE=True -- --models 8B --parts fp8_kv times the engine).
LT_CHOICE = False
# The same products through cuBLASLt with their scales applied in the product (its outer-vector scaling, sm_90 on),
# each shape's algorithm chosen the same way: a plain output, so the norm, SiLU-mul and RoPE kernels after them read
# no column scales (the SiLU-mul of 256 rows took 11.88 us on an Unscaled input against 7.41 on a plain one, H100,
# session 55). Off until timed: lt_algos.py's "scaled" rows, then ab.py --b runtime.engine.fp8.LT_SCALED=True.
LT_SCALED = False
# The merged q/k/v product too, its scales applied by the RoPE kernel that reads it (fused.norm_rope_store_). One
# scale a tensor against the product it replaces (kernel_bench.py --parts decode, H100, sessions 52 and 54): 11.87
# against small_linear's 13.77 us at 128 rows, 12.3 against the row-scaled 14.3 at 160, 13.4 against 14.4 at 256. End
# to end on the H200 (bench/engine/ab.py --b runtime.engine.fp8.DEFERRED_QKV=True -- --models 8B --parts fp8_kv, two
# rounds, session 56): offline 14,534.75 against 14,589.1 output tok/s (each run on against each run off), the decode
# graphs' GPU time 7.465 against 7.425 s, batch 1 unchanged (307.4 against 307.6).
DEFERRED_QKV = True
# A product whose blocks of weight rows are fewer than SPLIT_SHARE of the GPU's multiprocessors splits K among
# split_k programs a block, by the most input rows: (16, 4), then (64, 2), none past. The 8B shape's o_proj and
# down_proj (4,096 weight rows: 64 blocks) on the H100 (kernel_bench.py --parts decode --decode-ways fp8_small,
# session 52): at 16 rows 9.2 and 21.4 us split in 4 against 10.4 and 26.5 whole, at 64 rows 10.5 and 24.7 split in 2
# against 10.9 and 29.6; qkv_proj (96 blocks) lost split at 64 rows (14.0 against 12.8), gate_up_proj (384) at both.
SMALL_SPLITS = ((16, 4), (64, 2))
SPLIT_SHARE = 0.6
# past SMALL_MAX_ROWS and up to BLOCKED_MAX_ROWS input rows, small_linear's tile over blocks of them (block_m), or
# None for torch._scaled_mm. None: on the H100 (session 52) the best blocked tiles took 121.8 and 126.0 us for a layer's
# four products at 192 and 256 rows, against _scaled_mm's 126.0 and 124.1 with its input's quantizing counted.
BLOCKED_MAX_ROWS = 256
BLOCKED_CONFIG: SmallConfig | None = None


def small_config(m: int, n: int, k: int, multiprocessors: int | None = None) -> SmallConfig | None:
    """small_linear's tile for an [m, k] input times an [n, k] weight, or None for torch._scaled_mm. Given the GPU's
    `multiprocessors`, a product of few blocks of weight rows splits K (SMALL_SPLITS) where K divides evenly."""
    if 2 <= m <= SMALL_MAX_ROWS:
        config = SMALL_CONFIG
    else:
        config = BLOCKED_CONFIG if SMALL_MAX_ROWS < m <= BLOCKED_MAX_ROWS else None
    if config is None or k % (config.block_k * config.split_k):
        return None
    if multiprocessors and config.split_k == 1 and -(-n // config.block_n) < SPLIT_SHARE * multiprocessors:
        splits = next((splits for rows, splits in SMALL_SPLITS if m <= rows), 1)
        if splits > 1 and k % (config.block_k * splits) == 0:
            return _split(config, splits)
    return config


@functools.cache
def _split(config: SmallConfig, splits: int) -> SmallConfig:
    return dataclasses.replace(config, split_k=splits)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def small_linear(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 dtype: torch.dtype, config: SmallConfig) -> torch.Tensor:
    """quantized_linear's product for a few input rows (q [M, K] e4m3, q_scale [M, 1]) on CUDA, in one Triton
    kernel: each program computes `block_n` outputs of every row as weight [block_n, K] x q^T, so the weight rows
    take the MMA's wide side and M (padded to 16 or more) its narrow one, reads its weight rows once, sums in fp32
    and scales by both scales as it writes. cuBLAS's FP8 products tile the input rows at 64 or more and cover the
    8B shape's 4,096-wide outputs with few programs: at 16 rows o_proj took 15.4 us where this takes 9.8 (H200,
    session 48; SMALL_CONFIG). Hopper's FP8 MMA sums as _scaled_mm's fast accumulation does."""
    m, k = q.shape
    n = weight.shape[0]
    splits = config.split_k
    if k % (config.block_k * splits):
        raise ValueError(f"small_linear: K={k} is not a multiple of block_k={config.block_k} x split_k={splits}")
    lines = config.prefetch // 128
    if config.prefetch and (lines < 1 or lines & (lines - 1) or config.prefetch % 128 or config.prefetch > k // splits):
        raise ValueError(f"small_linear: prefetch={config.prefetch} is not a power of 2 of 128 or more bytes within "
                         f"a program's share of K ({k // splits})")
    block_m = config.block_m or max(16, triton.next_power_of_2(m))
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"small_linear: block_m={block_m} is not a power of 2 of 16 or more")
    out = torch.empty(m, n, dtype=dtype, device=q.device)
    blocks, row_blocks = triton.cdiv(n, config.block_n), triton.cdiv(m, block_m)
    if splits > 1:   # each program's fp32 sums, and a count a tile of the programs that have written theirs
        partial = torch.empty((splits, blocks * config.block_n, row_blocks * block_m), dtype=torch.float32,
                              device=q.device)
        arrived = _arrival_counts(q.device, blocks * row_blocks)
    else:
        partial = arrived = out   # not read
    _small_kernel[(row_blocks, blocks, splits)](
        q, q_scale, weight, scale, out, partial, arrived, m, n, k // splits, q.stride(0), weight.stride(0),
        BLOCK_N=config.block_n, BLOCK_M=block_m, BLOCK_K=config.block_k, F16=config.f16, SPLIT=splits,
        PREFETCH=lines, num_warps=config.warps, num_stages=config.stages, **pdl.args(q.device))
    return out


_ARRIVED: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []   # counts a larger buffer replaced: graphs captured with them still use them


def _arrival_counts(device: torch.device, blocks: int) -> torch.Tensor:
    """Zeroed int32 counts for a split small_linear's blocks, one buffer a device: the last program of a block sets
    its count back to 0, so the next product finds them zeroed. Made outside any CUDA graph capture (a capture
    records the zeroing but does not run it; the engine's and the benchmarks' eager warm-up runs come first), and
    shared by the device's products, which run one at a time on its stream: two split products on two streams at
    once would mix their counts. A buffer a larger one replaces is kept: a graph holds its address."""
    counts = _ARRIVED.get(device)
    if counts is None or counts.numel() < blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("small_linear with split_k > 1 needs an eager call before a CUDA graph captures it")
        if counts is not None:
            _OUTGROWN.append(counts)
        counts = _ARRIVED[device] = torch.zeros(max(blocks, 1024), dtype=torch.int32, device=device)
    return counts


if triton is not None:
    @triton.jit
    def _quantize_tokens_kernel(x_ptr, out_ptr, scale_ptr, k, x_stride, BLOCK: tl.constexpr,
                                PDL: tl.constexpr = False):
        """One row: its amax, then the row over its scale rounded to e4m3 (the second pass reads from L2)."""
        _pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, k, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1.0 / (448.0 * 512))
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, k, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32) / scale
            v = tl.minimum(tl.maximum(v, -448.0), 448.0)
            tl.store(out_ptr + row * k + cols, v.to(tl.float8e4nv), mask=cols < k)

    @triton.jit
    def _small_kernel(q_ptr, q_scale_ptr, w_ptr, w_scale_ptr, out_ptr, partial_ptr, arrived_ptr, m, n, per_share,
                      q_stride, w_stride, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      F16: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr = 0, PDL: tl.constexpr = False):
        """small_linear: out[rows, block] = (w[block] @ q[rows]^T)^T x q_scale x w_scale[block], the weight's rows
        the left operand. Axis 0 takes the blocks of BLOCK_M input rows (launched side by side, so a block of weight
        rows is read from HBM about once), axis 1 the blocks of weight rows, axis 2 the SPLIT shares of K,
        `per_share` columns each, a multiple of BLOCK_K (no mask along it). With PDL, PREFETCH 128-byte lines of
        each weight row are asked into L2 before the wait."""
        row_block = tl.program_id(0)
        block = tl.program_id(1)
        share = tl.program_id(2)
        rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
        if PDL and PREFETCH > 0:   # rows past n read as the last one: every address is the weight's
            _prefetch(w_ptr + tl.minimum(rn, n - 1).to(tl.int64)[:, None] * w_stride + share * per_share
                      + tl.arange(0, PREFETCH)[None, :] * 128)
        _pdl_start(PDL)
        rm = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < n
        m_ok = rm < m
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * w_stride + (share * per_share + rk)[None, :]
        q_rows = q_ptr + rm.to(tl.int64)[:, None] * q_stride + (share * per_share + rk)[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, per_share, BLOCK_K):
            w = tl.load(w_rows + k0, mask=n_ok[:, None], other=0.0)
            x = tl.load(q_rows + k0, mask=m_ok[:, None], other=0.0)
            if F16:   # e4m3 widens to fp16 exactly, one instruction per two values
                acc = tl.dot(w.to(tl.float16), tl.trans(x.to(tl.float16)), acc)
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        last = True
        if SPLIT > 1:
            # Every share's sums to L2; the barrier orders this program's stores before the count's release, and the
            # last program of the block to count adds up all the shares' (through L2), in their order whichever
            # came last, so a product's outputs are the same on every run, and writes them.
            width = tl.num_programs(0) * BLOCK_M
            sums = partial_ptr + (rn[:, None] * width + rm[None, :])
            share_stride = tl.num_programs(1) * BLOCK_N * width
            tile = block * tl.num_programs(0) + row_block
            tl.store(sums + share * share_stride, acc)
            tl.debug_barrier()
            last = tl.atomic_add(arrived_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
            if last:
                acc = tl.load(sums, cache_modifier=".cg")
                for other in tl.static_range(1, SPLIT):
                    acc += tl.load(sums + other * share_stride, cache_modifier=".cg")
                tl.atomic_xchg(arrived_ptr + tile, 0, sem="relaxed", scope="gpu")   # for the next product
        if last:
            w_scale = tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)
            q_scale = tl.load(q_scale_ptr + rm, mask=m_ok, other=0.0)
            acc = acc * w_scale[:, None] * q_scale[None, :]
            tl.store(out_ptr + rm.to(tl.int64)[None, :] * n + rn[:, None], acc.to(out_ptr.dtype.element_ty),
                     mask=n_ok[:, None] & m_ok[None, :])
