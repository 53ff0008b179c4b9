"""Writes a snapshot file from tensors: a model's state dict, a safetensors file or a Hugging Face model dir."""
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from ember.snapshot.format import CHUNK_SIZE, Header, layout
from ember.snapshot.loader import Progress


def digest_chunks(path: str | os.PathLike, header: Header, threads: int = min(16, os.cpu_count() or 1)) -> Header:
    """Fills in both digests of every chunk, hashing chunks in parallel from the just-written (cached) file."""
    fd = os.open(path, os.O_RDONLY)

    def digest(index: int) -> tuple[str, str]:
        start, end = header.chunk_span(index)
        data = os.pread(fd, end - start, header.data_offset + start)
        return hashlib.sha256(data).hexdigest(), xxhash.xxh3_128_hexdigest(data)

    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="snapshot-digest") as pool:
            pairs = list(pool.map(digest, range(len(header.chunks))))
    finally:
        os.close(fd)
    return replace(header, chunks=tuple(p[0] for p in pairs), xxh3=tuple(p[1] for p in pairs))


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], tensors: Iterator[torch.Tensor], path: str | os.PathLike,
          chunk_size: int = CHUNK_SIZE, progress: Progress | None = None) -> Header:
    """Streams `tensors` (in the order of `specs`) into a snapshot at `path`; returns its header."""
    header = layout(specs, chunk_size)
    with open(path, "wb") as out:
        for entry, tensor in zip(header.tensors, tensors, strict=True):
            if tuple(tensor.shape) != entry.shape:
                raise ValueError(f"tensor {entry.name!r} has shape {tuple(tensor.shape)}, expected {entry.shape}")
            out.seek(header.data_offset + entry.offset)  # gaps read back as zeros
            out.write(raw_bytes(tensor))
            if progress:
                progress(entry.offset + entry.nbytes, header.data_size)
        out.truncate(header.file_size)
    # the header is written last, once the digests are known
    header = digest_chunks(path, header)
    with open(path, "r+b") as out:
        preamble = header.preamble()
        assert len(preamble) <= header.data_offset, "header outgrew its reserved space"
        out.seek(0)
        out.write(preamble)
    if progress:
        progress(header.data_size, header.data_size)
    return header


def write_state_dict(state: Mapping[str, torch.Tensor], path: str | os.PathLike, chunk_size: int = CHUNK_SIZE,
                     progress: Progress | None = None) -> Header:
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in state.items()]
    return write(specs, iter(state.values()), path, chunk_size, progress)


def safetensors_files(src: str | os.PathLike) -> list[Path]:
    """The weight files of a safetensors file or a Hugging Face model directory."""
    src = Path(src)
    if src.is_file():
        if src.suffix != ".safetensors":
            raise ValueError(f"{src} is not a .safetensors file; convert it first (safetensors.torch.save_file)")
        return [src]
    if not src.is_dir():
        raise FileNotFoundError(f"{src} does not exist; pass a .safetensors file or a Hugging Face model directory")
    index = src / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [src / n for n in names]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} holds no *.safetensors files; save the model with save_pretrained(safe_serialization=True)")
    return files


def write_safetensors(src: str | os.PathLike, path: str | os.PathLike, chunk_size: int = CHUNK_SIZE,
                      progress: Progress | None = None) -> Header:
    files = safetensors_files(src)
    specs = []
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise ValueError(f"{file}: tensor {name!r} has dtype {sl.get_dtype()}, which snapshots do not store")
                specs.append((name, getattr(torch, dtype), tuple(sl.get_shape())))

    def tensors() -> Iterator[torch.Tensor]:
        for file in files:
            with safe_open(file, "pt") as f:
                for name in f.keys():
                    yield f.get_tensor(name)

    return write(specs, tensors(), path, chunk_size, progress)


_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "C64": "complex64",
}
