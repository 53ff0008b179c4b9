"""Where snapshots live: a content-addressed directory in EMBER_HOME, or S3 (see s3.py).

Both stores answer the same calls, `SnapshotStore`: put, resolve, open, ls, rm, quarantine, and small blobs beside
the snapshots. An object is named by its id (the sha256 of its header); names are refs pointing at ids.
"""
import contextlib
import ctypes
import logging
import mmap
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ember.home import Home
from ember.snapshot.errors import SnapshotCorrupt, SnapshotError, SnapshotNotFound
from ember.snapshot.format import ALIGN, PREAMBLE, Header, decode, parse_preamble

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
PIECE = 1 << 20  # page-cache reads go in pieces this size, each checked while the CPU's cache holds it


@dataclass(frozen=True)
class SnapshotRef:
    id: str
    names: tuple[str, ...]
    size: int
    tensors: int
    created: float
    store: str
    problem: str | None = None  # why its header cannot be read (corrupt: `ember snapshot verify` quarantines it)

    def to_json(self) -> dict:
        return {"id": self.id, "names": list(self.names), "size": self.size, "tensors": self.tensors,
                "created": self.created, "store": self.store, "problem": self.problem}


class SnapshotSource(Protocol):
    """One snapshot opened for reading, chunk by chunk (FileSource, s3.S3Source): what the loader needs."""

    id: str
    url: str  # where it is read from, for reports
    header: Header
    direct_io: bool  # whether reads skip the page cache
    default_threads: int  # reader threads that saturate this kind of source

    def read_chunk(self, index: int, into: memoryview, each_piece: Callable[[memoryview], None] | None = None) -> int:
        """Read chunk `index` into `into`; the bytes read. `each_piece`, when given, is called with every piece of
        the chunk in order as soon as it is in `into` (all of it at once where the source reads it whole)."""
        ...

    def trusts(self, index: int) -> bool:
        """Whether chunk `index` may be read without its checksum: its bytes were checked since they last changed
        and are read from memory that held them since (a verified local file, from the page cache)."""
        ...

    def mark_verified(self) -> None:
        """Every chunk was just read and checked (or trusted): later reads from memory may trust them."""
        ...

    def close(self) -> None:
        ...


class SnapshotStore(Protocol):
    """Where snapshots live: `LocalStore` (EMBER_HOME) or `s3.S3Store`."""

    def put(self, path: str | os.PathLike, name: str | None = None, digested: bool = False) -> SnapshotRef:
        """Take the written snapshot file at `path` (moved or uploaded), named `name` if given; `digested`: its
        digests were computed from this file as written (a local store may then trust its page-cache reads)."""
        ...

    def resolve(self, key: str) -> str:
        """The id that `key` (a name, an id or a unique id prefix) points at."""
        ...

    def open(self, key: str) -> SnapshotSource:
        ...

    def ls(self) -> list[SnapshotRef]:
        ...

    def rm(self, key: str) -> SnapshotRef:
        ...

    def quarantine(self, snapshot_id: str, reason: str) -> str:
        """Move a corrupt snapshot aside, kept for inspection, and drop the names pointing at it; where it went."""
        ...

    def put_blob(self, name: str, data: bytes) -> None:
        ...

    def get_blob(self, name: str) -> bytes | None:
        ...


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise ValueError(f"snapshot name {name!r} is not allowed: use letters, digits, '.', '_' or '-' (at most 128)")
    return name


def staging_path() -> Path:
    """A fresh file path on local disk for a snapshot being written, beside the local store."""
    folder = Home().snapshots / "tmp"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{uuid.uuid4().hex}.partial"


def boot_id() -> str | None:
    """This boot of the machine (Linux); None where it is not known. A reboot empties the page cache."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def identity(fd: int) -> tuple[str, int] | None:
    """The open file's identity while its bytes are unchanged (the boot, device, inode, size, and modification and
    change times: any write, truncation or rename in place moves the change time, which no caller can set back),
    and the nanosecond of its last change; None where the boot is not known."""
    boot = boot_id()
    if boot is None:
        return None
    st = os.fstat(fd)
    return (f"{boot} {st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}",
            max(st.st_mtime_ns, st.st_ctime_ns))


# A file's times come from the kernel's coarse clock (one tick, 1-10 ms): a write within the tick of the last change
# would leave them as they were. So a mark is only taken of a file unchanged for longer than that before its bytes
# were checked; any later change then moves a time.
SETTLED_NS = 50_000_000


class VerifiedMarks:
    """Which local snapshot files had every chunk checked (by the writer's digests of the file it wrote, or by a
    full load) since they last changed, in this boot: `<folder>/<id>` holds the file's identity() then.

    A load trusts such a file's chunks that it reads from the page cache, skipping their checksums (a third of a
    warm load's time, and most of its hand-overs of the GIL: from the H200's page cache 37.7 against 25.9 GB/s in
    bench/results/snapshot_load.md). A chunk the page cache does not hold when the load comes to it is read from the
    disk and checked: that is where a byte can change with no write to the file (one the kernel read ahead into the
    cache meanwhile is trusted). EMBER_SNAPSHOT_VERIFY=always checks every chunk of every load."""

    def __init__(self, folder: Path):
        self.folder = folder

    def holds(self, snapshot_id: str, now: str | None) -> bool:
        if now is None or os.environ.get("EMBER_SNAPSHOT_VERIFY", "").strip().lower() == "always":
            return False
        try:
            return (self.folder / snapshot_id).read_text() == now
        except (OSError, ValueError):  # unreadable, or not text: no mark
            return False

    def mark(self, snapshot_id: str, now: str) -> None:
        """Best effort: a mark that cannot be written (a full or read-only disk) only means the next load checks."""
        tmp = self.folder / f".{snapshot_id}.{uuid.uuid4().hex}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(now)
            os.replace(tmp, self.folder / snapshot_id)
        except OSError as err:
            logging.getLogger("ember.snapshot").info("snapshot %s not marked verified: %s", snapshot_id, err)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def drop(self, snapshot_id: str) -> None:
        """Best effort too: a mark left behind matches no other file (a new file has another change time)."""
        with contextlib.suppress(OSError):
            (self.folder / snapshot_id).unlink(missing_ok=True)


def read_header(path: str | os.PathLike, snapshot_id: str | None = None) -> Header:
    path = Path(path)
    with open(path, "rb") as f:
        length = parse_preamble(f.read(PREAMBLE), snapshot_id or path.stem)
        if PREAMBLE + length > os.fstat(f.fileno()).st_size:
            raise SnapshotCorrupt(snapshot_id or path.stem, "truncated inside the header")
        raw = f.read(length)
    if len(raw) < length:
        raise SnapshotCorrupt(snapshot_id or path.stem, "truncated inside the header")
    return decode(raw, snapshot_id)


def pick(key: str, ids: list[str], where: str) -> str:
    """The one id that `key` names as an id or a unique id prefix."""
    found = [i for i in ids if i.startswith(key)] if len(key) >= 6 else []
    if len(found) > 1:
        raise SnapshotError(f"{key!r} matches {len(found)} snapshots in {where}; give more of the id")
    if not found:
        raise SnapshotNotFound(key, where)
    return found[0]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


class PageCache:
    """Which parts of a file the page cache holds: mincore() on a mapping that is never touched.

    Asking by a non-blocking read (RWF_NOWAIT) would start readahead of what is missing,
    which an O_DIRECT read of the same bytes would then duplicate.
    """

    def __init__(self, fd: int, size: int):
        self.size = size
        self.addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0) if size else None
        if self.addr in (None, ctypes.c_void_p(-1).value):
            self.addr = None

    def holds(self, offset: int, length: int) -> bool:
        if self.addr is None:
            return False
        start = offset - offset % mmap.PAGESIZE
        pages = -(-(offset + length - start) // mmap.PAGESIZE)
        vec = np.zeros(pages, dtype=np.uint8)
        if _libc.mincore(self.addr + start, pages * mmap.PAGESIZE, vec.ctypes.data) != 0:
            return False
        return bool((vec & 1).all())

    def close(self) -> None:
        if self.addr is not None:
            _libc.munmap(self.addr, self.size)
            self.addr = None


class FileSource:
    """Reads one snapshot file chunk by chunk: from the page cache when it holds the chunk, else with O_DIRECT.

    O_DIRECT skips the page cache's extra copy on a cold read, where the filesystem allows
    it (tmpfs does not); a chunk already cached is read from the cache.
    """

    # Warm loads on the 16-core GPU machine peaked at 12 threads (29 GB/s; 27 at 16, 25.5 at 8):
    # beyond that the threads contend for memory bandwidth and the GIL (bench/results/snapshot_warm_paths.md).
    default_threads = max(1, min(12, (os.cpu_count() or 1) * 3 // 4))

    def __init__(self, path: Path, snapshot_id: str, direct: bool = True, marks: VerifiedMarks | None = None):
        self.path, self.id, self.url = path, snapshot_id, str(path)
        self.header = read_header(path, snapshot_id)
        size = path.stat().st_size
        if size < self.header.file_size:
            raise SnapshotCorrupt(snapshot_id, f"truncated: {size} of {self.header.file_size} bytes")
        self.fd = os.open(path, os.O_RDONLY)
        self.direct_fd = self._open_direct() if direct else None
        self.direct_io = self.direct_fd is not None
        self.cache = PageCache(self.fd, size)
        self.marks = marks
        self.opened_ns, self.opened = time.time_ns(), identity(self.fd)
        self.verified = marks is not None and marks.holds(snapshot_id, self.opened and self.opened[0])

    def _open_direct(self) -> int | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        except (OSError, AttributeError):
            return None
        probe = mmap.mmap(-1, ALIGN)  # page-aligned, as O_DIRECT wants
        try:
            os.preadv(fd, [probe], self.header.data_offset)
            return fd
        except OSError:  # e.g. tmpfs refuses O_DIRECT reads
            os.close(fd)
            return None
        finally:
            probe.close()

    def read_chunk(self, index: int, into: memoryview, each_piece: Callable[[memoryview], None] | None = None) -> int:
        start, end = self.header.chunk_span(index)
        want, done, at = end - start, 0, self.header.data_offset + start
        cached = self.direct_fd is None or self.cache.holds(at, want)
        fd = self.fd if cached or self.direct_fd is None else self.direct_fd
        # From the page cache, a piece is read and handed on while it is still in the CPU's cache (a checksum of a
        # whole chunk read back from memory cost as much again as the read); from the disk, the chunk in one read.
        step = PIECE if cached and each_piece is not None else want
        while done < want:
            stop = min(done + step, want)
            got = os.preadv(fd, [into[done:stop]], at + done)
            if got == 0:
                raise SnapshotCorrupt(self.id, f"truncated in chunk {index}")
            if each_piece is not None:
                each_piece(into[done:done + got])
            done += got
        return want

    def trusts(self, index: int) -> bool:
        if not self.verified:
            return False
        start, end = self.header.chunk_span(index)
        return self.cache.holds(self.header.data_offset + start, end - start)

    def mark_verified(self) -> None:
        """Marks the file when it is what was opened and had settled before the load read it."""
        if self.marks is None or self.verified or self.opened is None:
            return
        if identity(self.fd) == self.opened and self.opened[1] < self.opened_ns - SETTLED_NS:
            self.marks.mark(self.id, self.opened[0])
            self.verified = True

    def close(self) -> None:
        self.cache.close()
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)


class LocalStore:
    """$EMBER_HOME/snapshots/{objects/<id>.ember, refs/<name>, quarantine/<id>.ember, blobs/<name>}."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root else Home().snapshots
        self.url = "local"
        self.objects, self.refs, self.quarantined, self.blobs = (
            self.root / d for d in ("objects", "refs", "quarantine", "blobs"))
        for d in (self.objects, self.refs, self.quarantined, self.blobs):
            d.mkdir(parents=True, exist_ok=True)
        self.marks = VerifiedMarks(self.root / "verified")

    def put_blob(self, name: str, data: bytes) -> None:
        """Keeps a small file beside the snapshots (a GPU memory image, compiled kernels) under `name`."""
        target = self.blobs / check_name(name)
        tmp = target.with_name(f".{name}.{uuid.uuid4().hex}")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    def get_blob(self, name: str) -> bytes | None:
        try:
            return (self.blobs / check_name(name)).read_bytes()
        except FileNotFoundError:
            return None

    def _object(self, snapshot_id: str) -> Path:
        return self.objects / f"{snapshot_id}.ember"

    def _names(self) -> dict[str, str]:
        return {p.name: p.read_text().strip() for p in self.refs.iterdir() if not p.name.startswith(".")}

    def put(self, path: str | os.PathLike, name: str | None = None, digested: bool = False) -> SnapshotRef:
        """Takes ownership of a written snapshot file and files it under its id (and `name`). `digested`: its
        chunks' digests were computed from this very file (writer.write), so its page-cache bytes are verified."""
        if name:
            check_name(name)
        header = read_header(Path(path))
        written = os.stat(path)
        self.marks.drop(header.id)
        shutil.move(path, self._object(header.id))
        if digested:
            self._mark_written(header.id, written)
        if name:
            ref = self.refs / name
            tmp = ref.with_name(f".{name}.{uuid.uuid4().hex}")
            tmp.write_text(header.id)
            os.replace(tmp, ref)
        return self._ref(header.id)

    def _mark_written(self, snapshot_id: str, written: os.stat_result) -> None:
        """Marks a file whose digests the writer computed from its bytes, once the file has settled (SETTLED_NS)."""
        fd = os.open(self._object(snapshot_id), os.O_RDONLY)
        try:
            filed = os.fstat(fd)
            if (filed.st_dev, filed.st_ino) != (written.st_dev, written.st_ino):  # copied across filesystems
                return
            now = identity(fd)
            if now is None:
                return
            time.sleep(max(0, now[1] + SETTLED_NS - time.time_ns()) / 1e9)
            if identity(fd) == now:
                self.marks.mark(snapshot_id, now[0])
        finally:
            os.close(fd)

    def resolve(self, key: str) -> str:
        names = self._names()
        if key in names and self._object(names[key]).exists():
            return names[key]
        return pick(key, [p.stem for p in self.objects.glob("*.ember")], f"local store {self.root}")

    def open(self, key: str) -> FileSource:
        snapshot_id = self.resolve(key)
        return FileSource(self._object(snapshot_id), snapshot_id, marks=self.marks)

    def _ref(self, snapshot_id: str) -> SnapshotRef:
        path = self._object(snapshot_id)
        tensors, problem = -1, None
        try:
            tensors = len(read_header(path).tensors)
        except SnapshotCorrupt as err:
            problem = err.reason
        except SnapshotError as err:
            problem = str(err)
        names = tuple(sorted(n for n, i in self._names().items() if i == snapshot_id))
        st = path.stat()
        return SnapshotRef(snapshot_id, names, st.st_size, tensors, st.st_mtime, self.url, problem)

    def ls(self) -> list[SnapshotRef]:
        return sorted((self._ref(p.stem) for p in self.objects.glob("*.ember")), key=lambda r: r.created)

    def rm(self, key: str) -> SnapshotRef:
        ref = self._ref(self.resolve(key))
        for name in ref.names:
            (self.refs / name).unlink(missing_ok=True)
        self.marks.drop(ref.id)
        self._object(ref.id).unlink()
        return ref

    def quarantine(self, snapshot_id: str, reason: str) -> str:
        """Moves a corrupt snapshot aside (kept for inspection) and drops the names pointing at it."""
        for name, target in self._names().items():
            if target == snapshot_id:
                (self.refs / name).unlink(missing_ok=True)
        self.marks.drop(snapshot_id)
        dest = self.quarantined / f"{snapshot_id}.{int(time.time())}.ember"
        if self._object(snapshot_id).exists():
            os.replace(self._object(snapshot_id), dest)
        dest.with_suffix(".reason").write_text(reason + "\n")
        return str(dest)


def open_store(spec: str | None = None) -> SnapshotStore:
    """`local` (or None) for the EMBER_HOME store, `s3://bucket/prefix` for S3."""
    if spec in (None, "", "local"):
        return LocalStore()
    if spec.startswith("s3://"):
        from ember.snapshot.s3 import S3Store  # boto3 only where S3 is used
        bucket, _, prefix = spec.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"store {spec!r} names no bucket; write s3://BUCKET/PREFIX")
        return S3Store(bucket, prefix)
    raise ValueError(f"unknown store {spec!r}; use 'local' or 's3://bucket/prefix'")
