"""FP8 products through cuBLASLt itself, each shape with the algorithm that timed fastest of the ones its heuristic
offers, where torch._scaled_mm runs the heuristic's first alone.

From 65 to 256 input rows the FP8 engine runs a product with one scale a tensor and leaves the row and column
scales to the next kernel (fp8.deferred_linear), through torch._scaled_mm, which asks cuBLASLt's heuristic for one
algorithm. Those products took 1.3-1.9x their weight's read on an H100 at 256 rows (bench/engine/kernel_bench.py
--parts decode --decode-ways fp8_tensor: o_proj 10.9 us against 5.6, gate_up_proj 47.1 against 33.5), and
bench/engine/lt_algos.py times every algorithm the heuristic offers for them. With fp8.LT_CHOICE on, the first eager
call of each shape (the decode graphs' warm-up runs every graph size's products eagerly before capturing them) times
the heuristic's first CANDIDATES algorithms, REPS times each, interleaved, with the L2 cache overwritten before each
run so the weight is read from memory as in a step, and keeps the fastest (`fastest`); later calls, and the graphs
captured from them, run it. A call of a shape with no choice yet inside a capture, or of a row count that is not a
multiple of 16 (the decode graphs' sizes from 16 up are), returns None and the caller runs _scaled_mm. With
fp8.LT_SCALED the product also applies the token and weight-row scales (cuBLASLt's outer-vector scaling), so its
output is plain and the kernels after it read no column scales; torch._scaled_mm runs row scales through a CUTLASS
kernel of its own, which took 9-27% longer than the one-scale path at 160-256 rows (fp8.Unscaled).

cuBLASLt is called through ctypes on the library torch itself loads, so nothing is compiled. The product is D [N, M]
= W [N, K] x X^T in cuBLASLt's column-major terms, which is the row-major [M, N] output: FP8 e4m3 operands (A
transposed, B not, as its FP8 kernels take them), fp32 sums with fast accumulation (as _scaled_mm with
use_fast_accum), scales of 1, bf16 output.
"""
import ctypes
import dataclasses
import functools
import logging
import statistics
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# cuBLASLt's and CUDA's enum values (cublasLt.h, cublas_api.h, library_types.h; the same in CUDA 12 and 13)
CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 14, 28
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM = 3, 4, 17, 18, 25
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE, SCALE_OUTER_VEC_32F = 31, 32, 3   # a scale for each row of A, each column of B
PREF_MAX_WORKSPACE_BYTES = 1
ALGO_CONFIG = {"algo": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
               "inner": 7, "cluster": 8}
WORKSPACE = 32 << 20   # what torch gives cuBLAS(Lt) on Hopper

CANDIDATES = 8   # the heuristic's first algorithms a shape's choice times
REPS = 5         # runs of each, interleaved
MARGIN = 0.03    # the fastest replaces the heuristic's first only if its median is this much less


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def fastest(samples: list[list[float]], margin: float = MARGIN) -> int:
    """Which candidate to run, given each one's timed runs (candidate 0 is the heuristic's first, what _scaled_mm
    runs): the least median, where it is under candidate 0's by more than `margin` (a fraction of it); else 0. A
    candidate with no finite run (it failed) is never chosen."""
    medians = [statistics.median(runs) if runs and all(t < float("inf") for t in runs) else float("inf")
               for runs in samples]
    best = min(range(len(medians)), key=medians.__getitem__)
    if medians[0] < float("inf") and medians[best] >= medians[0] * (1 - margin):
        return 0
    return best


@functools.cache
def library() -> ctypes.CDLL | None:
    """torch's own libcublasLt (the file under the nvidia wheels beside torch, which torch loads; else whichever the
    loader finds by name), with its functions' signatures; None where there is none (a CPU build)."""
    if not torch.cuda.is_available():
        return None
    names = sorted(str(p) for p in Path(torch.__file__).resolve().parents[1].glob("nvidia/*/lib/libcublasLt.so*"))
    names += ["libcublasLt.so.13", "libcublasLt.so.12"]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v, p, s, i = ctypes.c_void_p, ctypes.POINTER, ctypes.c_size_t, ctypes.c_int
        lib.cublasLtCreate.argtypes = [p(v)]
        lib.cublasLtMatmulDescCreate.argtypes = [p(v), i, i]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [v, i, v, s]
        lib.cublasLtMatrixLayoutCreate.argtypes = [p(v), i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [p(v)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [v, i, v, s]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [v, v, v, v, v, v, v, i, p(Heuristic), p(i)]
        lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [p(Algo), i, v, s, p(s)]
        lib.cublasLtMatmul.argtypes = [v, v, v, v, v, v, v, v, v, v, v, v, p(Algo), v, s, v]
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        return lib
    return None


def available(device: torch.device) -> bool:
    """Whether this device runs FP8 products through cuBLASLt here (CUDA, compute capability 8.9 or newer)."""
    return device.type == "cuda" and _available(device.index if device.index is not None else
                                                torch.cuda.current_device())


@functools.cache
def _available(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9) and library() is not None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} returned status {status}")


@dataclasses.dataclass
class _Device:
    """A device's cuBLASLt handle, workspace and scale of 1 (made eagerly, before any capture uses them)."""
    handle: ctypes.c_void_p
    workspace: torch.Tensor
    one: torch.Tensor


@functools.cache
def _device(index: int) -> _Device:
    lib = library()
    assert lib is not None
    handle = ctypes.c_void_p()
    _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    device = torch.device("cuda", index)
    return _Device(handle, torch.empty(WORKSPACE, dtype=torch.uint8, device=device),
                   torch.ones((), dtype=torch.float32, device=device))


class Fp8Product:
    """x [M, K] e4m3 times w [N, K]^T e4m3 into a bf16 output, fast accumulation: out [M, N], or with `swapped`
    out^T [N, M] (cuBLASLt then takes x as its A, the weight's rows on its N side). Scales of 1, or with `scaled`
    each output times its token's scale and its weight row's (cuBLASLt's outer-vector scaling, sm_90 on), rounded
    once: quantized_linear's product, not an Unscaled one."""

    def __init__(self, m: int, n: int, k: int, device: torch.device, swapped: bool = False, scaled: bool = False):
        lib = library()
        if lib is None:
            raise RuntimeError("cuBLASLt is not available: FP8 products through it need torch's CUDA build")
        if scaled and swapped:
            raise ValueError("a scaled product is not swapped: its scales follow the weight's rows on cuBLASLt's M")
        self.lib, self.m, self.n, self.k, self.swapped, self.scaled = lib, m, n, k, swapped, scaled
        self.state = _device(device.index if device.index is not None else torch.cuda.current_device())
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "DescCreate")
        self._set(DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T))
        self._set(DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N))
        self._set(DESC_FAST_ACCUM, ctypes.c_int8(1))
        if scaled:
            self._set(DESC_A_SCALE_MODE, ctypes.c_int32(SCALE_OUTER_VEC_32F))
            self._set(DESC_B_SCALE_MODE, ctypes.c_int32(SCALE_OUTER_VEC_32F))
        else:
            self._set(DESC_A_SCALE_POINTER, ctypes.c_void_p(self.state.one.data_ptr()))
            self._set(DESC_B_SCALE_POINTER, ctypes.c_void_p(self.state.one.data_ptr()))
        rows, cols = (m, n) if swapped else (n, m)   # D's, column-major
        self.a = self._layout(CUDA_R_8F_E4M3, k, rows, k)
        self.b = self._layout(CUDA_R_8F_E4M3, k, cols, k)
        self.d = self._layout(CUDA_R_16BF, rows, cols, rows)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _set(self, attribute: int, value) -> None:
        _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value),
                                                       ctypes.sizeof(value)), f"DescSetAttribute({attribute})")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "LayoutCreate")
        return layout

    def candidates(self, count: int) -> list[Heuristic]:
        """The heuristic's algorithms for this shape, its best guess first (what a request for one returns)."""
        pref = ctypes.c_void_p()
        _check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        size = ctypes.c_uint64(WORKSPACE)
        _check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size),
                                                             ctypes.sizeof(size)), "PreferenceSetAttribute")
        results = (Heuristic * count)()
        returned = ctypes.c_int()
        if self.lib.cublasLtMatmulAlgoGetHeuristic(self.state.handle, self.desc, self.a, self.b, self.d, self.d, pref,
                                                   count, results, ctypes.byref(returned)) != 0:
            return []   # e.g. CUBLAS_STATUS_NOT_SUPPORTED: no algorithm for this product here
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def config(self, algo: Algo) -> dict[str, int]:
        """The algorithm's configuration (tile, split K, stages, cluster, ...), as cuBLASLt numbers them."""
        out = {}
        for name, attribute in ALGO_CONFIG.items():
            value, written = ctypes.c_uint64(0), ctypes.c_size_t()
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attribute, ctypes.byref(value), 8,
                                                             ctypes.byref(written)) == 0:
                out[name] = value.value & ((1 << (8 * written.value)) - 1) if written.value < 8 else value.value
        return out

    def run(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, algo: Algo,
            x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> None:
        """out = x w^T (out^T, swapped) on the current stream with `algo`; a scaled product takes each token's
        scale (fp32 [M] or [M, 1]) and each weight row's (fp32 [N])."""
        if self.scaled:
            if x_scale is None or w_scale is None:
                raise ValueError("a scaled product takes the input's and the weight's scales")
            self._set(DESC_A_SCALE_POINTER, ctypes.c_void_p(w_scale.data_ptr()))
            self._set(DESC_B_SCALE_POINTER, ctypes.c_void_p(x_scale.data_ptr()))
        a, b = (x, w) if self.swapped else (w, x)
        stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        _check(self.lib.cublasLtMatmul(self.state.handle, self.desc, ctypes.byref(self.alpha), a.data_ptr(), self.a,
                                       b.data_ptr(), self.b, ctypes.byref(self.beta), out.data_ptr(), self.d,
                                       out.data_ptr(), self.d, ctypes.byref(algo), self.state.workspace.data_ptr(),
                                       WORKSPACE, stream), "Matmul")


@dataclasses.dataclass
class Choice:
    """A shape's product and the algorithm it runs: the candidate `index` of the heuristic's list, its configuration
    and every candidate's median time (us; inf for one that failed) when it was chosen."""
    product: Fp8Product
    algo: Algo
    index: int
    config: dict[str, int]
    medians_us: list[float]


# (device, m, n, k, scaled) -> the shape's choice, or None where cuBLASLt offered no algorithm that ran (the caller
# runs _scaled_mm)
_CHOICES: dict[tuple[int, int, int, int, bool], Choice | None] = {}


def choices() -> dict[tuple[int, int, int, int, bool], Choice | None]:
    """Every shape's choice so far, by (device index, m, n, k, scaled)."""
    return dict(_CHOICES)


def matmul(q: torch.Tensor, weight: torch.Tensor, q_scale: torch.Tensor | None = None,
           w_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """q [M, K] e4m3 x weight [N, K]^T e4m3, fast accumulation, into bf16 [M, N]: with no scales, what
    torch._scaled_mm(q, weight.t(), scale_a=1, scale_b=1, out_dtype=torch.bfloat16, use_fast_accum=True) gives;
    with the token scales q_scale [M, 1] and the weight's row scales w_scale [N] (fp32), the product scaled by both
    as fp8.quantized_linear's is. Through the algorithm chosen for the shape (at this call if it is the shape's
    first outside a capture); None where this does not take the product (the caller runs _scaled_mm): a row count
    that is not a multiple of 16, operands or scales not contiguous, or a capture with no choice made."""
    m, k = q.shape
    n = weight.shape[0]
    scaled = q_scale is not None and w_scale is not None
    if m % 16 or not (q.is_contiguous() and weight.is_contiguous()) or not available(q.device):
        return None
    if (q_scale is not None and w_scale is not None
            and not (q_scale.is_contiguous() and w_scale.is_contiguous()
                     and q_scale.dtype == w_scale.dtype == torch.float32)):
        return None
    key = (q.device.index if q.device.index is not None else torch.cuda.current_device(), m, n, k, scaled)
    if key not in _CHOICES:
        if torch.cuda.is_current_stream_capturing():
            return None
        try:
            _CHOICES[key] = _choose(Fp8Product(m, n, k, q.device, scaled=scaled), q, weight, q_scale, w_scale)
        except RuntimeError as err:   # a cuBLASLt that refuses the descriptor (an older one: outer-vector scales)
            log.warning("cuBLASLt takes no %dx%dx%d FP8 product%s here (%s); torch._scaled_mm runs it", m, n, k,
                        " with row scales" if scaled else "", err)
            _CHOICES[key] = None
    choice = _CHOICES[key]
    if choice is None:
        return None
    out = torch.empty(m, n, dtype=torch.bfloat16, device=q.device)
    choice.product.run(q, weight, out, choice.algo, q_scale, w_scale)
    return out


def _choose(product: Fp8Product, q: torch.Tensor, weight: torch.Tensor, q_scale: torch.Tensor | None,
            w_scale: torch.Tensor | None) -> Choice | None:
    """Times the heuristic's first CANDIDATES algorithms on this call's operands, REPS runs each, interleaved, the
    L2 cache overwritten before each run, and keeps `fastest`'s choice; None where none ran."""
    found = product.candidates(CANDIDATES)
    if not found:
        return None
    device = q.device
    out = torch.empty(product.m, product.n, dtype=torch.bfloat16, device=device)
    flush = torch.empty(torch.cuda.get_device_properties(device).L2_cache_size * 2, dtype=torch.uint8, device=device)
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in found]
              for _ in range(REPS)]
    failed: set[int] = set()
    for rep in range(REPS):
        for i, candidate in enumerate(found):
            if i in failed:
                continue
            flush.zero_()   # keeps the device busy while the run is queued, and leaves the weight out of L2
            start, end = events[rep][i]
            start.record()
            try:
                product.run(q, weight, out, candidate.algo, q_scale, w_scale)
            except RuntimeError:
                failed.add(i)
            end.record()
    torch.cuda.synchronize(device)
    samples = [[float("inf")] if i in failed else [start.elapsed_time(end) * 1e3 for start, end in
                                                   (events[rep][i] for rep in range(REPS))]
               for i in range(len(found))]
    picked = fastest(samples)
    if picked in failed:
        return None
    algo = Algo.from_buffer_copy(found[picked].algo)
    return Choice(product, algo, picked, product.config(algo), [round(statistics.median(s), 2) for s in samples])
