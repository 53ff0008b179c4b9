#!/usr/bin/env bash
# Everything a fresh machine needs to serve and test Ember; safe to run again (it skips what is there).
# `setup.sh --serve` installs only what serving needs (curl, torch, Ember), not the test tools.
# PYTHON picks the interpreter (default python3), e.g. PYTHON=.venv/bin/python for a venv, no activation needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SERVE_ONLY=$([ "${1:-}" = --serve ] && echo 1 || echo "")

command -v "$PYTHON" >/dev/null \
  || { echo "no Python at PYTHON=$PYTHON: install python3 (>= 3.11), or set PYTHON to one" >&2; exit 1; }
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "Ember needs Python >= 3.11; $PYTHON is older. Make a venv from a newer one and use it:" >&2
       echo "  python3.11 -m venv .venv, then: PYTHON=.venv/bin/python bash scripts/serve-quickstart.sh" >&2; exit 1; }
VENV_FIX="python3 -m venv .venv, then run this again with PYTHON=.venv/bin/python in front"
VENV_FIX="$VENV_FIX (e.g. PYTHON=.venv/bin/python bash scripts/serve-quickstart.sh;"
VENV_FIX="$VENV_FIX Debian/Ubuntu: apt-get install python3-venv)"
"$PYTHON" -m pip --version >/dev/null 2>&1 \
  || { echo "$PYTHON has no pip; use a virtual environment: $VENV_FIX" >&2; exit 1; }
pip_install() {  # an externally managed system Python (PEP 668) refuses installs: say how to use a venv instead
  "$PYTHON" -m pip install -q "$@" || { echo "pip could not install $* into $PYTHON; if it said" \
    "externally-managed-environment, use a virtual environment: $VENV_FIX" >&2; exit 1; }
}

# The rate-limit tests start a real redis-server; the quickstart test runs the curl it prints; the dashboard test
# drives Debian's chromium through chromedriver (command:package; apt-get update + install of both took 46 s here).
NEEDS="curl:curl"
[ -n "$SERVE_ONLY" ] || NEEDS="$NEEDS redis-server:redis-server chromium:chromium chromedriver:chromium-driver"
MISSING=$(for need in $NEEDS; do
  command -v "${need%%:*}" >/dev/null || echo "${need#*:}"; done)
if [ -n "$MISSING" ]; then
  echo "== installing" $MISSING
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq $MISSING
fi

# CPU torch first, so installing Ember does not pull the multi-GB CUDA build (2.13.0 is the
# CPU wheel this machine keeps on disk; a plain "torch" requirement would fetch CUDA).
if ! "$PYTHON" -c 'import torch, sys; sys.exit(not torch.__version__.startswith("2.13.0"))' 2>/dev/null; then
  echo "== installing torch 2.13.0 (CPU build)"
  pip_install torch==2.13.0
fi

# Constrained decoding's grammar engine (structured outputs, forced tool calls). Its package also asks for triton
# (~290 MB) for a GPU kernel Ember does not use (engine/grammar.py masks with torch): installed here without it.
if ! "$PYTHON" -c 'import xgrammar' 2>/dev/null; then
  echo "== installing xgrammar"
  pip_install --no-deps 'xgrammar==0.2.9' 'apache-tvm-ffi>=0.1.11,<0.2'
fi

if [ -n "$SERVE_ONLY" ]; then
  # Installed, and from this checkout (a venv with --system-site-packages may see another one).
  "$PYTHON" -I -c 'import pathlib as p, sys, ember.gateway as g
sys.exit(p.Path(g.__file__).resolve().parent != p.Path(sys.argv[1]).resolve())' "$PWD/gateway" 2>/dev/null \
    || { echo "== installing ember (editable)"; pip_install -e .; }
  exit 0
fi
echo "== installing ember (editable, with dev extras)"
pip_install -e '.[dev]'

# checkov, the auditor tests/terraform/test_checkov.py runs, in its own venv: its pins (boto3, networkx, packaging)
# clash with Ember's. About 45 s on a warm pip cache, 2-3 minutes cold.
if [ ! -x .tools/checkov/bin/checkov ]; then
  echo "== installing checkov into .tools/checkov"
  "$PYTHON" -m venv .tools/checkov && .tools/checkov/bin/pip install -q checkov==3.3.30
fi
