"""Park a process whose CUDA code cannot cooperate: the driver's checkpoint API moves all of its GPU state to
host memory and gives the GPU back, and a restore puts it back at the same addresses.

    python -m ember.runtime.cuda_checkpoint park PID     # lock (wait for its CUDA work), checkpoint
    python -m ember.runtime.cuda_checkpoint wake PID     # restore, unlock

A process cannot checkpoint itself (its own calls would wait on the lock), so the worker runs this as a child
on its own pid. Slower than cooperating through @ember.park()/@ember.wake() and an engine's arena: measured on
an H200, 9.2 GB of GPU memory took 5.0 s to checkpoint and 1.75 s (5.3 GB/s) to restore, against 55 GB/s for
the engine's pinned copies. Choose it with `@app.cls(park_with="cuda-checkpoint")`.
"""
import ctypes
import subprocess
import sys
import time

LOCK_TIMEOUT_MS = 30_000
CUDA_ERROR_NOT_SUPPORTED = 801
STEPS = {"park": ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint"),
         "wake": ("cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")}


class CheckpointError(RuntimeError):
    pass


def run(action: str, pid: int) -> float:
    """Parks or wakes process `pid` in this process; returns the seconds it took."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise CheckpointError("no CUDA driver here: parking with park_with='cuda-checkpoint' needs an NVIDIA GPU "
                              "(driver 550 or newer)") from None
    if not hasattr(lib, "cuCheckpointProcessLock"):
        raise CheckpointError("this CUDA driver has no checkpoint API: upgrade to driver 550 or newer, or park "
                              "with @ember.park()/@ember.wake() hooks")
    lib.cuInit(0)
    began = time.perf_counter()
    for step in STEPS[action]:
        args = (ctypes.c_uint32 * 16)()  # the driver's argument structs: 64 bytes, reserved fields zero
        if step == "cuCheckpointProcessLock":
            args[0] = LOCK_TIMEOUT_MS
        code = getattr(lib, step)(pid, ctypes.byref(args))
        if code:
            text = ctypes.c_char_p()
            lib.cuGetErrorString(code, ctypes.byref(text))
            why = f"{step}({pid}) failed: {(text.value or b'unknown error').decode()} ({code})"
            if code == CUDA_ERROR_NOT_SUPPORTED:
                why += (": this machine's driver cannot checkpoint the process (seen once on an H100 with driver"
                        " 580.159.04, where other machines with that driver could); park with park_with=\"hooks\""
                        " (the default) and @ember.park()/@ember.wake()")
            raise CheckpointError(why)
    return time.perf_counter() - began


def checkpoint_self(action: str) -> None:
    """Parks or wakes this process through a child process (blocking); raises CheckpointError with its reason."""
    import os

    done = subprocess.run([sys.executable, "-m", "ember.runtime.cuda_checkpoint", action, str(os.getpid())],
                          capture_output=True, text=True)
    if done.returncode:
        raise CheckpointError(
            done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in STEPS or not argv[1].isdigit():
        print("usage: python -m ember.runtime.cuda_checkpoint park|wake PID", file=sys.stderr)
        return 2
    try:
        seconds = run(argv[0], int(argv[1]))
    except CheckpointError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"{argv[0]} {argv[1]}: {seconds:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
