"""What the streamed decode attention compiles to for Hopper, without a GPU: registers, spills and its loop's code.

    python bench/engine/kernel_sass.py [--variants engine perm=0 prefetch_table=0,stages=2 maxnreg=128] [--block-t 128]

Each variant is StreamedDecode's options over an FP8 cache, or a bf16 one with --cache bf16 (the engine's
streamed_config for it, with the options given on top: `perm`, `defer_sum`, `prefetch_table`, `quant`
(paged_decode.QUANTIZED_OUT's epilogue), `longest_first` (paged_decode.LONGEST_FIRST's order), `maxnreg=N`,
`heads=N`, `block_t=N`, `warps=N`, `stages=N`; `perm=0` turns one off), compiled by Triton for sm_90 (the H100
and H200) as the engine's JIT would compile it (pointer and stride arguments 16-divisible), then read back with
the cuobjdump Triton ships. `--fused` (with `--packed-round`: fused.PACKED_ROUND on) compiles fused.py's norm,
RoPE and SiLU-mul kernels instead, at the 8B shape's widths (FUSED_CASES), and prints each one's registers and a
thread's instructions. For each it prints the registers a thread and the bytes spilled (so
how many programs of its warps share a multiprocessor: 65,536 registers and 228 KB of shared memory each), the
shared memory a program takes, and of its main loop (one tile an iteration) the instructions, shared-memory
loads, barriers and tensor-core instructions. These explain a kernel's time but do not measure it:
kernel_bench.py --parts attention_fp8 times the same variants on the GPU. Needs Triton (pip install triton), no
GPU; Triton's version decides the code, so name it beside any number taken from here (the GPU machine's is
3.6.0: pip install triton==3.6.0 compiles what it runs).
"""
import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024


def parse_variant(text: str) -> dict:
    """'perm,maxnreg=128' -> {'perm': True, 'maxnreg': 128}; 'engine' -> {}."""
    options: dict = {}
    for part in filter(None, text.split(",")):
        if part == "engine":
            continue
        name, _, value = part.partition("=")
        options[name] = int(value) if value else True
    return options


def compile_variant(options: dict, arch: int = 90, cache: str = "fp8"):
    """The streamed kernel over a `cache` ("fp8" or "bf16") KV cache compiled for `arch`, with the engine's
    configuration for that cache and `options` over it."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ember.runtime.engine import paged_decode

    dtype = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16
    config = paged_decode.streamed_config(dtype) | options
    launch = {"num_warps": config.pop("warps", 4), "num_stages": config.pop("stages", 3)}
    if "maxnreg" in config:
        launch["maxnreg"] = config.pop("maxnreg")
    heads = config.get("heads", 1)
    group = 4   # the Qwen3 shapes' query heads a KV head
    constexprs = {"GROUP": group, "GROUP_PAD": max(16, triton.next_power_of_2(group * heads)), "D": 128, "PAGE": 16,
                  "BLOCK_T": config.get("block_t", 64), "KV_A": config.get("kv_a", False),
                  "F16": config.get("f16", False), "HEADS": heads, "PERM": config.get("perm", False),
                  "DEFER": config.get("defer_sum", False), "PREFETCH": config.get("prefetch_table", False),
                  "ORDER": config.get("longest_first", False), "QUANT": config.get("quant", False), "ROW": 32 * 128}
    pointers = {"q_ptr": "*bf16", "cache_ptr": "*fp8e4nv" if cache == "fp8" else "*bf16", "out_ptr": "*bf16",
                "partial_ptr": "*fp32", "lse_ptr": "*fp32", "scale_log2": "fp32", "quant_ptr": "*fp8e4nv",
                "quant_scale_ptr": "*fp32"}
    fn = paged_decode._stream_kernel
    names = fn.arg_names
    unknown = set(constexprs) - set(names)
    if unknown:
        raise SystemExit(f"paged_decode._stream_kernel has no {sorted(unknown)}: update kernel_sass.py's constexprs")
    signature = {name: "constexpr" if name in constexprs else pointers.get(
        name, "*i32" if name.endswith("_ptr") else "i32") for name in names}
    aligned = [i for i, name in enumerate(names) if name.endswith("_ptr") or name.startswith(("s_", "q_stride"))]
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(source, target=GPUTarget("cuda", arch, 64), options=launch), launch["num_warps"]


def cuobjdump() -> str:
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        raise SystemExit(f"no cuobjdump at {tool}: this Triton install does not ship it")
    return str(tool)


def loop_stats(sass: str) -> dict:
    """The longest backward branch's body (the kernel's tile loop): instructions and counts of a few kinds."""
    code = []
    for line in sass.splitlines():
        match = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if match:
            code.append((int(match.group(1), 16), match.group(2).strip()))
    index = {address: i for i, (address, _) in enumerate(code)}
    loops = []
    for i, (_, text) in enumerate(code):
        branch = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?(0x[0-9a-f]+)", text)
        if branch and index.get(int(branch.group(1), 16), i) < i:
            loops.append((index[int(branch.group(1), 16)], i))
    if not loops:
        return {}
    first, last = max(loops, key=lambda span: span[1] - span[0])
    kinds: dict[str, int] = {}
    for _, text in code[first:last + 1]:
        op = text.split()[1] if text.startswith("@") else text.split()[0]
        kinds[op.split(".")[0]] = kinds.get(op.split(".")[0], 0) + 1
    return {"instructions": last - first + 1, "LDS": kinds.get("LDS", 0), "BAR": kinds.get("BAR", 0),
            "HGMMA": kinds.get("HGMMA", 0), "F2FP": kinds.get("F2FP", 0), "PRMT": kinds.get("PRMT", 0)}


def describe(options: dict, tool: str, cache: str = "fp8") -> dict:
    kernel, warps = compile_variant(options, cache=cache)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    spilled = int(re.search(r"STACK:(\d+)", usage).group(1)) + int(re.search(r"LOCAL:(\d+)", usage).group(1))
    shared = kernel.metadata.shared
    per_warp = -(-registers * 32 // 256) * 256   # registers are given to a warp 256 at a time
    programs = min(REGISTERS_PER_SM // (per_warp * warps), SHARED_PER_SM // max(shared, 1))
    return {"registers": registers, "spilled_bytes": spilled, "shared_bytes": shared,
            "programs_per_sm": programs} | loop_stats(sass)


# --fused: runtime/engine/fused.py's kernels at the 8B shape's widths, as the FP8 engine launches them at a decode
# step's rows: (kernel, argument types past the defaults, constexprs, warps). silu_one_block is the SiLU-mul's
# one pass over a single padded block of 16,384, as the kernel held the 8B's rows before fused.one_pass_chunks (that
# kernel took its amax in one reduction: 824 and 584 instructions, where this one takes 840 and 600).
_BF16, _FP8 = "*bf16", "*fp8e4nv"
_NORM = {"x_ptr": _BF16, "residual_ptr": _BF16, "out_ptr": _FP8, "total_ptr": _BF16, "weight_ptr": _BF16}
_SILU = {"gate_up_ptr": _BF16, "out_ptr": _FP8}
FUSED_CASES = {
    "norm_fp8_unscaled_16w": ("_rms_norm_kernel", _NORM,
                              {"HAS_RESIDUAL": True, "BLOCK": 4096, "QUANT": True, "SCALED": True}, 16),
    "norm_fp8_16w": ("_rms_norm_kernel", _NORM, {"HAS_RESIDUAL": True, "BLOCK": 4096, "QUANT": True}, 16),
    "norm_fp8_4w": ("_rms_norm_kernel", _NORM, {"HAS_RESIDUAL": True, "BLOCK": 4096, "QUANT": True}, 4),
    "rope_unscaled": ("_norm_rope_store_kernel",
                      {"q_ptr": _BF16, "k_ptr": _BF16, "v_ptr": _BF16, "cos_ptr": _BF16, "sin_ptr": _BF16,
                       "qw_ptr": _BF16, "kw_ptr": _BF16, "cache_ptr": _FP8, "blocks_ptr": "*i64",
                       "offsets_ptr": "*i64"}, {"HAS_NORM": True, "D": 128, "HEADS": 8, "SCALED": True}, 4),
    "silu_unscaled": ("_silu_mul_fp8_kernel", _SILU, {"BLOCK": 4096, "CHUNKS": 3, "ONE_PASS": True, "SCALED": True},
                      32),
    "silu": ("_silu_mul_fp8_kernel", _SILU, {"BLOCK": 4096, "CHUNKS": 3, "ONE_PASS": True}, 32),
    "silu_unscaled_one_block": ("_silu_mul_fp8_kernel", _SILU,
                                {"BLOCK": 16384, "CHUNKS": 1, "ONE_PASS": True, "SCALED": True}, 32),
    "silu_one_block": ("_silu_mul_fp8_kernel", _SILU, {"BLOCK": 16384, "CHUNKS": 1, "ONE_PASS": True}, 32),
}


def describe_fused(case: str, tool: str) -> dict:
    """A FUSED_CASES kernel compiled for sm_90 (integer and size arguments 16-divisible, as the JIT specializes
    the 8B shape's): registers and a thread's instructions, the whole kernel (these have no tile loop)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ember.runtime.engine import fused

    name, types, constexprs, warps = FUSED_CASES[case]
    fn = getattr(fused, name)
    names = fn.arg_names
    constexprs = {k: False for k in ("SCALED", "PDL", "QUANT") if k in names} | constexprs
    signature = {arg: "constexpr" if arg in constexprs else types.get(
        arg, "fp32" if arg == "eps" else "*fp32" if arg.endswith("_ptr") else "i32") for arg in names}
    aligned = [i for i, arg in enumerate(names) if signature[arg] not in ("constexpr", "fp32")]
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True).stdout
    instructions = sum(1 for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", line))
    return {"warps": warps, "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "instructions": instructions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+",
                        default=["engine", "perm=0", "defer_sum=0", "prefetch_table=0,stages=2", "maxnreg=128"],
                        help="StreamedDecode options over the engine's FP8 configuration, comma-separated")
    parser.add_argument("--block-t", type=int, default=None, help="tokens a tile for every variant")
    parser.add_argument("--cache", choices=["fp8", "bf16"], default="fp8",
                        help="the KV cache's dtype (each variant starts from the engine's configuration for it)")
    parser.add_argument("--fused", action="store_true",
                        help="fused.py's norm, RoPE and SiLU-mul kernels instead (FUSED_CASES; --variants ignored)")
    parser.add_argument("--packed-round", action="store_true", help="with --fused: fused.PACKED_ROUND on")
    args = parser.parse_args()
    try:
        import triton
    except ImportError:
        sys.exit("kernel_sass.py needs Triton: pip install triton (no GPU needed)")
    tool = cuobjdump()
    if args.fused:
        from ember.runtime.engine import fused
        fused.PACKED_ROUND = triton.language.constexpr(args.packed_round)
        print(f"Triton {triton.__version__}, sm_90, fused.PACKED_ROUND {args.packed_round}")
        for case in FUSED_CASES:
            row = describe_fused(case, tool)
            print(f"{case:28s} " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        return
    print(f"Triton {triton.__version__}, sm_90, {args.cache} cache, 4 query heads a KV head, head_dim 128")
    for text in args.variants:
        options = parse_variant(text)
        if args.block_t:
            options.setdefault("block_t", args.block_t)
        row = describe(options, tool, args.cache)
        print(f"{text:28s} " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
