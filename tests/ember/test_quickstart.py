"""The README's serve command on a fresh clone, in a fresh venv that is never activated (scripts/serve-quickstart.sh,
scripts/setup.sh --serve): the banner's curl works when pasted, and SIGTERM leaves no admin key or gateway.json."""
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_fresh_clone_and_venv_run_the_readme_serve_command(tmp_path):
    clone, home = tmp_path / "ember", tmp_path / "home"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    # --system-site-packages: torch and the other dependencies come from this machine instead of a download.
    subprocess.run([sys._base_executable, "-m", "venv", "--system-site-packages", str(clone / ".venv")], check=True,
                   timeout=120)
    # As the README says, from the clone, nothing activated: no venv on PATH, no VIRTUAL_ENV.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(sys.prefix))
    env |= {"PYTHON": ".venv/bin/python", "EMBER_HOME": str(home), "EMBER_PORT": "0"}
    process = subprocess.Popen(["bash", "scripts/serve-quickstart.sh"], cwd=clone, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines, deadline = [], time.monotonic() + 400
        while not lines or not lines[-1].strip().startswith("curl"):
            line = process.stdout.readline()
            assert line and time.monotonic() < deadline, "no curl printed:\n" + "".join(lines)
            lines.append(line)
        assert lines[-2].strip() == "Try it:"
        pasted = subprocess.run(["bash", "-c", lines[-1].strip() + " -sS"], capture_output=True, text=True, timeout=60)
        assert pasted.returncode == 0 and pasted.stdout == '{"result": 9.0}', pasted.stderr
        assert (home / "gateway.json").exists()

        os.kill(process.pid, signal.SIGTERM)  # the script exec'd ember serve: this is the gateway
        assert process.wait(30) == 0
        rest = process.stdout.read()
        assert "Traceback" not in rest, rest
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
    assert not (home / "gateway.json").exists() and not (home / "cli.key").exists()
    with sqlite3.connect(home / "ember.db") as db:
        live = db.execute("SELECT name, admin FROM api_keys WHERE revoked IS NULL").fetchall()
    assert live == [("quickstart", 0)]  # the user's key stays; no admin key outlives the gateway
    # The venv's own interpreter runs this clone's Ember (not the one these tests run).
    which = subprocess.run([str(clone / ".venv/bin/python"), "-I", "-c",
                            "import ember.gateway as g; print(g.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert which.stdout.strip().startswith(str(clone)), which


def test_setup_errors_suggest_a_fix_that_works(tmp_path):
    """A PYTHON that is not there, or one too old, gets a line saying what to run instead (a venv, PYTHON=...)."""
    missing = subprocess.run(["bash", "scripts/setup.sh", "--serve"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env=os.environ | {"PYTHON": str(tmp_path / "no-python")})
    assert missing.returncode == 1 and f"no Python at PYTHON={tmp_path / 'no-python'}" in missing.stderr
    old = tmp_path / "python3.9"  # answers like an old interpreter
    old.write_text("#!/bin/sh\nexit 1\n")
    old.chmod(0o755)
    too_old = subprocess.run(["bash", "scripts/setup.sh", "--serve"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env=os.environ | {"PYTHON": str(old)})
    assert too_old.returncode == 1 and "Ember needs Python >= 3.11" in too_old.stderr
    assert "-m venv .venv, then: PYTHON=.venv/bin/python bash scripts/serve-quickstart.sh" in too_old.stderr
