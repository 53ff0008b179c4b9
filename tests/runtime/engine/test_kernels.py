"""Kernels ahead of time: built modules are kept as flashinfer AOT modules, sent through the store, installed.

flashinfer cannot be installed on a CPU-only machine, so a stand-in `flashinfer.jit.env` module holds the two
directories kernels.py reads; the GPU bench proves the loading itself on a fresh kernel cache."""
import io
import os
import sys
import tarfile
import types

import pytest

from ember.runtime.engine import kernels
from ember.snapshot import LocalStore

MODULE = "batch_prefill_with_kv_cache_dtype_q_bf16_head_dim_qk_128"


@pytest.fixture
def ember_home(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def jit_env(tmp_path, monkeypatch, ember_home):
    cache = tmp_path / "workspace" / ".cache" / "flashinfer"
    env = types.SimpleNamespace(FLASHINFER_CACHE_DIR=cache,
                                FLASHINFER_JIT_DIR=cache / "0.6.13" / "90a" / "cached_ops",
                                FLASHINFER_AOT_DIR=tmp_path / "site-packages" / "flashinfer" / "data" / "aot")
    package, jit = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.jit")
    package.jit, jit.env = jit, env
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.jit", jit)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.env", env)
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # recorded, so the one install() sets is undone after the test
    monkeypatch.delenv("TRITON_CACHE_DIR")
    return env


def build(env, name: str, data: bytes = b"\x7fELF module") -> None:
    folder = env.FLASHINFER_JIT_DIR / name
    folder.mkdir(parents=True)
    (folder / f"{name}.so").write_bytes(data)
    (folder / f"{name}.cuda.o").write_bytes(b"object")  # build leftovers stay behind
    (folder / "build.ninja").write_text("rule nvcc\n")


def test_built_modules_are_kept_as_aot_modules_and_installed(jit_env, ember_home):
    build(jit_env, MODULE)
    assert kernels.collect() == [MODULE]
    assert kernels.collect() == []  # kept once
    kept = ember_home / "kernels" / "flashinfer" / "0.6.13" / "90a"
    assert sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*") if p.is_file()) == \
        [f"{MODULE}/{MODULE}.so"]
    assert kernels.install() == kept == jit_env.FLASHINFER_AOT_DIR  # flashinfer loads <aot>/<name>/<name>.so as is
    assert os.environ["TRITON_CACHE_DIR"] == str(ember_home / "kernels" / "triton")


def test_a_fresh_node_installs_the_kernels_another_node_sent_to_the_store(jit_env, ember_home, tmp_path):
    store = LocalStore()
    build(jit_env, MODULE, b"compiled once")
    assert kernels.keep(store) == [MODULE]
    assert store.get_blob("kernels-flashinfer-0.6.13-90a.tgz") is not None

    os.rename(ember_home / "kernels", tmp_path / "old-node-kernels")  # the fresh node: no kernels, no JIT cache
    os.rename(jit_env.FLASHINFER_CACHE_DIR, tmp_path / "old-node-cache")
    target = kernels.prepare(store)
    assert (target / MODULE / f"{MODULE}.so").read_bytes() == b"compiled once"
    assert jit_env.FLASHINFER_AOT_DIR == target
    assert kernels.keep(store) == []  # nothing was built here, nothing is sent


def test_kernels_a_node_came_with_reach_the_store_too(jit_env, ember_home):
    store = LocalStore()
    build(jit_env, MODULE, b"shipped with the node")
    kernels.collect()  # kept before any store was configured
    assert kernels.keep(store) == [] and store.get_blob("kernels-flashinfer-0.6.13-90a.tgz") is not None


def test_an_archive_cannot_write_outside_the_kernel_directory(ember_home):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("../../escaped.so")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match="outside"):
        kernels.unpack(buffer.getvalue())
    assert not (ember_home / "escaped.so").exists()
