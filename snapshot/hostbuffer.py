"""Host memory for a loader worker's chunk buffers: 2 MiB-aligned, backed by transparent huge
pages, and pinned in place for the GPU's copies.

On the GPU machine (a VM) the kernel's copy out of the page cache is bound by address
translation of the destination: into 4 KiB pages it ran at half the speed it reaches into huge
pages (bench/results/snapshot_warm_paths.md). torch's pinned allocator gives no say over page
size, so the buffer is mapped here, advised huge, touched, and registered with CUDA.
"""
import ctypes
import mmap
import os
import threading

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


# Threads that fault a buffer's pages in: the kernel clears each page in the thread that faults it, so one thread
# takes seconds for a model's weights (the 8B shape's first park, 15 GB, took 3.2-3.6 s in all on the H200's VM); on
# this project's 2-core CPU VM, 4 GiB took 0.5-10.9 s in one thread and 0.29-0.35 s in two.
TOUCH_THREADS = 8
TOUCH_SLICE = 256 << 20  # no thread for less than this


def touch(address: int, size: int) -> None:
    """Writes zeros over [address, address+size), in slices across threads (ctypes releases the GIL)."""
    threads = max(1, min(TOUCH_THREADS, os.cpu_count() or 1, size // TOUCH_SLICE))
    part = -(-size // threads // HUGE) * HUGE
    slices = [(address + at, min(part, size - at)) for at in range(0, size, part)]
    if len(slices) == 1:
        ctypes.memset(address, 0, size)
        return
    workers = [threading.Thread(target=ctypes.memset, args=(start, 0, length), daemon=True) for start, length in slices]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


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
        touch(self.address, self.size)  # fault the pages in now, not during the first read
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
