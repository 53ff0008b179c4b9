"""The snapshot file: a JSON header, then tensor data aligned for direct I/O, checksummed per chunk.

    [8 B magic "EMBERSN1"][8 B header length, little endian][header JSON][zero pad to 4 KiB]
    [data region: each tensor at a 4 KiB-aligned offset; the region is padded to 4 KiB]

The data region is cut into fixed-size chunks (a multiple of 4 KiB) and the header lists two
digests of each: sha256, which the snapshot's id is built on (the id is the sha256 of the
header bytes, so it addresses the content) and which `ember snapshot verify` checks, and
xxh3-128, which the loader checks on every chunk it reads before the bytes reach a model:
sha256 runs at ~1.2 GB/s a core on the GPU machine, too slow for a 25 GB/s load; xxh3 at
>10 GB/s a core, and 128 bits catch any flipped byte or torn write.
"""
import hashlib
import json
import struct
from dataclasses import dataclass

import torch

from ember.snapshot.errors import SnapshotCorrupt

MAGIC = b"EMBERSN1"
PREAMBLE = 16
# A header lists ~100 bytes of digests per 8 MiB chunk plus a line per tensor: 64 MiB covers a 5 TB snapshot.
# A length field past it is corruption, refused before anything is allocated for it.
MAX_HEADER = 64 << 20
ALIGN = 4096
CHUNK_SIZE = 8 << 20

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
)}


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the start of the data region
    nbytes: int


@dataclass(frozen=True)
class Header:
    tensors: tuple[TensorEntry, ...]
    chunk_size: int
    data_offset: int  # from the start of the file
    data_size: int
    chunks: tuple[str, ...]  # sha256 hex of each chunk of the data region
    xxh3: tuple[str, ...]  # xxh3-128 hex of each chunk, checked on every load

    @property
    def file_size(self) -> int:
        return self.data_offset + self.data_size

    def chunk_span(self, index: int) -> tuple[int, int]:
        """Byte range [start, end) of one chunk within the data region."""
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.data_size)

    def encode(self) -> bytes:
        body = {
            "version": 1, "chunk_size": self.chunk_size, "data_offset": self.data_offset,
            "data_size": self.data_size, "chunks": list(self.chunks), "xxh3": list(self.xxh3),
            "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors],
        }
        return json.dumps(body, separators=(",", ":")).encode()

    def preamble(self) -> bytes:
        raw = self.encode()
        return MAGIC + struct.pack("<Q", len(raw)) + raw

    @property
    def id(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()


def layout(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], chunk_size: int = CHUNK_SIZE) -> Header:
    """Places tensors in the data region; chunk hashes are left blank for the writer to fill."""
    if chunk_size % ALIGN:
        raise ValueError(f"chunk_size must be a multiple of {ALIGN}, got {chunk_size}")
    entries, offset = [], 0
    for name, dtype, shape in specs:
        key = str(dtype).removeprefix("torch.")
        if key not in DTYPES:
            raise ValueError(
                f"tensor {name!r} has dtype {dtype}, which snapshots do not store; supported: {sorted(DTYPES)}"
            )
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        entries.append(TensorEntry(name, key, tuple(shape), offset, nbytes))
        offset = align(offset + nbytes)
    data_size = align(offset)
    count = -(-data_size // chunk_size)
    blank, blank_fast = ("0" * 64,) * count, ("0" * 32,) * count
    probe = Header(tuple(entries), chunk_size, 0, data_size, blank, blank_fast)
    # Hashes are fixed-width hex, so the header's length is known before they are; +20 leaves
    # room for the digits of data_offset itself.
    data_offset = align(PREAMBLE + len(probe.encode()) + 20)
    return Header(tuple(entries), chunk_size, data_offset, data_size, blank, blank_fast)


def parse_preamble(head: bytes, snapshot_id: str) -> int:
    """Length of the header JSON that follows the 16-byte preamble (at most MAX_HEADER)."""
    if len(head) < PREAMBLE or head[:8] != MAGIC:
        raise SnapshotCorrupt(snapshot_id, "bad magic: not an Ember snapshot or truncated")
    length = struct.unpack("<Q", head[8:PREAMBLE])[0]
    if length > MAX_HEADER:
        raise SnapshotCorrupt(snapshot_id, f"header length field says {length} bytes, over the {MAX_HEADER} byte limit")
    return length


def decode(raw: bytes, snapshot_id: str | None = None) -> Header:
    """Parses header bytes; when an id is given, the bytes must hash to it."""
    if snapshot_id is not None and hashlib.sha256(raw).hexdigest() != snapshot_id:
        raise SnapshotCorrupt(snapshot_id, "header does not match its id")
    try:
        body = json.loads(raw)
        tensors = tuple(TensorEntry(n, d, tuple(s), o, b) for n, d, s, o, b in body["tensors"])
        header = Header(tensors, body["chunk_size"], body["data_offset"], body["data_size"], tuple(body["chunks"]),
                        tuple(body["xxh3"]))
    except (ValueError, KeyError, TypeError) as err:
        raise SnapshotCorrupt(snapshot_id or "?", f"unreadable header: {err}") from None
    if not len(header.chunks) == len(header.xxh3) == -(-header.data_size // header.chunk_size):
        raise SnapshotCorrupt(snapshot_id or "?", "header lists the wrong number of chunk digests")
    return header
