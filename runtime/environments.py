"""Per-function Python environments: a function's `requirements=[...]` installed once into a virtualenv under
EMBER_HOME/envs/<key>, keyed by the hash of the requirements (and of a local path's files), whose interpreter runs
that function's replicas and fork server.

The environment is made with --system-site-packages and also sees every site-packages folder of the Python that
made it (a .pth file), so torch, the engine and ember itself are shared rather than installed again; what it
installs comes first on its path. Packages are installed by `uv pip` when uv is on PATH, else by pip. An install
that fails raises InstallError with pip's own error lines, at deploy time.
"""
import fcntl
import functools
import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import venv
from collections.abc import Callable
from pathlib import Path

from ember.home import Home

READY = ".ember-ready"  # written last: an environment without it is rebuilt
SKIPPED = {".git", "__pycache__", "build", "dist", ".venv", ".tox"}
Progress = Callable[[str], None]


class InstallError(RuntimeError):
    """The requirements could not be installed; the message carries the installer's own error lines."""


def environment_key(requirements: list[str]) -> str:
    """Hash of the requirements, of each local path's files (size and mtime) and of this Python's version."""
    digest = hashlib.sha256(json.dumps([requirements, sys.version, sys.prefix]).encode())
    for requirement in requirements:
        if os.path.exists(requirement):
            for path in _files(Path(requirement)):
                stat = path.stat()
                digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED and not d.endswith(".egg-info"))
        found += [Path(folder) / f for f in sorted(files)]
    return found


def environments_root(home: Home | None = None) -> Path:
    return (home or Home()).root / "envs"


def python_for(requirements: list[str], home: Home | None = None) -> str | None:
    """The interpreter that runs a function with these requirements: this one when there are none, the installed
    environment's, or None when that is not installed yet."""
    if not requirements:
        return sys.executable
    folder = environments_root(home) / environment_key(requirements)
    return str(folder / "bin" / "python") if (folder / READY).exists() else None


def ensure(requirements: list[str], progress: Progress | None = None, home: Home | None = None) -> str:
    """The interpreter of the environment for `requirements`, installed first when it is not (once per machine:
    concurrent callers wait on a lock); InstallError when the install fails."""
    if not requirements:
        return sys.executable
    root = environments_root(home)
    root.mkdir(parents=True, exist_ok=True)
    key = environment_key(requirements)
    folder = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / READY).exists():
            _install(folder, requirements, progress or (lambda line: None))
    return str(folder / "bin" / "python")


def _install(folder: Path, requirements: list[str], progress: Progress) -> None:
    shutil.rmtree(folder, ignore_errors=True)  # a half-made one from an install that died
    began = time.monotonic()
    progress(f"creating {folder}")
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(folder)
    python = folder / "bin" / "python"
    own_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    # After its own packages: the site-packages of the Python that made it (a virtualenv's included).
    shared = [p for p in site.getsitepackages() + [site.getusersitepackages(), sysconfig.get_path("purelib")]
              if os.path.isdir(p)]
    Path(own_site, "_ember_shared.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in dict.fromkeys(shared)))
    uv = shutil.which("uv")
    command = [uv, "pip", "install", "--python", str(python)] if uv else \
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off"]
    progress(f"installing {' '.join(requirements)} with {'uv' if uv else 'pip'}")
    lines = []
    with subprocess.Popen(command + requirements, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          stdin=subprocess.DEVNULL) as installer:
        for line in installer.stdout or []:
            lines.append(line.rstrip())
            if line.strip():
                progress(line.rstrip())
    if installer.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise InstallError(f"installing {', '.join(requirements)} failed: {summarise(lines)}")
    (folder / READY).write_text(json.dumps({"requirements": requirements}))
    progress(f"installed in {time.monotonic() - began:.1f} s")


def summarise(lines: list[str], limit: int = 600) -> str:
    """The installer's error lines (pip's start 'ERROR:', uv's 'error:'), else its last lines."""
    errors = [line.strip() for line in lines if line.lstrip().lower().startswith("error")]
    chosen = errors or [line.strip() for line in lines if line.strip()][-3:]
    text = " | ".join(chosen) or "no output"
    return text if len(text) <= limit else text[:limit] + " ..."


@functools.lru_cache(maxsize=64)  # packages are named by their content's hash: one never changes
def groups(package: Path) -> dict[tuple[str, ...], list[str]]:
    """The package's units grouped by their requirements: one environment and one fork server per group."""
    from ember.package import read_manifest

    found: dict[tuple[str, ...], list[str]] = {}
    for name, info in read_manifest(package)["units"].items():
        found.setdefault(tuple(info["spec"].get("requirements", [])), []).append(name)
    return found


def ensure_for_package(package: Path, progress: Progress | None = None, home: Home | None = None) -> None:
    """Install the environment of every group of the package's units that has requirements: what a deploy does
    before it routes calls, so a failed install fails the deploy."""
    for requirements, names in groups(package).items():
        if requirements and python_for(list(requirements), home) is None:
            if progress:
                progress(f"requirements of {', '.join(names)}: {', '.join(requirements)}")
            ensure(list(requirements), progress, home)
