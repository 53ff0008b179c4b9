"""Loads a snapshot at the speed of its slowest link: storage, checksum, PCIe.

Each worker thread owns two chunk buffers (pinned when the target is a GPU, allocated by the
worker itself so pinning overlaps the other workers' reads) and one CUDA stream. It reads a
chunk into one buffer (page cache or O_DIRECT from disk, or a ranged GET from S3), checks
the chunk's xxh3-128 (piece by piece as a page-cache read brings each 1 MiB in, while the
CPU's cache still holds it; after the read elsewhere), and queues its host->device copies
straight into the target tensors, then reads the next chunk into its other buffer while
those copies run. A buffer is reused only once the copies out of it have finished.

Buffers are huge-page backed and pinned in place (hostbuffer.py); the checksum runs in
xxhash's update(), which lets go of the GIL, and copies are queued through ctypes
(cudart.py), so the threads spend their time in the kernel's read and the hash, not in Python.

A chunk is copied only after its checksum passed, so the targets never receive a corrupt
byte; but when a later chunk fails, earlier tensors are already written: the caller must
treat the targets as garbage (restore_into's contract) and boot from scratch.
"""
import bisect
import contextlib
import hashlib
import itertools
import logging
import os
import sys
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
from ember.snapshot.hostbuffer import HostBuffer
from ember.snapshot.store import SnapshotSource

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
log = logging.getLogger(__name__)

# While a load runs, a thread that holds the GIL is asked to hand it over after this long (Python's default: 5 ms).
# Each chunk's reader takes the GIL back a few times (after each read, checksum and copy call); behind a thread
# running Python (an engine warming its kernels beside the load, as a replica's start does) each of those waited
# up to the full interval. A 1 GiB page-cache load with 2 threads beside a busy Python thread on the 2-core CI
# machine: 1.38 s at 5 ms, 0.81 s at 1 ms, 0.30 s with no busy thread.
LOAD_SWITCH_INTERVAL = 0.001
_switching = threading.Lock()
_loads = 0
_interval_before = 0.0


@contextlib.contextmanager
def quick_gil_handoffs():
    """Lowers the interpreter's switch interval to LOAD_SWITCH_INTERVAL while any load of this process runs."""
    global _loads, _interval_before
    with _switching:
        if _loads == 0:
            _interval_before = sys.getswitchinterval()
            sys.setswitchinterval(min(_interval_before, LOAD_SWITCH_INTERVAL))
        _loads += 1
    try:
        yield
    finally:
        with _switching:
            _loads -= 1
            if _loads == 0:
                sys.setswitchinterval(_interval_before)


@dataclass
class LoadReport:
    bytes: int
    seconds: float
    chunks: int
    threads: int
    direct_io: bool
    source: str
    device: str
    # wall seconds for allocate / stream; summed thread seconds for pin / read (with the checksum, which runs on
    # each piece as it arrives) / verify (comparing the digests) / copy
    phases: dict[str, float] = field(default_factory=dict)
    trusted: int = 0  # chunks read with no checksum: verified since their file last changed, and in the page cache

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def __str__(self) -> str:
        parts = " ".join(f"{k}={v:.3f}s" for k, v in self.phases.items())
        return (f"{self.bytes / 1e9:.2f} GB in {self.seconds:.3f} s = {self.gbps:.1f} GB/s from {self.source} "
                f"({self.threads} threads, direct_io={self.direct_io}, {self.trusted} of {self.chunks} chunks "
                f"trusted; {parts})")


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
    """4 KiB-aligned host memory from torch, as O_DIRECT wants. Pinned memory is page-aligned already,
    and asking for more would make the pinned allocator round up to the next power of two."""
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


def host_buffer(nbytes: int, pin: bool, lib) -> tuple[torch.Tensor, Callable[[], None]]:
    """A worker's buffer and how to free it: huge pages (pinned through `lib` when `pin`), else torch's memory."""
    if lib is not None or not pin:
        try:
            buf = HostBuffer(nbytes, lib if pin else None)
            return buf.tensor, buf.close
        except (MemoryError, cudart.CudaError) as err:
            log.info("huge-page load buffer unavailable (%s); using torch's", err)
    return aligned_buffer(nbytes, pin), lambda: None


def env_threads() -> int | None:
    """EMBER_SNAPSHOT_THREADS: reader threads per load, in place of the source's default (a node with more or
    fewer cores free than the default assumes)."""
    value = os.environ.get("EMBER_SNAPSHOT_THREADS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"EMBER_SNAPSHOT_THREADS={value!r}: give a whole number of threads, 1 or more")
    return int(value)


def load(source: SnapshotSource, targets: Mapping[str, torch.Tensor] | None = None, device: str | torch.device = "cpu",
         threads: int | None = None, progress: Progress | None = None,
         verify: bool = True) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Reads every tensor of `source` into `targets` (allocated on `device` when None).

    Raises SnapshotCorrupt when a chunk fails its checksum, SnapshotMismatch when targets
    do not match the snapshot (before any byte is copied). `verify=False` skips the
    checksums: only for bytes already verified once (the benchmark uses it to show their cost).
    """
    began = time.perf_counter()
    header: Header = source.header
    if targets is None:
        targets = {e.name: torch.empty(e.shape, dtype=DTYPES[e.dtype], device=device) for e in header.tensors}
    else:
        check_targets(header, targets)
    device = next(iter(targets.values())).device if targets else torch.device(device)
    cuda = device.type == "cuda"
    pieces = plan(header)
    threads = max(1, min(threads or env_threads() or source.default_threads, len(pieces)))
    run = _Run(source, header, targets, pieces, cudart.runtime() if cuda else None, verify, progress)
    allocated = time.perf_counter()
    with quick_gil_handoffs(), ThreadPoolExecutor(threads, thread_name_prefix="snapshot-load") as pool:
        futures = [pool.submit(run.work, device if cuda else None) for _ in range(threads)]
        try:
            for f in futures:
                f.result()
        finally:
            run.stop.set()
    if verify:
        source.mark_verified()  # every chunk passed its checksum or was trusted
    finished = time.perf_counter()
    phases = {"allocate": allocated - began, "stream": finished - allocated, **run.busy}
    report = LoadReport(header.data_size, finished - began, len(pieces), threads, source.direct_io, source.url,
                        str(device), phases, run.trusted)
    return dict(targets), report


class _Run:
    """One load's shared state; each worker thread runs `work` until the chunks run out."""

    def __init__(self, source, header: Header, targets: Mapping[str, torch.Tensor], pieces: list, lib, verify: bool,
                 progress: Progress | None):
        self.source, self.header, self.pieces, self.lib = source, header, pieces, lib
        self.verify, self.progress = verify, progress
        self.views = {name: byte_view(t) for name, t in targets.items()}
        self.addresses = {name: t.data_ptr() for name, t in targets.items()}
        self.next_chunk, self.lock, self.stop = itertools.count(), threading.Lock(), threading.Event()
        self.done = self.trusted = 0
        self.busy = {"pin": 0.0, "read": 0.0, "verify": 0.0, "copy": 0.0}

    def work(self, device: torch.device | None) -> None:
        spent = dict.fromkeys(self.busy, 0.0)
        stream = None
        held: list[tuple[torch.Tensor, Callable[[], None]]] = []  # this worker's buffer and how to free it
        try:
            if device is not None:
                torch.cuda.set_device(device)  # the runtime's current device is per thread; the ctypes calls use it
                stream = torch.cuda.Stream(device)
            self.stream_chunks(stream, held, spent)
        except BaseException:
            self.stop.set()  # the other workers stop at their next chunk
            raise
        finally:
            if stream is not None:
                stream.synchronize()  # no copy may still read a buffer once it is freed
            for _, free in held:
                free()
            with self.lock:
                for k, dt in spent.items():
                    self.busy[k] += dt

    def stream_chunks(self, stream, held: list[tuple[torch.Tensor, Callable[[], None]]], spent: dict) -> None:
        events: list = [None, None]
        for turn in itertools.count():
            with self.lock:
                index = next(self.next_chunk)
            if index >= len(self.pieces) or self.stop.is_set():
                break
            if not held:  # allocated by the worker itself, so pinning overlaps the other workers' reads
                t = time.perf_counter()
                held.append(host_buffer(2 * self.header.chunk_size, stream is not None, self.lib))
                spent["pin"] += time.perf_counter() - t
            slot = turn % 2
            if events[slot] is not None:
                events[slot].synchronize()
            size = self.header.chunk_size
            n = self.copy(index, held[0][0][slot * size:(slot + 1) * size], stream, spent)
            events[slot] = stream.record_event() if stream is not None else None
            with self.lock:
                self.done += n
                if self.progress:
                    self.progress(self.done, self.header.data_size)

    def copy(self, index: int, buf: torch.Tensor, stream, spent: dict) -> int:
        """Reads chunk `index` into `buf`, checks it, and queues its copies into the targets."""
        t0 = time.perf_counter()
        trusted = self.verify and self.source.trusts(index)
        if trusted:
            with self.lock:
                self.trusted += 1
        # The checksum runs on each piece as it arrives (update() lets go of the GIL, xxh3_128_hexdigest() not).
        hasher = xxhash.xxh3_128() if self.verify and not trusted else None
        n = self.source.read_chunk(index, buf.numpy().data, hasher.update if hasher is not None else None)
        t1 = time.perf_counter()
        if hasher is not None and hasher.hexdigest() != self.header.xxh3[index]:
            raise SnapshotCorrupt(self.source.id,
                                  f"chunk {index} (bytes {self.header.chunk_span(index)}) fails its checksum")
        t2 = time.perf_counter()
        for name, a, b, at in self.pieces[index]:
            if self.lib is not None:
                cudart.copy_to_device(
                    self.lib, self.addresses[name] + at, buf.data_ptr() + a, b - a, stream.cuda_stream
                )
            elif stream is not None:
                with torch.cuda.stream(stream):
                    self.views[name][at:at + b - a].copy_(buf[a:b], non_blocking=True)
            else:
                self.views[name][at:at + b - a].copy_(buf[a:b])
        t3 = time.perf_counter()
        for k, dt in zip(("read", "verify", "copy"), (t1 - t0, t2 - t1, t3 - t2)):
            spent[k] += dt
        return n


def audit(source, threads: int | None = None) -> None:
    """Checks every chunk against its sha256 (the digest the id is built on); raises SnapshotCorrupt."""
    header: Header = source.header

    def check(index: int) -> None:
        buf = aligned_buffer(header.chunk_size, pin=False)
        n = source.read_chunk(index, buf.numpy().data)
        if hashlib.sha256(buf[:n].numpy().data).hexdigest() != header.chunks[index]:
            raise SnapshotCorrupt(source.id, f"chunk {index} (bytes {header.chunk_span(index)}) fails its sha256")

    with ThreadPoolExecutor(threads or source.default_threads, thread_name_prefix="snapshot-audit") as pool:
        list(pool.map(check, range(len(header.chunks))))
