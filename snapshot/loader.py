"""Loads a snapshot at the speed of its slowest link: storage, checksum, PCIe.

Each worker thread owns two chunk buffers (pinned when the target is a GPU, allocated by the
worker itself so pinning overlaps the other workers' reads) and one CUDA stream. It reads a
chunk into one buffer (page cache or O_DIRECT from disk, or a ranged GET from S3), checks
the chunk's xxh3-128, and queues its host->device copies straight into the target tensors,
then reads the next chunk into its other buffer while those copies run. A buffer is reused
only once the copies out of it have finished.

A warm chunk (the page cache holds it, the source maps its file, the target is a GPU) skips
the buffer: the worker checks the chunk where it lies in the file's mapping, pins those
page-cache pages (cudaHostRegister) and has the GPU copy from them, then unpins them once the
copy is done. That is two passes over host memory instead of four (read's copy in and out,
the checksum, the DMA), which is what bounds a warm load.

A chunk is copied only after its checksum passed, so the targets never receive a corrupt
byte; but when a later chunk fails, earlier tensors are already written: the caller must
treat the targets as garbage (restore_into's contract) and boot from scratch.
"""
import bisect
import collections
import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import xxhash

from ember.snapshot import cudart
from ember.snapshot.errors import SnapshotCorrupt, SnapshotMismatch
from ember.snapshot.format import ALIGN, DTYPES, Header

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    bytes: int
    seconds: float
    chunks: int
    threads: int
    direct_io: bool
    source: str
    device: str
    # wall seconds for allocate / stream; summed thread seconds for pin / read / verify / copy / register
    phases: dict[str, float] = field(default_factory=dict)
    mapped_chunks: int = 0  # chunks copied straight out of the page cache (the warm path)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def __str__(self) -> str:
        parts = " ".join(f"{k}={v:.3f}s" for k, v in self.phases.items())
        return (f"{self.bytes / 1e9:.2f} GB in {self.seconds:.3f} s = {self.gbps:.1f} GB/s from {self.source} "
                f"({self.threads} threads, direct_io={self.direct_io}, {self.mapped_chunks}/{self.chunks} chunks "
                f"from the page cache mapping; {parts})")


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def plan(header: Header) -> list[list[tuple[str, int, int, int]]]:
    """For each chunk: (tensor, start in chunk, end in chunk, start in tensor) of every piece it holds."""
    starts = [t.offset for t in header.tensors]
    pieces = []
    for index in range(len(header.chunks)):
        lo, hi = header.chunk_span(index)
        found = []
        for entry in header.tensors[max(bisect.bisect_right(starts, lo) - 1, 0):]:
            if entry.offset >= hi:
                break
            a, b = max(lo, entry.offset), min(hi, entry.offset + entry.nbytes)
            if a < b:
                found.append((entry.name, a - lo, b - lo, a - entry.offset))
        pieces.append(found)
    return pieces


def check_targets(header: Header, targets: Mapping[str, torch.Tensor]) -> None:
    want = {t.name: t for t in header.tensors}
    missing, extra = want.keys() - targets.keys(), targets.keys() - want.keys()
    if missing or extra:
        raise SnapshotMismatch(f"snapshot and model hold different tensors: missing from model {sorted(missing)[:5]}, "
                               f"missing from snapshot {sorted(extra)[:5]}; rebuild the snapshot from this model")
    for name, t in targets.items():
        e = want[name]
        if tuple(t.shape) != e.shape or t.dtype != DTYPES[e.dtype]:
            raise SnapshotMismatch(f"tensor {name!r}: model has {t.dtype} {tuple(t.shape)}, snapshot has "
                                   f"{e.dtype} {e.shape}; rebuild the snapshot from this model")
        if not t.is_contiguous():
            raise SnapshotMismatch(f"tensor {name!r} is not contiguous; load into contiguous tensors")


def aligned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """4 KiB-aligned host memory, as O_DIRECT wants. Pinned memory is page-aligned already, and
    asking for more would make the pinned allocator round up to the next power of two."""
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


def checksum(data) -> str:
    hasher = xxhash.xxh3_128()
    hasher.update(data)  # update() lets go of the GIL while it hashes; xxh3_128_hexdigest() does not
    return hasher.hexdigest()


def load(source, targets: Mapping[str, torch.Tensor] | None = None, device: str | torch.device = "cpu",
         threads: int | None = None, progress: Progress | None = None,
         verify: bool = True, mapped: float = 0.0) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Reads every tensor of `source` into `targets` (allocated on `device` when None).

    Raises SnapshotCorrupt when a chunk fails its checksum, SnapshotMismatch when targets
    do not match the snapshot (before any byte is copied). `verify=False` skips the
    checksums: only for bytes already verified once (the benchmark uses it to show their cost).
    `mapped`: the share of workers that copy warm chunks straight from the pinned page cache.
    """
    began = time.perf_counter()
    header: Header = source.header
    if targets is None:
        targets = {e.name: torch.empty(e.shape, dtype=DTYPES[e.dtype], device=device) for e in header.tensors}
    else:
        check_targets(header, targets)
    device = next(iter(targets.values())).device if targets else torch.device(device)
    cuda = device.type == "cuda"
    lib = cudart.runtime() if cuda else None
    pieces = plan(header)
    threads = max(1, min(threads or source.default_threads, len(pieces)))
    run = _Run(source, header, targets, pieces, lib, verify, progress)
    run.mapping = lib is not None and mapped > 0 and hasattr(source, "mapped")
    mappers = round(mapped * threads)
    allocated = time.perf_counter()
    with ThreadPoolExecutor(threads, thread_name_prefix="snapshot-load") as pool:
        futures = [pool.submit(run.work, device if cuda else None, w < mappers) for w in range(threads)]
        try:
            for f in futures:
                f.result()
        finally:
            run.stop.set()
    finished = time.perf_counter()
    phases = {"allocate": allocated - began, "stream": finished - allocated, **run.busy}
    report = LoadReport(header.data_size, finished - began, len(pieces), threads, source.direct_io, source.url,
                        str(device), phases, mapped_chunks=run.mapped_chunks)
    return dict(targets), report


class _Run:
    """One load's shared state; each worker thread runs `work` until the chunks run out."""

    def __init__(self, source, header: Header, targets: Mapping[str, torch.Tensor], pieces: list, lib, verify: bool,
                 progress: Progress | None):
        self.source, self.header, self.pieces, self.lib = source, header, pieces, lib
        self.verify, self.progress = verify, progress
        self.views = {name: byte_view(t) for name, t in targets.items()}
        self.addresses = {name: t.data_ptr() for name, t in targets.items()}
        self.mapping = False  # set by load; cleared by the first worker that cannot pin page-cache pages
        self.next_chunk, self.lock, self.stop = itertools.count(), threading.Lock(), threading.Event()
        self.done = self.mapped_chunks = 0
        self.busy = {"pin": 0.0, "read": 0.0, "verify": 0.0, "copy": 0.0, "register": 0.0}

    def work(self, device: torch.device | None, maps: bool) -> None:
        spent = dict.fromkeys(self.busy, 0.0)
        stream, buffers, registered = None, [], collections.deque()
        try:
            if device is not None:
                torch.cuda.set_device(device)  # the runtime's current device is per thread; the ctypes calls use it
                stream = torch.cuda.Stream(device)
            self.stream_chunks(stream, buffers, registered, spent, maps)
        except BaseException:
            self.stop.set()  # the other workers stop at their next chunk
            raise
        finally:
            if stream is not None:
                stream.synchronize()  # no copy may still read a buffer or a pinned page once it is let go
            t = time.perf_counter()
            for _, address in registered:
                cudart.unregister(self.lib, address)
            spent["register"] += time.perf_counter() - t
            buffers.clear()
            with self.lock:
                for k, dt in spent.items():
                    self.busy[k] += dt

    def stream_chunks(self, stream, buffers: list, registered: collections.deque, spent: dict, maps: bool) -> None:
        events: list = [None, None]
        for turn in itertools.count():
            with self.lock:
                index = next(self.next_chunk)
            if index >= len(self.pieces) or self.stop.is_set():
                break
            t = time.perf_counter()
            while registered and registered[0][0].query():  # unpin what the GPU has finished copying
                cudart.unregister(self.lib, registered.popleft()[1])
            span = self.source.mapped(index) if maps and self.mapping else None
            spent["register"] += time.perf_counter() - t
            if span is not None and self.copy_mapped(index, span, stream, registered, spent):
                n = len(span[1])
            else:
                if not buffers:  # allocated by the worker itself, so pinning overlaps the other workers' reads
                    t = time.perf_counter()
                    slab = aligned_buffer(2 * self.header.chunk_size, pin=stream is not None)
                    buffers += [slab[:self.header.chunk_size], slab[self.header.chunk_size:]]
                    spent["pin"] += time.perf_counter() - t
                slot = turn % 2
                if events[slot] is not None:
                    events[slot].synchronize()
                n = self.copy_buffered(index, buffers[slot], stream, spent)
                events[slot] = stream.record_event() if stream is not None else None
            with self.lock:
                self.done += n
                if self.progress:
                    self.progress(self.done, self.header.data_size)

    def check(self, index: int, data) -> None:
        if self.verify and checksum(data) != self.header.xxh3[index]:
            raise SnapshotCorrupt(self.source.id,
                                  f"chunk {index} (bytes {self.header.chunk_span(index)}) fails its checksum")

    def copy_buffered(self, index: int, buf: torch.Tensor, stream, spent: dict) -> int:
        t0 = time.perf_counter()
        n = self.source.read_chunk(index, memoryview(buf.numpy()))
        t1 = time.perf_counter()
        self.check(index, buf[:n].numpy())
        t2 = time.perf_counter()
        for name, a, b, at in self.pieces[index]:
            if self.lib is not None:
                cudart.copy_to_device(self.lib, self.addresses[name] + at, buf.data_ptr() + a, b - a, stream.cuda_stream)
            elif stream is not None:
                with torch.cuda.stream(stream):
                    self.views[name][at:at + b - a].copy_(buf[a:b], non_blocking=True)
            else:
                self.views[name][at:at + b - a].copy_(buf[a:b])
        t3 = time.perf_counter()
        for k, dt in zip(("read", "verify", "copy"), (t1 - t0, t2 - t1, t3 - t2)):
            spent[k] += dt
        return n

    def copy_mapped(self, index: int, span: tuple[int, memoryview], stream, registered: collections.deque,
                    spent: dict) -> bool:
        """Checks the chunk where it lies, pins its page-cache pages and queues the GPU's copies from them.
        False when the pages cannot be pinned; then no later chunk tries, the buffers take over."""
        address, data = span
        t0 = time.perf_counter()
        self.check(index, data)
        t1 = time.perf_counter()
        try:
            cudart.register(self.lib, address, len(data))
        except cudart.CudaError as err:
            self.mapping = False
            log.info("page-cache pages cannot be pinned here (%s); loading through pinned buffers", err)
            return False
        t2 = time.perf_counter()
        try:
            for name, a, b, at in self.pieces[index]:
                cudart.copy_to_device(self.lib, self.addresses[name] + at, address + a, b - a, stream.cuda_stream)
        finally:
            registered.append((stream.record_event(), address))  # unpinned once the copies are done, even failed ones
        t3 = time.perf_counter()
        for k, dt in zip(("verify", "register", "copy"), (t1 - t0, t2 - t1, t3 - t2)):
            spent[k] += dt
        with self.lock:
            self.mapped_chunks += 1
        return True


def audit(source, threads: int | None = None) -> None:
    """Checks every chunk against its sha256 (the digest the id is built on); raises SnapshotCorrupt."""
    header: Header = source.header

    def check(index: int) -> None:
        buf = aligned_buffer(header.chunk_size, pin=False)
        n = source.read_chunk(index, memoryview(buf.numpy()))
        if hashlib.sha256(buf[:n].numpy()).hexdigest() != header.chunks[index]:
            raise SnapshotCorrupt(source.id, f"chunk {index} (bytes {header.chunk_span(index)}) fails its sha256")

    with ThreadPoolExecutor(threads or source.default_threads, thread_name_prefix="snapshot-audit") as pool:
        list(pool.map(check, range(len(header.chunks))))
