"""Fixtures of the GPU tests."""
import shutil

import pytest


@pytest.fixture
def home_with_kept_kernels(tmp_path, monkeypatch):
    """A fresh EMBER_HOME (no snapshots) holding this machine's kept kernels, so a test that starts engines in it
    compiles nothing the machine has built already (flashinfer takes 67-110 s a module)."""
    from ember.runtime.engine.kernels import kernel_dir

    home = tmp_path / "home"
    if kernel_dir().is_dir():
        shutil.copytree(kernel_dir(), home / "kernels")
    monkeypatch.setenv("EMBER_HOME", str(home))
    return home
