"""Host memory for a loader worker's chunk buffers: 2 MiB-aligned, backed by transparent huge
pages, and pinned in place for the GPU's copies.

On the GPU machine (a VM) the kernel's copy out of the page cache is bound by address
translation of the destination: into 4 KiB pages it ran at half the speed it reaches into huge
pages (bench/results/snapshot_warm_paths.md). torch's pinned allocator gives no say over page
size, so the buffer is mapped here, advised huge, touched, and registered with CUDA.
"""
import ctypes
import mmap

import torch

from ember.snapshot import cudart

HUGE = 2 << 20
MADV_HUGEPAGE = 14

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
FAILED = ctypes.c_void_p(-1).value


class HostBuffer:
    """`nbytes` of host memory as a uint8 tensor; pinned when given the CUDA runtime. close() frees it:
    after that no copy may still read it, and the tensor must not be used."""

    def __init__(self, nbytes: int, lib: ctypes.CDLL | None = None):
        self.size = -(-nbytes // HUGE) * HUGE
        self.raw = _libc.mmap(None, self.size + HUGE, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if self.raw in (None, FAILED):
            raise MemoryError(f"could not map {self.size} bytes for a load buffer: errno {ctypes.get_errno()}")
        self.address = self.raw + (-self.raw % HUGE)
        _libc.madvise(self.address, self.size, MADV_HUGEPAGE)  # a hint; without THP the pages stay 4 KiB
        ctypes.memset(self.address, 0, self.size)  # fault the pages in now, not during the first read
        self.lib = None
        if lib is not None:
            try:
                cudart.register(lib, self.address, self.size)
            except cudart.CudaError:
                self.close()
                raise
            self.lib = lib
        self.tensor = torch.frombuffer((ctypes.c_uint8 * self.size).from_address(self.address),
                                       dtype=torch.uint8)[:nbytes]

    def close(self) -> None:
        if self.lib is not None:
            cudart.unregister(self.lib, self.address)
            self.lib = None
        if self.raw is not None:
            _libc.munmap(self.raw, self.size + HUGE)
            self.raw = None
