"""cuBLASLt's own FP8 algorithms for a decode step's products, each timed, against the one torch._scaled_mm runs.

    python bench/engine/lt_algos.py                        # the 8B shape's products at 64-256 rows; prints a table
    python bench/engine/lt_algos.py --rows 128 256 --record   # also writes bench/results/lt_algos.json

From 65 to 256 rows the FP8 engine runs each product as torch._scaled_mm with one scale a tensor (fp8.deferred_linear),
which asks cuBLASLt's heuristic for one algorithm and runs it. Those products take ~1.3-1.9x their weight's read on an
H100 at 256 rows (kernel_bench.py --parts decode --decode-ways fp8_tensor): o_proj 10.9 us against 5.6, gate_up_proj
47.1 against 33.5. This asks the heuristic for up to --algos algorithms of the same product (cuBLASLt called through
ctypes, on the library torch loaded), times each in a CUDA graph over enough copies of the weight that none is read
from L2, as kernel_bench.py times the products, and prints, per product and row count: _scaled_mm's time, the
heuristic's first algorithm's (what _scaled_mm runs, as a check), the fastest algorithm's and its configuration (tile,
split K, stages, cluster), and the same for the product computed swapped (weight x input^T, the output transposed),
where the weight's rows take cuBLASLt's M side; each fastest output's largest difference from _scaled_mm's. Whether a
choice of algorithm, which the engine could make once per shape at its warm-up, pays.
"""
import argparse
import ctypes
import functools
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kernel_bench import copy_bandwidth, in_graph, log, products  # noqa: E402

RESULTS = HERE.parent / "results" / "lt_algos.json"

# cuBLASLt's and CUDA's enum values (cublasLt.h, cublas_api.h, library_types.h; stable across CUDA 12 and 13)
CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 14, 28
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER, DESC_FAST_ACCUM = 3, 4, 17, 18, 25
PREF_MAX_WORKSPACE_BYTES = 1
CONFIG = {"algo": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6, "inner": 7,
          "cluster": 8}
WORKSPACE = 32 << 20   # what torch gives cuBLAS(Lt) on Hopper


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


@functools.cache
def library() -> ctypes.CDLL:
    """torch's own libcublasLt (loaded by name: the dynamic loader hands back the one loaded already, by its soname),
    else the first under the nvidia wheels beside torch."""
    one = torch.ones((), device="cuda")
    x = torch.zeros(16, 16, device="cuda").to(torch.float8_e4m3fn)
    torch._scaled_mm(x, x.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)   # loads cuBLASLt if lazy
    names = ["libcublasLt.so.13", "libcublasLt.so.12"]
    names += sorted(str(p) for p in Path(torch.__file__).resolve().parents[1].glob("nvidia/*/lib/libcublasLt.so*"))
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v, p, u, i, s = ctypes.c_void_p, ctypes.POINTER, ctypes.c_uint64, ctypes.c_int, ctypes.c_size_t
        lib.cublasLtCreate.argtypes = [p(v)]
        lib.cublasLtMatmulDescCreate.argtypes = [p(v), i, i]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [v, i, v, s]
        lib.cublasLtMatrixLayoutCreate.argtypes = [p(v), i, u, u, ctypes.c_int64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [p(v)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [v, i, v, s]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [v, v, v, v, v, v, v, i, p(Heuristic), p(i)]
        lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [p(Algo), i, v, s, p(s)]
        lib.cublasLtMatmul.argtypes = [v, v, v, v, v, v, v, v, v, v, v, v, p(Algo), v, s, v]
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        log(f"cuBLASLt {lib.cublasLtGetVersion()} from {name}")
        return lib
    sys.exit("lt_algos.py: no libcublasLt found (torch's CUDA build ships one under nvidia/*/lib)")


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cublasStatus {status}")


class Product:
    """out [M, N] bf16 = x [M, K] e4m3 x w [N, K]^T e4m3 with scales of 1 and fast accumulation, as cuBLASLt runs
    it column-major: D [N, M] = op(A = w) x B (x), or `swapped`, D [M, N] = op(A = x) x B (w) (out^T)."""

    def __init__(self, m: int, n: int, k: int, swapped: bool):
        lib = library()
        self.lib, self.m, self.n, self.k, self.swapped = lib, m, n, k, swapped
        self.handle = ctypes.c_void_p()
        check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.desc = ctypes.c_void_p()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "DescCreate")
        self.one = torch.ones((), dtype=torch.float32, device="cuda")
        self._set(DESC_TRANSA, ctypes.c_int32(CUBLAS_OP_T))
        self._set(DESC_TRANSB, ctypes.c_int32(CUBLAS_OP_N))
        self._set(DESC_FAST_ACCUM, ctypes.c_int8(1))
        self._set(DESC_A_SCALE_POINTER, ctypes.c_void_p(self.one.data_ptr()))
        self._set(DESC_B_SCALE_POINTER, ctypes.c_void_p(self.one.data_ptr()))
        rows, cols = (m, n) if swapped else (n, m)   # D's, column-major
        self.a, self.b, self.c = (self._layout(CUDA_R_8F_E4M3, k, rows, k), self._layout(CUDA_R_8F_E4M3, k, cols, k),
                                  self._layout(CUDA_R_16BF, rows, cols, rows))
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _set(self, attribute: int, value) -> None:
        check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value),
                                                      ctypes.sizeof(value)), f"DescSetAttribute({attribute})")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "LayoutCreate")
        return layout

    def algorithms(self, count: int) -> list[Heuristic]:
        """The heuristic's algorithms, best first (the first is what a request for one returns)."""
        pref = ctypes.c_void_p()
        check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        size = ctypes.c_uint64(WORKSPACE)
        check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size),
                                                            ctypes.sizeof(size)), "PreferenceSetAttribute")
        results = (Heuristic * count)()
        returned = ctypes.c_int()
        check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.c, self.c, pref,
                                                      count, results, ctypes.byref(returned)), "AlgoGetHeuristic")
        return [results[i] for i in range(returned.value) if results[i].state == 0]

    def config(self, algo: Algo) -> dict[str, int]:
        out = {}
        for name, attribute in CONFIG.items():
            value, written = ctypes.c_uint64(0), ctypes.c_size_t()
            status = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attribute, ctypes.byref(value),
                                                                   8, ctypes.byref(written))
            if status == 0:
                out[name] = int(value.value & ((1 << (8 * written.value)) - 1)) if written.value < 8 else value.value
        return out

    def run(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, algo: Algo) -> None:
        """out ([M, N], or [N, M] swapped) = x w^T on the current stream with `algo`."""
        a, b = (x, w) if self.swapped else (w, x)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), a.data_ptr(), self.a,
                                      b.data_ptr(), self.b, ctypes.byref(self.beta), out.data_ptr(), self.c,
                                      out.data_ptr(), self.c, ctypes.byref(algo), self.workspace.data_ptr(),
                                      WORKSPACE, stream), "cublasLtMatmul")


def bench(shape: str, rows_list: list[int], count: int, bandwidth: float) -> list[dict]:
    from ember.runtime.engine import fp8
    out_rows = []
    for name, n, k in products(shape):
        if name == "lm_head":
            continue   # the engine keeps the head in bf16 under FP8 weights
        copies = max(2, math.ceil((512 << 20) / (n * k)))
        weights = [fp8.quantize_rows(torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02)[0]
                   for _ in range(copies)]
        for m in rows_list:
            xq, _ = fp8.quantize_tokens(torch.randn(m, k, dtype=torch.bfloat16, device="cuda"))
            one = torch.ones((), dtype=torch.float32, device="cuda")
            scaled = [functools.partial(torch._scaled_mm, xq, w.t(), scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16, use_fast_accum=True) for w in weights]
            reference = scaled[0]().float()
            row = {"shape": shape, "product": name, "m": m, "n": n, "k": k,
                   "read_floor_us": round(n * k / bandwidth * 1e6, 2),
                   "scaled_mm_us": round(in_graph(scaled) * 1e6, 2)}
            for swapped in (False, True):
                key = "swapped" if swapped else "lt"
                product = Product(m, n, k, swapped)
                outs = [torch.empty((n, m) if swapped else (m, n), dtype=torch.bfloat16, device="cuda")
                        for _ in weights]
                timings = []
                for index, result in enumerate(product.algorithms(count)):
                    algo = result.algo
                    calls = [functools.partial(product.run, xq, w, out, algo) for w, out in zip(weights, outs)]
                    try:
                        seconds = in_graph(calls)
                    except RuntimeError as err:   # an algorithm a graph cannot hold, or one that fails to run
                        log(f"  {name} m={m} {key} #{index}: {str(err)[:160]}")
                        torch.cuda.synchronize()
                        continue
                    product.run(xq, weights[0], outs[0], algo)
                    got = outs[0].float().t() if swapped else outs[0].float()
                    timings.append({"index": index, "us": round(seconds * 1e6, 2), "waves": round(result.waves, 2),
                                    "workspace": result.workspace, **product.config(algo),
                                    "max_abs_diff": round(float((got - reference).abs().max()), 4)})
                if not timings:
                    continue
                first = next((t for t in timings if t["index"] == 0), None)
                best = min(timings, key=lambda t: t["us"])
                row[f"{key}_first_us"] = first["us"] if first else None
                row[f"{key}_best_us"] = best["us"]
                row[f"{key}_best"] = best
                row[f"{key}_all"] = timings
            out_rows.append(row)
            log(f"{name:13s} m={m:3d}: read {row['read_floor_us']:6.2f} us, _scaled_mm {row['scaled_mm_us']:6.2f}, "
                f"heuristic's first {row.get('lt_first_us')}, best {row.get('lt_best_us')} "
                f"({_brief(row.get('lt_best'))}), swapped first {row.get('swapped_first_us')}, best "
                f"{row.get('swapped_best_us')} ({_brief(row.get('swapped_best'))})")
        del weights
        torch.cuda.empty_cache()
    return out_rows


def _brief(best: dict | None) -> str:
    if not best:
        return "-"
    return (f"#{best['index']} tile {best.get('tile')} split {best.get('split_k')} stages {best.get('stages')} "
            f"cluster {best.get('cluster')}, diff {best['max_abs_diff']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8B", choices=["8B", "4B", "0.6B"])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 128, 192, 256])
    parser.add_argument("--algos", type=int, default=32, help="the most algorithms to ask the heuristic for")
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS}")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lt_algos.py needs a CUDA GPU with FP8 (compute capability 8.9 or newer)")
    if any(m % 16 for m in args.rows):
        sys.exit("lt_algos.py: --rows must be multiples of 16 (cuBLASLt's FP8 products take no others)")
    bandwidth = copy_bandwidth()
    started = time.time()
    rows = bench(args.shape, args.rows, args.algos, bandwidth)
    machine = (f"{torch.cuda.get_device_name()}, {platform.machine()}; torch {torch.__version__}, "
               f"cuBLASLt {library().cublasLtGetVersion()}")
    log(f"{len(rows)} products in {time.time() - started:.0f} s on {machine}")
    if args.record:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"machine": machine, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
                                            "rows": rows}, indent=1) + "\n")
        log(f"wrote {args.results}")


if __name__ == "__main__":
    main()
