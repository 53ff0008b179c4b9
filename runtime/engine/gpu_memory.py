"""Device memory the engine can give back while keeping its addresses: CUDA's virtual memory API through ctypes.

An `Arena` hands out `Region`s (the weights, the KV cache). On a GPU each region is a reserved range of device
virtual addresses (cuMemAddressReserve) backed by physical allocations (cuMemCreate, cuMemMap), and its
tensors are views of it made without a copy (torch.as_tensor over __cuda_array_interface__). `park()` copies
the regions that must survive to pinned host memory, then unmaps and releases every physical allocation while
the address ranges stay reserved; `wake()` maps fresh physical memory at the same addresses and copies back, a
kept region in pieces of WAKE_PIECE, each piece's copy queued as soon as it is mapped.
Everything that holds those addresses (the model's parameters, CUDA graphs, attention plans) stays valid, so a
park releases the GPU without rebuilding anything. Memory that torch's allocator owns (activations, graph
pools, kernel workspaces) stays where it is: it is small, and a park empties torch's cache of the rest.

On a CPU (CI) an arena hands out plain torch tensors through the same calls, and a park overwrites the regions
it discards (the KV cache) with NaN bytes, so the engine's tests catch any state that trusts them after a wake.
"""
import ctypes
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ember.snapshot.hostbuffer import HostBuffer

log = logging.getLogger(__name__)

ALIGN = 256                 # tensors inside a region start at this alignment (what cudaMalloc guarantees)
RANGE_ALIGN = 1 << 30       # a region's device addresses start here: see Driver.reserve
DISCARDED_BYTE = 0xFF       # an all-ones float is a NaN in every float dtype
# A wake maps a kept region (the weights) in pieces of this many bytes and queues each piece's copy as soon as it is
# mapped, so the copy does not wait for the whole region's allocation (memory a park gave back is cleared by the
# driver before it is handed out again). An 8B-shaped engine on an H200 (bench/engine/park_wake.py): median wake
# 0.341 s mapped whole, 0.327 s in pieces, against a 0.297 s copy floor.
WAKE_PIECE = 1 << 30

# Driver enums (cuda.h)
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
CUDA_ERROR_OUT_OF_MEMORY = 2


class CudaDriverError(RuntimeError):
    def __init__(self, call: str, code: int, message: str):
        super().__init__(f"{call} failed: {message} ({code})")
        self.call, self.code = call, code


class AddressTaken(RuntimeError):
    """The address range asked for is in use (by this process) or cannot be reserved at that address."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Driver:
    """The handful of libcuda calls an arena makes, bound to one device's primary context."""

    def __init__(self, ordinal: int):
        self.lib = _libcuda()
        self.ordinal = ordinal
        self._call("cuInit", 0)
        device = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(device), ordinal)
        self.context = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self.context), device)
        self.prop = _AllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                                    location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, ordinal))
        self.access = _AccessDesc(location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, ordinal),
                                  flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        name, version = ctypes.create_string_buffer(256), ctypes.c_int()
        self._call("cuDeviceGetName", name, 256, device)
        self._call("cuDriverGetVersion", ctypes.byref(version))
        self.identity = f"{name.value.decode()}, CUDA driver {version.value}"  # what a GPU memory image is valid on
        granularity = ctypes.c_size_t()
        self._call("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.prop),
                   CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        self.granularity = granularity.value

    def _call(self, name: str, *args) -> None:
        code = getattr(self.lib, name)(*args)
        if code:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise CudaDriverError(name, code, (text.value or b"unknown error").decode())

    def make_current(self) -> None:
        """The calling thread's context: driver calls from a fresh thread (a park in a worker thread) need one."""
        current = ctypes.c_void_p()
        self._call("cuCtxGetCurrent", ctypes.byref(current))
        if current.value != self.context.value:
            self._call("cuCtxSetCurrent", self.context)

    def reserve(self, size: int, at: int = 0) -> int:
        """Reserves `size` bytes of device addresses, at exactly `at` when given (else raises AddressTaken).

        New ranges start on a RANGE_ALIGN boundary. The driver hands out addresses from spans it sets up on demand,
        and a range requested at a fixed address in a fresh process lands only where a new span may start: a range
        recorded at an unaligned address (inside a span that allocations made earlier in that process had set up)
        was offered 22 MB further on in a fresh process on the H200 (test_park_gpu, 120 MB model)."""
        address = ctypes.c_uint64()
        self._call("cuMemAddressReserve", ctypes.byref(address), ctypes.c_size_t(size),
                   ctypes.c_size_t(max(self.granularity, RANGE_ALIGN)), ctypes.c_uint64(at), ctypes.c_uint64(0))
        if at and address.value != at:
            self.free_addresses(address.value, size)
            raise AddressTaken(f"device addresses {at:#x}+{size:#x} are taken (the driver offered "
                               f"{address.value:#x}): something allocated there first")
        return address.value

    def free_addresses(self, address: int, size: int) -> None:
        self._call("cuMemAddressFree", ctypes.c_uint64(address), ctypes.c_size_t(size))

    def map(self, address: int, size: int) -> int:
        """Backs [address, address+size) with new physical memory; returns its handle."""
        handle = ctypes.c_uint64()
        self._call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self.prop),
                   ctypes.c_uint64(0))
        try:
            self._call("cuMemMap", ctypes.c_uint64(address), ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                       ctypes.c_uint64(0))
        except CudaDriverError:
            self._call("cuMemRelease", handle)
            raise
        self._call("cuMemSetAccess", ctypes.c_uint64(address), ctypes.c_size_t(size), ctypes.byref(self.access),
                   ctypes.c_size_t(1))
        return handle.value

    def unmap(self, address: int, size: int, handle: int) -> None:
        """Unmaps the range and releases its physical memory; the addresses stay reserved."""
        self._call("cuMemUnmap", ctypes.c_uint64(address), ctypes.c_size_t(size))
        self._call("cuMemRelease", ctypes.c_uint64(handle))


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def driver(ordinal: int) -> Driver:
    return Driver(ordinal)


class _Mapping:
    """A region's device addresses and the physical memory behind them. The region's tensors hold it (through
    torch.as_tensor's owner), so when the last of them goes, so does the memory, unless the arena freed it first."""

    def __init__(self, driver: Driver, device: torch.device, address: int, size: int):
        self.driver, self.device, self.address, self.size = driver, device, address, size
        # the physical allocations backing the range now, as (address, size, handle); None while unmapped
        self.pieces: list[tuple[int, int, int]] | None = None
        self.freed = False
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None, "stream": None}

    def map(self, at: int, size: int) -> None:
        """Backs [address + at, address + at + size) with new physical memory."""
        piece = (self.address + at, size, self.driver.map(self.address + at, size))
        self.pieces = (self.pieces or []) + [piece]

    def unmap(self) -> None:
        """Releases the physical memory; the addresses stay reserved."""
        for address, size, handle in self.pieces or ():
            self.driver.unmap(address, size, handle)
        self.pieces = None

    def free(self) -> None:
        if self.freed:
            return
        torch.cuda.synchronize(self.device)  # no queued kernel may still touch what is unmapped
        self.driver.make_current()
        self.unmap()
        self.driver.free_addresses(self.address, self.size)
        self.freed = True

    def __del__(self):
        try:
            self.free()
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone; it frees everything then
            pass


@dataclass
class Region:
    """A named span of memory in an arena: `take()` carves tensors out of it, in order.

    `keep`: its bytes survive a park (weights, in pinned host memory meanwhile); otherwise a park discards
    them (the KV cache) and a wake hands back the same addresses holding garbage.
    """
    name: str
    nbytes: int
    keep: bool
    device: torch.device
    address: int = 0                   # device virtual address on a GPU; the data pointer of `base` on a CPU
    size: int = 0                      # nbytes rounded up to the mapping granularity
    mapping: _Mapping | None = None    # GPU: the address range and the physical memory backing it now
    base: torch.Tensor = field(init=False)
    host: torch.Tensor | None = None   # the pinned copy of a kept region, made at its first park
    host_buffer: "HostBuffer | None" = None  # what holds that copy's memory, closed when the region is freed
    used: int = 0

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """The next `shape` x `dtype` tensor of the region."""
        start = -(-self.used // ALIGN) * ALIGN
        n = dtype.itemsize * _numel(shape)
        if start + n > self.nbytes:
            raise ValueError(f"region {self.name!r} of {self.nbytes} bytes cannot hold {n} more at {start}")
        self.used = start + n
        return self.base[start:start + n].view(dtype).view(shape)

    @property
    def mapped(self) -> bool:
        return self.device.type != "cuda" or (self.mapping is not None and self.mapping.pieces is not None)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tensor_bytes(shapes_and_dtypes) -> int:
    """The bytes a region needs to `take()` these (shape, dtype) pairs in order."""
    used = 0
    for shape, dtype in shapes_and_dtypes:
        used = -(-used // ALIGN) * ALIGN + dtype.itemsize * _numel(shape)
    return used


@dataclass
class ParkReport:
    seconds: float
    released_bytes: int      # device memory unmapped (GPU) or regions discarded (CPU)
    host_copy_bytes: int     # bytes copied to pinned host memory by this park (0 when the copy was already there)


@dataclass
class WakeReport:
    seconds: float
    mapped_bytes: int
    copied_bytes: int
    map_seconds: float       # until every region was mapped (the kept regions' copies started on the way)
    copy_seconds: float      # waiting for the copies after that


class Arena:
    """The regions of one device; park() and wake() act on all of them."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.driver = driver(self.device.index) if self.device.type == "cuda" else None
        self.regions: list[Region] = []
        self.reserved: dict[str, tuple[int, int]] = {}  # name -> (address, size) reserved for a region to come
        self.parked = False

    @property
    def identity(self) -> str:
        return self.driver.identity if self.driver is not None else "cpu"

    def reserve(self, name: str, address: int, size: int) -> None:
        """Reserves the device addresses a region called `name` had in an earlier process (its GPU memory image),
        so that the region lands there; raises AddressTaken when something holds them. Nothing on a CPU."""
        if self.driver is None:
            return
        self.driver.make_current()
        self.reserved[name] = (self.driver.reserve(size, at=address), size)

    def region(self, name: str, nbytes: int, keep: bool) -> Region:
        """A new region of `nbytes`, mapped: at the addresses reserved for `name` when they fit, else anywhere."""
        if self.parked:
            raise RuntimeError("the arena is parked: wake it before allocating")
        if any(r.name == name for r in self.regions):
            raise ValueError(f"the arena already has a region named {name!r}")
        region = Region(name, nbytes, keep, self.device)
        if self.driver is None:
            raw = torch.zeros(max(nbytes, 1) + ALIGN, dtype=torch.uint8)
            skip = -raw.data_ptr() % ALIGN  # aligned as on the GPU, so views land where they would there
            region.base = raw[skip:skip + max(nbytes, 1)]
            region.address, region.size = region.base.data_ptr(), nbytes
        else:
            d = self.driver
            d.make_current()
            region.size = -(-max(nbytes, 1) // d.granularity) * d.granularity
            address, size = self.reserved.pop(name, (0, 0))
            if address and size != region.size:
                log.warning("region %s needs %d bytes, its recorded range has %d: reserving a new range", name,
                            region.size, size)
                d.free_addresses(address, size)
                address = 0
            region.address = address or d.reserve(region.size)
            region.mapping = _Mapping(d, self.device, region.address, region.size)
            region.mapping.map(0, region.size)  # on failure the mapping frees the addresses
            region.base = torch.as_tensor(region.mapping, device=self.device)
        self.regions.append(region)
        return region

    @property
    def mapped_bytes(self) -> int:
        """Memory the arena's regions hold now: device memory on a GPU (none while parked), host memory on a CPU."""
        return sum(r.size for r in self.regions if r.mapped)

    def park(self) -> ParkReport:
        if self.parked:
            return ParkReport(0.0, 0, 0)
        began = time.perf_counter()
        copied = released = 0
        if self.driver is None:
            for r in self.regions:
                if not r.keep:
                    r.base.fill_(DISCARDED_BYTE)
                    released += r.size
        else:
            torch.cuda.synchronize(self.device)  # nothing may still read or write what is unmapped next
            self.driver.make_current()
            for r in self.regions:
                if r.keep and r.host is None:  # the weights never change, so one host copy serves every park
                    r.host, r.host_buffer = _pinned(r.size)
                    r.host.copy_(r.base)
                    copied += r.size
            for r in self.regions:
                if r.mapped and r.mapping is not None:
                    r.mapping.unmap()
                    released += r.size
            torch.cuda.empty_cache()
        self.parked = True
        seconds = time.perf_counter() - began
        log.info("parked %d regions: released %.2f GB, copied %.2f GB to host in %.3f s",
                 len(self.regions), released / 1e9, copied / 1e9, seconds)
        return ParkReport(seconds, released, copied)

    def wake(self) -> WakeReport:
        """Maps every region again at its addresses and copies the kept ones back. The kept regions are mapped
        first, in pieces whose copies start as each is mapped, and the copies run while the rest are mapped: a
        large KV cache can take as long to map as the weights to copy (108 GiB on an H200: ~0.3 s while the driver
        still clears what the park released, 5-50 ms a few seconds later; the 8B shape's 15 GiB copy: 0.3 s)."""
        if not self.parked:
            return WakeReport(0.0, 0, 0, 0.0, 0.0)
        began = time.perf_counter()
        mapped = copied = 0
        if self.driver is not None:
            self.driver.make_current()
            stream = torch.cuda.Stream(self.device)
            try:
                granular = max(WAKE_PIECE // self.driver.granularity, 1) * self.driver.granularity
                for r in sorted(self.regions, key=lambda r: not r.keep):
                    assert r.mapping is not None  # every region of a GPU arena has one
                    piece = granular if r.keep else r.size
                    for at in range(0, r.size, piece):
                        size = min(piece, r.size - at)
                        r.mapping.map(at, size)
                        if r.keep and r.host is not None:
                            with torch.cuda.stream(stream):
                                r.base[at:at + size].copy_(r.host[at:at + size], non_blocking=True)
                            copied += size
                    mapped += r.size
            except CudaDriverError:
                stream.synchronize()
                for r in self.regions:  # all or nothing: a half-mapped arena must not serve
                    if r.mapping is not None:
                        r.mapping.unmap()
                raise
            mapped_at = time.perf_counter()
            stream.synchronize()
        else:
            mapped_at = time.perf_counter()
        self.parked = False
        done = time.perf_counter()
        report = WakeReport(done - began, mapped, copied, mapped_at - began, done - mapped_at)
        log.info("woke %d regions: mapped %.2f GB and copied %.2f GB back in %.3f s", len(self.regions),
                 mapped / 1e9, copied / 1e9, report.seconds)
        return report

    def release_reservations(self) -> None:
        """Frees reserved ranges that no region took."""
        if self.driver is None or not self.reserved:
            return
        self.driver.make_current()
        for address, size in self.reserved.values():
            self.driver.free_addresses(address, size)
        self.reserved.clear()

    def free(self, name: str) -> None:
        """Frees the region called `name`, if there is one, addresses too; its tensors must not be used again."""
        for region in [r for r in self.regions if r.name == name]:
            self._free(region)
            self.regions.remove(region)

    def release(self) -> None:
        """Frees every region, addresses too; their tensors must not be used again."""
        for region in self.regions:
            self._free(region)
        self.regions.clear()

    def _free(self, region: Region) -> None:
        if region.mapping is not None:
            region.mapping.free()
        if region.host_buffer is not None:
            region.host_buffer.close()
            region.host, region.host_buffer = None, None


def _pinned(nbytes: int) -> "tuple[torch.Tensor, HostBuffer | None]":
    """Page-locked host memory for a region's copy, and what holds it (None when torch does): huge pages pinned in
    place, else torch's pinned allocator."""
    from ember.snapshot import cudart
    from ember.snapshot.hostbuffer import HostBuffer

    lib = cudart.runtime()
    if lib is not None:
        try:
            buffer = HostBuffer(nbytes, lib)
            return buffer.tensor, buffer
        except (MemoryError, cudart.CudaError) as err:
            log.info("huge-page host buffer unavailable (%s); using torch's pinned memory", err)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None
