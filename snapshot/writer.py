"""Writes a snapshot file from tensors: a model's state dict, a safetensors file or a Hugging Face model dir."""
import contextlib
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
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def write(
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors: Iterator[torch.Tensor],
    path: str | os.PathLike,
    chunk_size: int = CHUNK_SIZE,
    progress: Progress | None = None,
) -> Header:
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
        raise ValueError(
            f"{src} holds no *.safetensors files; save the model with save_pretrained(safe_serialization=True)"
        )
    return files


# The projections the LLM engine runs as one product (runtime/engine/models/llama.py, MergedLinear): merged name ->
# Hugging Face's parts, whose rows it stacks in this order. A snapshot in the engine's layout stores them merged.
MERGED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def engine_layout(names: list[str]) -> list[tuple[str, list[str]]]:
    """(snapshot name, source names) in the checkpoint's order; the parts of a merged projection become one entry
    where its first part was. A projection with a part missing stays as it is."""
    present = set(names)
    groups: dict[str, list[str]] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        for merged, parts in MERGED_PROJECTIONS.items():
            sources = [f"{parent}.{part}.{leaf}" for part in parts]
            if proj in parts and all(source in present for source in sources):
                groups.setdefault(f"{parent}.{merged}.{leaf}", sources)
                break
        else:
            groups[name] = [name]
    return list(groups.items())


def write_safetensors(src: str | os.PathLike, path: str | os.PathLike, chunk_size: int = CHUNK_SIZE,
                      progress: Progress | None = None, merge_projections: bool = False) -> Header:
    """`merge_projections`: store the engine's layout (MERGED_PROJECTIONS) instead of the files' own."""
    files = safetensors_files(src)
    where, meta = {}, {}   # tensor name -> its file, (its dtype, its shape)
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():
                where[name], meta[name] = file, (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape())
    entries = engine_layout(list(where)) if merge_projections else [(name, [name]) for name in where]
    specs = []
    for name, sources in entries:
        stored, shape = meta[sources[0]]
        dtype = _SAFETENSORS_DTYPES.get(stored)
        if dtype is None:
            raise ValueError(f"{where[sources[0]]}: tensor {sources[0]!r} has dtype {stored}, which snapshots do "
                             "not store")
        if len(sources) > 1:   # the parts' rows stacked
            shape = [sum(meta[s][1][0] for s in sources), *shape[1:]]
        specs.append((name, getattr(torch, dtype), tuple(shape)))

    def tensors() -> Iterator[torch.Tensor]:
        with contextlib.ExitStack() as stack:
            opened = {file: stack.enter_context(safe_open(file, "pt")) for file in files}
            for _, sources in entries:
                parts = [opened[where[s]].get_tensor(s) for s in sources]
                yield parts[0] if len(parts) == 1 else torch.cat(parts)

    return write(specs, tensors(), path, chunk_size, progress)


_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "C64": "complex64",
}
