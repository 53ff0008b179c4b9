"""The three CUDA runtime calls the loader makes itself, through ctypes: pin host pages, unpin
them, and queue a host->device copy between raw addresses.

ctypes drops the GIL for the length of each call, so sixteen loader threads can pin and queue
at once, and a copy out of page-cache pages needs no torch tensor over them. The library is
the libcudart that torch itself loaded (found in /proc/self/maps), so both share one context.
"""
import ctypes
import functools
from pathlib import Path

READ_ONLY = 8  # cudaHostRegisterReadOnly: the GPU only reads these pages, so read-only mappings qualify
HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


class CudaError(RuntimeError):
    pass


@functools.cache
def runtime() -> ctypes.CDLL | None:
    """torch's libcudart, or None without CUDA (then the loader copies through torch)."""
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
    _check(lib, lib.cudaHostRegister(address, nbytes, READ_ONLY), "cudaHostRegister")


def unregister(lib: ctypes.CDLL, address: int) -> None:
    _check(lib, lib.cudaHostUnregister(address), "cudaHostUnregister")


def copy_to_device(lib: ctypes.CDLL, dst: int, src: int, nbytes: int, stream: int) -> None:
    _check(lib, lib.cudaMemcpyAsync(dst, src, nbytes, HOST_TO_DEVICE, stream), "cudaMemcpyAsync")
