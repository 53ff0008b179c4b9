"""The three CUDA runtime calls the loader makes itself, through ctypes: pin host memory, unpin
it, and queue a host->device copy between raw addresses.

ctypes drops the GIL for the length of each call, and a copy queued here skips torch's
dispatcher and its pinned-memory bookkeeping: on the GPU machine queuing a chunk's copies
took a fifth of the thread time torch's copy_ did. The library is the libcudart that torch
itself loaded (found in /proc/self/maps), so both share one context.
"""
import ctypes
import functools
from pathlib import Path

HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


class CudaError(RuntimeError):
    pass


@functools.cache
def runtime() -> ctypes.CDLL | None:
    """torch's libcudart, or None without CUDA or when torch links it statically (then the loader uses torch)."""
    import torch
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.rsplit(None, 1)[-1]
        if Path(path).name.startswith("libcudart.so"):
            break
    else:
        return None
    lib = ctypes.CDLL(path)
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    lib.cudaGetErrorString.argtypes = [ctypes.c_int]
    lib.cudaGetLastError.argtypes = []
    return lib


def _check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code:
        lib.cudaGetLastError()  # these errors are not sticky: clear it so the next call does not report it
        raise CudaError(f"{what} failed: {lib.cudaGetErrorString(code).decode()} ({code})")


def register(lib: ctypes.CDLL, address: int, nbytes: int) -> None:
    _check(lib, lib.cudaHostRegister(address, nbytes, 0), "cudaHostRegister")


def unregister(lib: ctypes.CDLL, address: int) -> None:
    _check(lib, lib.cudaHostUnregister(address), "cudaHostUnregister")


def copy_to_device(lib: ctypes.CDLL, dst: int, src: int, nbytes: int, stream: int) -> None:
    _check(lib, lib.cudaMemcpyAsync(dst, src, nbytes, HOST_TO_DEVICE, stream), "cudaMemcpyAsync")
