"""Compiled GPU kernels ahead of time: no request waits for a compiler.

flashinfer builds each kernel module on first use for a model's shape (67-110 s on the H200). The engine
builds them when it starts (its warm-up step runs prefill, decode and sampling) and `collect()` keeps every
built module in EMBER_HOME/kernels, beside the snapshots; `install()` makes flashinfer load from there before
anything runs. Kept modules are loaded as flashinfer's AOT modules: `<aot dir>/<name>/<name>.so` is loaded
as it is, with no build step, whereas a carried JIT build directory is handed to ninja, which rebuilt it on a
fresh machine because the freshly installed headers looked newer than the objects. Triton keeps its cache in
the same place. `pack()` / `unpack()` move the directory through a snapshot store, so a fresh node installs
the kernels before its first replica starts.
"""
import io
import logging
import os
import shutil
import tarfile
from pathlib import Path
from typing import Any

from ember.home import Home

log = logging.getLogger(__name__)


def kernel_dir() -> Path:
    return Home().root / "kernels"


def install(root: Path | None = None) -> Path | None:
    """Points Triton's cache and (when flashinfer is imported) flashinfer's AOT modules at the kernel directory.

    Call it after CUDA is initialised: importing flashinfer initialises CUDA, so this never imports it; the
    attention backend calls it again once it has. Returns flashinfer's directory when it was installed."""
    root = root or kernel_dir()
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    import sys
    jit_env: Any = sys.modules.get("flashinfer.jit.env")  # Any: the module's settings are not typed
    if jit_env is None:
        return None
    jit_env.FLASHINFER_AOT_DIR = aot_dir = flashinfer_dir(root, jit_env)
    return aot_dir


def flashinfer_dir(root: Path, jit_env) -> Path:
    """Where this flashinfer version's modules for this GPU architecture are kept, e.g. flashinfer/0.6.13/90a."""
    version_and_arch = jit_env.FLASHINFER_JIT_DIR.relative_to(jit_env.FLASHINFER_CACHE_DIR).parent
    return root / "flashinfer" / version_and_arch


def collect(root: Path | None = None) -> list[str]:
    """Copies every flashinfer module built in this process's JIT directory that the kernel directory lacks;
    returns their names."""
    import sys
    jit_env = sys.modules.get("flashinfer.jit.env")
    if jit_env is None or not jit_env.FLASHINFER_JIT_DIR.is_dir():
        return []
    target = flashinfer_dir(root or kernel_dir(), jit_env)
    added = []
    for built in sorted(jit_env.FLASHINFER_JIT_DIR.glob("*/*.so")):
        name = built.parent.name
        if built.stem != name or (target / name / built.name).exists():
            continue
        (target / name).mkdir(parents=True, exist_ok=True)
        partial = target / name / f".{built.name}.partial"
        shutil.copy2(built, partial)
        partial.rename(target / name / built.name)  # a reader never sees a half-copied module
        added.append(name)
    if added:
        log.info("kept %d compiled kernel modules in %s: %s", len(added), target, ", ".join(added))
    return added


def blob_name(jit_env) -> str:
    """The name of this flashinfer version's and GPU architecture's kernels in a snapshot store."""
    version_and_arch = jit_env.FLASHINFER_JIT_DIR.relative_to(jit_env.FLASHINFER_CACHE_DIR).parent
    return "kernels-flashinfer-" + "-".join(version_and_arch.parts) + ".tgz"


def prepare(store=None) -> Path:
    """Before the first kernel runs: installs the kernel directory, first fetching the store's kernels for this
    flashinfer version and GPU when this node has none. Imports flashinfer: call it after CUDA is initialised."""
    import flashinfer.jit.env as jit_env

    target = flashinfer_dir(kernel_dir(), jit_env)
    if store is not None and not any(target.glob("*/*.so")):
        try:
            archive = store.get_blob(blob_name(jit_env))
        except Exception as err:  # noqa: BLE001 - an unreachable store costs a compile, not the start
            log.warning("no compiled kernels from %s (%s): the warm-up compiles them", store.url, err)
            archive = None
        if archive is not None:
            log.info("installed %d kernel files from %s", unpack(archive), store.url)
    install()
    return target


def keep(store=None) -> list[str]:
    """After the engine's warm-up: keeps the modules it built and sends the kernel directory to the store for the
    next node, when it has new ones or the store has none yet (the kernels may have come with the node)."""
    added = collect()
    if store is not None:
        import flashinfer.jit.env as jit_env

        try:
            if added or store.get_blob(blob_name(jit_env)) is None:
                store.put_blob(blob_name(jit_env), pack())
        except Exception as err:  # noqa: BLE001 - the node keeps them; only other nodes miss them
            log.warning("could not send compiled kernels to %s: %s", store.url, err)
    return added


def pack(root: Path | None = None) -> bytes:
    """The kernel directory as a tar archive (for a snapshot store)."""
    root = root or kernel_dir()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        if root.is_dir():
            for path in sorted(root.rglob("*")):
                if path.is_file() and not path.name.endswith(".partial"):
                    tar.add(path, arcname=str(path.relative_to(root)))
    return buffer.getvalue()


def unpack(archive: bytes, root: Path | None = None) -> int:
    """Installs the files of an archive made by pack() that the kernel directory lacks; returns how many."""
    root = root or kernel_dir()
    count = 0
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():
            target = root / member.name
            source = tar.extractfile(member) if member.isfile() else None
            if source is None or target.exists():
                continue
            if not target.resolve().is_relative_to(root.resolve()):
                raise ValueError(f"kernel archive member {member.name!r} points outside {root}")
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.partial")
            with source as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.rename(target)
            count += 1
    return count
