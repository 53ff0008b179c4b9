"""Programmatic dependent launch (PDL) for the engine's Triton kernels, on Hopper and later GPUs.

Inside a CUDA graph the kernels of a step still run strictly one after another: a kernel's programs are scheduled
only once every program of the kernel before it has ended and its writes are flushed, and each boundary costs a
launch and a ramp (a decode step of the 8B shape crosses about 360 of them). With PDL a kernel is launched as a
dependent of the one before it on the stream (CUDA's programmatic stream serialization, which graph capture records
as programmatic edges): its programs may be scheduled once every program of the kernel before has signalled
(`gdc_launch_dependents`), and each of them waits (`gdc_wait`) until that kernel has ended and its writes are
visible. What overlaps is one kernel's launch and ramp with the last wave of the one before; the arithmetic is the
same, in the same order, so the outputs are the same bits.

The rule that keeps it correct: a kernel launched as a dependent waits before its first load or store. Every Triton
kernel of the engine takes the `PDL` constexpr and calls `start(PDL)` first, which waits and then signals its own
dependents; `args(device)` gives a launch both the constexpr and the launch flag, or neither. Kernels of other
libraries (cuBLAS, torch's own) launch as before, and plain stream order holds around them: a dependent after one of
them is scheduled only once it ends.

`EMBER_PDL=1` in the environment turns it on (`0` off); off by default until the GPU machine has timed it
(bench/engine/speed.py with and without).
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs launch no Triton kernel
    triton = None

ENABLED = os.environ.get("EMBER_PDL", "0") == "1"
_CAPABLE: dict[int, bool] = {}


def on(device: torch.device) -> bool:
    """Whether kernels launched on `device` launch as dependents: ENABLED, a CUDA device of compute capability 9.0
    or later (PDL's instructions exist from Hopper on), and a Triton that has them (3.4 on), compiling rather than
    interpreting."""
    if not ENABLED or gdc_wait is None or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    capable = _CAPABLE.get(index)
    if capable is None:
        capable = _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return capable


def args(device: torch.device) -> dict:
    """A launch's keyword arguments: the kernel's PDL constexpr and Triton's launch flag together, or neither (the
    kernel's PDL defaults to False). Never one without the other: a kernel launched as a dependent that does not
    wait could read what the kernel before it has not yet written."""
    return {"PDL": True, "launch_pdl": True} if on(device) else {}


try:   # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_wait = gdc_launch_dependents = None

if triton is not None:
    @triton.jit
    def prefetch(pointers):
        """Asks L2 for the 128-byte lines at `pointers` (any shape) and waits for none of them: a dependent kernel's
        reads of what no kernel before it writes (a product's weight), issued before `start` waits, so that they
        overlap the end of the kernel before."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [pointers], dtype=tl.int32, is_pure=False,
                                  pack=1)

if triton is not None and gdc_wait is not None:
    @triton.jit
    def start(PDL: tl.constexpr):
        """A kernel's first call: with PDL, wait for the kernel before it (its writes visible), then let the next
        kernel's programs be scheduled as this one's finish. Without, nothing."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
elif triton is not None:
    @triton.jit
    def start(PDL: tl.constexpr):
        """A Triton without PDL's instructions: `on` is never true, so nothing to wait for."""
        pass
else:
    start = prefetch = None
