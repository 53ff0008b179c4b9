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
where the weight's rows take cuBLASLt's M side, and scaled (the token and weight-row scales applied in the product,
cuBLASLt's outer-vector scaling: fp8.LT_SCALED), against _scaled_mm with row scales (torch's CUTLASS kernel); each
fastest output's largest difference from _scaled_mm's. Whether a choice of algorithm, which the engine makes once per
shape at its warm-up (fp8.LT_CHOICE, LT_SCALED), pays.
"""
import argparse
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


def bench(shape: str, rows_list: list[int], count: int, bandwidth: float, on_row=None) -> list[dict]:
    """Every product's rows (see the module's docstring); `on_row(rows so far)` after each, so a run cut short keeps
    what it measured."""
    from ember.runtime.engine import cublaslt, fp8
    out_rows = []
    for name, n, k in products(shape):
        if name == "lm_head":
            continue   # the engine keeps the head in bf16 under FP8 weights
        copies = max(2, math.ceil((512 << 20) / (n * k)))
        pairs = [fp8.quantize_rows(torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02)
                 for _ in range(copies)]
        weights = [w for w, _ in pairs]
        for m in rows_list:
            xq, xs = fp8.quantize_tokens(torch.randn(m, k, dtype=torch.bfloat16, device="cuda"))
            one = torch.ones((), dtype=torch.float32, device="cuda")
            tensor_scaled = [functools.partial(torch._scaled_mm, xq, w.t(), scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16, use_fast_accum=True) for w in weights]
            row_scaled = [functools.partial(torch._scaled_mm, xq, w.t(), scale_a=xs, scale_b=ws.view(1, -1),
                                            out_dtype=torch.bfloat16, use_fast_accum=True) for w, ws in pairs]
            references = {False: tensor_scaled[0]().float(), True: row_scaled[0]().float()}
            row = {"shape": shape, "product": name, "m": m, "n": n, "k": k,
                   "read_floor_us": round(n * k / bandwidth * 1e6, 2),
                   "scaled_mm_us": round(in_graph(tensor_scaled) * 1e6, 2),
                   "scaled_mm_rows_us": round(in_graph(row_scaled) * 1e6, 2)}
            for key, swapped, scaled in (("lt", False, False), ("swapped", True, False), ("scaled", False, True)):
                product = cublaslt.Fp8Product(m, n, k, xq.device, swapped, scaled)
                outs = [torch.empty((n, m) if swapped else (m, n), dtype=torch.bfloat16, device="cuda")
                        for _ in weights]
                reference = references[scaled]
                timings = []
                for index, result in enumerate(product.candidates(count)):
                    algo = result.algo
                    calls = [functools.partial(product.run, xq, w, out, algo, *((xs, ws) if scaled else ()))
                             for (w, ws), out in zip(pairs, outs)]
                    try:
                        seconds = in_graph(calls)
                    except RuntimeError as err:   # an algorithm a graph cannot hold, or one that fails to run
                        log(f"  {name} m={m} {key} #{index}: {str(err)[:160]}")
                        torch.cuda.synchronize()
                        continue
                    product.run(xq, weights[0], outs[0], algo, *((xs, pairs[0][1]) if scaled else ()))
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
            if on_row is not None:
                on_row(out_rows)
            log(f"{name:13s} m={m:3d}: read {row['read_floor_us']:6.2f} us, _scaled_mm {row['scaled_mm_us']:6.2f} "
                f"(row scales {row['scaled_mm_rows_us']:6.2f}); heuristic's first, best: "
                + "; ".join(f"{key} {row.get(f'{key}_first_us')}, {row.get(f'{key}_best_us')} "
                            f"({_brief(row.get(f'{key}_best'))})" for key in ("lt", "swapped", "scaled")))
        del weights, pairs
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
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS} (after every row)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    from ember.runtime.engine import cublaslt
    if not torch.cuda.is_available() or not cublaslt.available(torch.device("cuda")):
        sys.exit("lt_algos.py needs a CUDA GPU with FP8 (compute capability 8.9 or newer) and torch's cuBLASLt")
    if any(m % 16 for m in args.rows):
        sys.exit("lt_algos.py: --rows must be multiples of 16 (cuBLASLt's FP8 products take no others)")
    bandwidth = copy_bandwidth()
    lib = cublaslt.library()
    assert lib is not None
    machine = (f"{torch.cuda.get_device_name()}, {platform.machine()}; torch {torch.__version__}, "
               f"cuBLASLt {lib.cublasLtGetVersion()}")

    def record(rows: list[dict]) -> None:   # rewritten after every row
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"machine": machine, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
                                            "rows": rows}, indent=1) + "\n")

    started = time.time()
    rows = bench(args.shape, args.rows, args.algos, bandwidth, record if args.record else None)
    log(f"{len(rows)} products in {time.time() - started:.0f} s on {machine}"
        + (f"; wrote {args.results}" if args.record else ""))


if __name__ == "__main__":
    main()
