"""Build a model from a Hugging Face directory: config.json picks the architecture, safetensors fill the weights.

With a snapshot store (EngineConfig.snapshot_store), the weights come from the snapshot of this
model in this dtype when the store holds a sound one, restored straight into the preallocated
parameters; otherwise from the safetensors, after which the snapshot is written for the next start.
A corrupt snapshot is quarantined by the snapshot library and the model is built again from scratch.

The snapshot's name is a content identity, so it means the same weights on every node:
sha256 over the engine's tensor layout version, the dtype and, per weight file, its name, size,
safetensors header (every tensor's name, dtype, shape and offsets) and an xxh3 of SAMPLES
windows spread over its data. The samples keep the key cheap on a 100 GB model (a few MiB read
per file); they catch a retrained or re-converted checkpoint, since those change every window,
but not an edit confined to bytes between windows. Paths and mtimes are left out on purpose:
a copy of the same model elsewhere restores the same snapshot. The directory's name (the name the
engine serves the model under) prefixes the digest so that `ember snapshot ls` is readable.
"""
import copy
import hashlib
import logging
import os
import re
import struct
import time
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig

from ember.snapshot import WeightsStart, open_store, restore_or_boot
from ember.snapshot.writer import MERGED_PROJECTIONS

from .. import fp8
from ..gpu_memory import Arena, tensor_bytes
from .llama import LlamaForCausalLM, MergedLinear
from .qwen3 import Qwen3ForCausalLM

logger = logging.getLogger(__name__)

ARCHITECTURES = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}
LAYOUT_VERSION = 2  # bump when the model classes change parameter names, shapes or fusing (2: merged projections)
SAMPLES, WINDOW = 16, 256 << 10
WEIGHTS = "weights"  # the arena region that holds the parameters

last_start: WeightsStart | None = None  # this process's latest load; the worker adds it to the start breakdown


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, snapshot_store: str | None = None,
               arena: Arena | None = None, quantization: str | None = None):
    """(model, hf_config, WeightsStart); with `snapshot_store`, restore from or write a snapshot. With `arena`,
    the parameters live in its "weights" region (which a park can release and a wake restore). `quantization`
    "fp8": the decoder's product weights quantized as they load (fp8.py); a snapshot holds them quantized."""
    global last_start
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{model_dir!r} has no config.json: pass a Hugging Face model directory")
    config = model_config(path)
    cls = ARCHITECTURES.get(config.model_type)
    if cls is None:
        raise ValueError(f"model_type {config.model_type!r} is not supported: use one of {sorted(ARCHITECTURES)}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir!r} has no *.safetensors weights")

    def make_model():
        return empty_model(cls, config, dtype, device, arena, quantization)

    def load_weights(model):
        load_safetensors(model, files, model_dir, config.tie_word_embeddings)

    began = time.perf_counter()
    if snapshot_store is None:
        model = make_model()
        load_weights(model)
        start, snapshot = WeightsStart("full", time.perf_counter() - began), "none"
    else:
        key = snapshot_key(path, dtype, quantization)
        model, start = restore_or_boot(make_model, load_weights, open_store(snapshot_store), key)
        snapshot = f"{key} in {snapshot_store}"
    log_start(path.name, model, start, snapshot)
    last_start = start
    return model.eval(), config, start


def empty_model(cls, config, dtype: torch.dtype, device: torch.device, arena: Arena | None = None,
                quantization: str | None = None):
    """The model with its parameters allocated on `device` in `dtype` (in `arena`'s "weights" region when given,
    replacing an earlier one), uninitialised; with `quantization` "fp8", its products' weights FP8 and their scales
    fp32."""
    with torch.device("meta"), SkipInit():
        model = cls(config)
        if quantization == "fp8":
            model.quantize_fp8()
    metas = list(dict.fromkeys(model.parameters()))  # a shared parameter (the tied head) is allocated once
    scales = {p for name, p in model.named_parameters() if name.endswith(".weight_scale")}
    dtypes = {meta: meta.dtype if meta.dtype == fp8.FP8 or meta in scales else dtype for meta in metas}
    if arena is None:
        def allocate(meta):
            return torch.empty(meta.shape, dtype=dtypes[meta], device=device)
    else:
        arena.free(WEIGHTS)
        region = arena.region(WEIGHTS, tensor_bytes((m.shape, dtypes[m]) for m in metas), keep=True)

        def allocate(meta):
            return region.take(meta.shape, dtypes[meta])
    # Allocated here rather than by to_empty(), whose meta path imports torch.fx's symbolic shapes (0.3 s).
    allocated = {meta: torch.nn.Parameter(allocate(meta), requires_grad=meta.requires_grad) for meta in metas}
    for module in model.modules():
        for name, meta in module.named_parameters(recurse=False):
            setattr(module, name, allocated[meta])
    if config.tie_word_embeddings:
        # The head is the embedding's tensor: a snapshot holds it once and restores into the shared tensor.
        model.register_state_dict_post_hook(without_tied_head)
    return model


class SkipInit(TorchFunctionMode):
    """Turns torch.nn.init calls into no-ops while a model is built: its weights are overwritten next,
    and initialising an embedding on the meta device imports torch._dynamo (1.4 s of a cold start here)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def without_tied_head(module, state, prefix, local_metadata) -> None:
    del state[prefix + "lm_head.weight"]


def load_safetensors(model, files: list[Path], model_dir: str, tied: bool) -> None:
    targets = weight_targets(model)
    missing = set(targets)
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in targets:
                    continue
                param, rows, scale = targets[name]
                if scale is None:
                    param.data[rows].copy_(f.get_tensor(name))
                else:   # an FP8 weight: quantized on its device, a scale per row
                    weight, row_scales = fp8.quantize_rows(f.get_tensor(name).to(param.device))
                    param.data[rows].copy_(weight)
                    scale.data[rows].copy_(row_scales)
                missing.discard(name)
    if tied:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"weights missing from {model_dir!r}: {sorted(missing)[:5]}")


def weight_targets(model) -> dict[str, tuple[torch.nn.Parameter, slice, torch.nn.Parameter | None]]:
    """Each Hugging Face tensor name -> the parameter and rows it fills, and for an FP8 weight the scales of those
    rows (filled as it is quantized): a merged projection (MergedLinear) takes its parts' tensors (q_proj, k_proj,
    v_proj into qkv_proj) in the rows of each."""
    targets = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, leaf = name.rpartition(".")
        if leaf == "weight_scale":
            continue
        module = model.get_submodule(module_name)
        scale = getattr(module, "weight_scale", None) if leaf == "weight" else None
        if not isinstance(module, MergedLinear):
            targets[name] = (param, slice(None), scale)
            continue
        parent, _, merged = module_name.rpartition(".")
        for index, part in enumerate(MERGED_PROJECTIONS[merged]):
            targets[f"{parent}.{part}.{leaf}"] = (param, module.shard_rows(index), scale)
    return targets


def snapshot_key(model_dir: str | Path, dtype: torch.dtype, quantization: str | None = None) -> str:
    """`<model dir name>.<dtype>[-<quantization>].<content digest>`: the snapshot name the engine restores from and
    writes (a quantized model's snapshot holds its quantized weights).

    `ember snapshot build MODEL_DIR --name <this>` prepares one ahead of the first start, when the
    safetensors already hold the engine's dtype.
    """
    model_dir = Path(model_dir).resolve()
    quantized = f" quantization={quantization}" if quantization else ""
    digest = hashlib.sha256(f"layout={LAYOUT_VERSION} dtype={dtype}{quantized}".encode())
    for file in sorted(model_dir.glob("*.safetensors")):
        digest.update(file_identity(file))
    dtype_name = str(dtype).removeprefix("torch.") + (f"-{quantization}" if quantization else "")
    name = re.sub(r"[^A-Za-z0-9._-]", "-", model_dir.name)[:64].lstrip(".-_") or "model"
    return f"{name}.{dtype_name}.{digest.hexdigest()[:32]}"


def prepare(model_dir: str | Path) -> None:
    """Reads what a start takes from the model directory before the GPU is needed: its config.json and the identity
    of each weight file (the snapshot key). A fork server calls it in a snap=True hook, so that its replicas find
    both already read (each is read again where its file's size, mtime or inode changed since)."""
    path = Path(model_dir)
    if (path / "config.json").is_file():
        model_config(path)
    for file in sorted(path.glob("*.safetensors")):
        file_identity(file)


_read: dict[tuple, object] = {}  # (what, file, size, mtime_ns, inode) -> what was read from that file


def _remembered(what: str, file: Path, read):
    status = file.stat()
    key = (what, str(file.resolve()), status.st_size, status.st_mtime_ns, status.st_ino)
    if key not in _read:
        _read[key] = read()
    return _read[key]


def model_config(path: Path):
    """The directory's transformers config (a copy: the one remembered stays as read)."""
    return copy.deepcopy(_remembered("config", path / "config.json", lambda: AutoConfig.from_pretrained(path)))


def file_identity(file: Path) -> bytes:
    """Name, size, safetensors header and an xxh3 of SAMPLES windows of the data, of one weight file."""
    return _remembered("identity", file, lambda: _file_identity(file))


def _file_identity(file: Path) -> bytes:
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = f.read(header_len)
        data_start = 8 + header_len
        data_len = size - data_start
        sampled = xxhash.xxh3_128()
        if data_len <= SAMPLES * WINDOW:
            sampled.update(f.read())
        else:
            for i in range(SAMPLES):
                sampled.update(os.pread(f.fileno(), WINDOW, data_start + i * (data_len - WINDOW) // (SAMPLES - 1)))
    return b"\0".join((file.name.encode(), str(size).encode(), hashlib.sha256(header).digest(), sampled.digest()))


def log_start(name: str, model, start: WeightsStart, snapshot: str) -> None:
    if start.fallback_reason:
        logger.warning("snapshot of %s unusable, booted from the full weights instead: %s", name, start.fallback_reason)
    nbytes = sum(p.nbytes for p in model.parameters())
    gbps = start.load.gbps if start.load else nbytes / start.seconds / 1e9 if start.seconds else 0.0
    wrote = f", wrote snapshot {start.captured.id[:12]} to {start.captured.store}" if start.captured else ""
    logger.info("weights of %s (%.3f GB) from %s in %.3f s = %.2f GB/s (snapshot: %s%s)", name, nbytes / 1e9,
                start.source, start.seconds, gbps, snapshot, wrote)
