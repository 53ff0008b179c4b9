"""Products of one row (batch-1 decode) in one Triton kernel each, where they beat cuBLAS.

At batch 1 a decode step reads every weight once and computes almost nothing: the products are bound by memory
bandwidth alone. cuBLAS runs some of them as split-K products plus a reduction kernel. Here each program reads
`block_n` whole rows of the weight, streaming it once past the L2 cache, and no reduction follows. Measured on the
H200 inside CUDA graphs (bench/engine/kernel_bench.py, Qwen3-8B shape, weight-read floor at the copy bandwidth):

    product        floor    cuBLAS   this
    qkv_proj       11.9 us  15.1     14.2
    o_proj          7.9     12.6     10.6
    gate_up_proj   47.6     50.9     49.2
    down_proj      23.8     30.0     25.6
    lm_head       294.0    299.8    279.7

At 2 and 4 rows it loses (each row reads the weight tile again), so only single rows take it. The 4B and 0.6B
shapes' products (reductions of 2560 and 1024) win too, most where cuBLAS is slowest (0.6B o_proj: 3.2 us against
12.6), so reductions of 1024 or more take it, and vocabulary-sized outputs. The products sum in fp32 and round once,
as cuBLAS does; the order of the sums differs, so results can differ in the last bit. The CPU and every test
without a GPU run F.linear.

At batch 1 a decoder layer's small kernels cost as much as its products (on the H200 the 8B shape's batch-1 step
took 4.5 ms of GPU against 3.9 for its weights). Where the kernel takes a layer's q/k/v or gate/up product,
`norm_linear` computes the residual add and RMSNorm before it inside the product (each program recomputes the
row's norm: it is a few KB, read from L2), rounding where add_rms_norm rounds: a launch fewer before each. SiLU * up
inside the down product was slower than the two kernels apart (8B: 34.4 us against 26.5), so it stays apart.

An FP8 weight (fp8.py) takes the same kernels: they read its bytes, sum in fp32 against the row in the model's
dtype, and scale each output by its weight row's scale, so a batch-1 step reads half the bytes. Larger batches run
fp8.quantized_linear on inputs the norm and SiLU-mul kernels quantize as they write them (fused.py).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8, fused, pdl

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs: F.linear runs instead
    triton = None


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension, which counts the programs along the output

# Outputs this wide are a vocabulary (a language model head; Qwen3's 151936 rows took the kernel), and the kernel
# warm-up's head, cut to 32768 rows, runs the same configuration as the real one.
VOCABULARY = 32768


@dataclass(frozen=True)
class Config:
    block_n: int = 16      # weight rows per program
    block_k: int = 1024    # columns per loop iteration
    num_warps: int = 8


# An FP8 weight's products of 2561-4096 outputs and 4096 columns or more at one row (the 8B shape's o and down): the
# best of kernel_bench.py --parts gemv --gemv-fp8 on an H100 (session 55, bench/results/h100/kernels.json), 8.06 us
# against 8.64 for bf16's configuration (o_proj, floor 5.53) and 19.38 against 20.42 (down_proj, floor 16.60), where
# an iteration's FP8 columns are half the bytes of bf16's; None gives them bf16's configuration.
FP8_THIN: "Config | None" = Config(8, 1024, 4)


def config_for(n: int, k: int, fp8_weight: bool = False) -> Config:
    """The best of bench/engine/kernel_bench.py's sweep for each kind of product of the Qwen3 8B, 4B and 0.6B
    shapes: outputs of 2560 rows or fewer take thin programs (more of them to spread over the SMs), reductions
    shorter than 4096 shorter iterations; an FP8 weight's (`fp8_weight`) 8B-sized o and down products FP8_THIN."""
    if fp8_weight and FP8_THIN is not None and 2560 < n <= 4096 and k >= 4096:
        return FP8_THIN
    if n >= VOCABULARY:    # many programs already, short iterations
        return Config(8, 256 if k >= 4096 else 512, 4)
    if n >= 16384:         # the merged gate/up product
        return Config(32, 256, 8) if k >= 4096 else Config(8, 256, 4)
    if n <= 2560:          # o and down products of the smaller shapes
        return Config(4, 1024, 8)
    if k >= 4096:
        return Config(16, 1024 if n <= 4096 else 512, 8)
    return Config(8, 512, 4)


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel takes x [1, K] against this weight [N, K]."""
    n, k = weight.shape
    return (triton is not None and x.is_cuda and bias is None and x.dim() == 2 and x.shape[0] == 1
            and x.shape[1] == k and x.stride(-1) == 1 and weight.is_contiguous()
            and (k >= 1024 or n >= VOCABULARY) and n <= MAX_GRID_Y * config_for(n, k).block_n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with the kernel below where it applies; with `scale`, of an FP8 weight and its row scales."""
    if applies(x, weight, bias):
        return gemv(x, weight, scale=scale)
    return F.linear(x, weight, bias) if scale is None else fp8.linear(x, weight, scale, bias)


def norm_linear(x: "torch.Tensor | fp8.Unscaled", residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                defer: bool = False) -> tuple["torch.Tensor | fp8.Unscaled", torch.Tensor]:
    """(F.linear(RMSNorm(residual + x), weight, bias), residual + x), or with no residual (the first layer) of x
    alone and x: fused.add_rms_norm and the product after it. A single row in one kernel where the kernel
    applies: each program sums the row's squares itself (the row is a few KB, read from L2), then streams its
    weight rows against the normed row, rounded where add_rms_norm rounds; the first program writes the sum. At
    batch 1 one kernel launch fewer before each of a layer's two input products. With `scale` (an FP8 weight's) and
    several rows, the norm's kernel quantizes the normed rows for the FP8 product (fused.rms_norm_fp8), which also
    takes an x that is an FP8 product's Unscaled output. `defer`: the caller's next kernel takes an Unscaled output
    (fp8.deferred_linear)."""
    product = fp8.deferred_linear if defer else fp8.quantized_linear
    if isinstance(x, fp8.Unscaled):
        if scale is not None and residual is not None:   # the norm's kernel scales x as it loads it
            q, q_scale, total = fused.rms_norm_fp8(x, residual, norm_weight, eps)
            return product(q, q_scale, weight, scale, bias, total.dtype), total
        x = x.materialize()
    if applies(x, weight, bias):
        return norm_gemv(x, residual, norm_weight, eps, weight, scale=scale)
    if scale is not None:   # an FP8 product's input, quantized by the norm's kernel
        q, q_scale, total = fused.rms_norm_fp8(x, residual, norm_weight, eps)
        return product(q, q_scale, weight, scale, bias, x.dtype), total
    if residual is None:
        return linear(fused.rms_norm(x, norm_weight, eps), weight, bias), x
    h, total = fused.add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, weight, bias), total


def silu_mul_linear(gate_up: "torch.Tensor | fp8.Unscaled", weight: torch.Tensor, bias: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None, defer: bool = False) -> "torch.Tensor | fp8.Unscaled":
    """linear(fused.silu_mul(gate_up), weight, bias, scale); an FP8 product's input of several rows quantized by
    the SiLU-mul's kernel, which also takes a gate_up that is an FP8 product's Unscaled output. `defer`: the
    caller's next kernel takes an Unscaled output (fp8.deferred_linear)."""
    if scale is None or gate_up.shape[0] == 1:
        if isinstance(gate_up, fp8.Unscaled):
            gate_up = gate_up.materialize()
        return linear(fused.silu_mul(gate_up), weight, bias, scale)
    product = fp8.deferred_linear if defer else fp8.quantized_linear
    return product(*fused.silu_mul_fp8(gate_up), weight, scale, bias, gate_up.dtype)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, config: Config | None = None,
              scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_linear`'s kernel for one row x [1, K] on CUDA (`scale`: an FP8 weight's row scales)."""
    n, k = weight.shape
    config = config or config_for(n, k, scale is not None)
    out = x.new_empty(1, n)
    total = x if residual is None else torch.empty_like(x)
    _norm_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, x if residual is None else residual, total, norm_weight, weight, weight if scale is None else scale,
        out, n, k, eps, HAS_RESIDUAL=residual is not None, SCALED=scale is not None, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN=n % config.block_n == 0 and k % config.block_k == 0, num_warps=config.num_warps, **pdl.args(x.device))
    return out, total


def gemv(x: torch.Tensor, weight: torch.Tensor, config: Config | None = None,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T on CUDA, one program per output row and `block_n` weight rows (`scale`: an FP8
    weight's row scales, each output times its row's)."""
    m = x.shape[0]
    n, k = weight.shape
    config = config or config_for(n, k, scale is not None)
    out = x.new_empty(m, n)
    _gemv_kernel[(m, triton.cdiv(n, config.block_n))](
        x, weight, weight if scale is None else scale, out, n, k, x.stride(0), SCALED=scale is not None,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN=n % config.block_n == 0 and k % config.block_k == 0, num_warps=config.num_warps, **pdl.args(x.device))
    return out


class Linear(nn.Linear):
    """nn.Linear whose single-row products take the kernel above (the same parameters and state dict, and with
    `to_fp8` an FP8 weight and its `weight_scale`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_parameter("weight_scale", None)

    def to_fp8(self) -> None:
        """Makes the weight an FP8 one with a scale per row, both uninitialised (on the model's meta device, before
        the loader allocates and quantizes them)."""
        n = self.weight.shape[0]
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=fp8.FP8, device=self.weight.device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(n, dtype=torch.float32, device=self.weight.device),
                                         requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale)

    def deferred(self, x: torch.Tensor) -> "torch.Tensor | fp8.Unscaled":
        """The product, for a caller whose next kernel takes an fp8.Unscaled output (fp8.deferred_linear)."""
        if self.weight_scale is None or applies(x, self.weight, self.bias):
            return self(x)
        return fp8.deferred_linear(*fp8.quantize_tokens(x), self.weight, self.weight_scale, self.bias, x.dtype)

    def deferred_quantized(self, q: torch.Tensor, q_scale: torch.Tensor, dtype: torch.dtype
                           ) -> "torch.Tensor | fp8.Unscaled":
        """`deferred` of an input already quantized per row (q [M, K] e4m3, q_scale [M, 1]: an attention kernel's,
        paged_decode.QUANTIZED_OUT), for an FP8 weight."""
        return fp8.deferred_linear(q, q_scale, self.weight, self.weight_scale, self.bias, dtype)


if triton is not None:
    from .fused import _round
    from .pdl import start as _pdl_start

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, n, k, x_stride, SCALED: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = w_ptr + cols_n.to(tl.int64)[:, None] * k
        x_row = x_ptr + row * x_stride
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)   # summed across K once, after the loop
        for k0 in range(0, k, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
                v = tl.load(x_row + cols)
            else:
                w = tl.load(w_rows + cols[None, :], mask=(cols_n[:, None] < n) & (cols[None, :] < k), other=0.0,
                            eviction_policy="evict_first")
                v = tl.load(x_row + cols, mask=cols < k, other=0.0)
            acc += w.to(tl.float32) * v.to(tl.float32)[None, :]
        total = tl.sum(acc, axis=1)
        if SCALED:
            total *= tl.load(scale_ptr + cols_n, mask=cols_n < n, other=0.0)
        total = total.to(out_ptr.dtype.element_ty)
        if EVEN:
            tl.store(out_ptr + row * n + cols_n, total)
        else:
            tl.store(out_ptr + row * n + cols_n, total, mask=cols_n < n)

    @triton.jit
    def _norm_gemv_kernel(x_ptr, residual_ptr, total_ptr, norm_ptr, w_ptr, scale_ptr, out_ptr, n, k, eps,
                          HAS_RESIDUAL: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr = False):
        """One row: out = weight @ RMSNorm(residual + x) (fused._rms_norm_kernel's rounding), total = residual + x
        written by the first program."""
        _pdl_start(PDL)
        dtype = out_ptr.dtype.element_ty
        block = tl.program_id(0)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):   # the row's sum of squares, every program its own
            cols = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(x_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h = _round(h + tl.load(residual_ptr + cols, mask=cols < k, other=0.0).to(tl.float32), dtype)
                if block == 0:
                    tl.store(total_ptr + cols, h.to(dtype), mask=cols < k)
            squares += h * h
        scale = tl.rsqrt(tl.sum(squares, axis=0) / k + eps)
        cols_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = w_ptr + cols_n.to(tl.int64)[:, None] * k
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
            else:
                w = tl.load(w_rows + cols[None, :], mask=(cols_n[:, None] < n) & (cols[None, :] < k), other=0.0,
                            eviction_policy="evict_first")
            h = tl.load(x_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h = _round(h + tl.load(residual_ptr + cols, mask=cols < k, other=0.0).to(tl.float32), dtype)
            g = tl.load(norm_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)
            v = _round(_round(h * scale, dtype) * g, dtype)
            acc += w.to(tl.float32) * v[None, :]
        total = tl.sum(acc, axis=1)
        if SCALED:
            total *= tl.load(scale_ptr + cols_n, mask=cols_n < n, other=0.0)
        total = total.to(dtype)
        if EVEN:
            tl.store(out_ptr + cols_n, total)
        else:
            tl.store(out_ptr + cols_n, total, mask=cols_n < n)
