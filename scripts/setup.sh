#!/usr/bin/env bash
# Everything a fresh machine needs to serve and test Ember; safe to run again (it skips what is there).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "Ember needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

# The rate-limit tests start a real redis-server; the quickstart test runs the curl it prints; the dashboard test
# drives Debian's chromium through chromedriver (command:package; apt-get update + install of both took 46 s here).
MISSING=$(for need in redis-server:redis-server curl:curl chromium:chromium chromedriver:chromium-driver; do
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
  "$PYTHON" -m pip install -q torch==2.13.0
fi

echo "== installing ember (editable, with dev extras)"
"$PYTHON" -m pip install -q -e '.[dev]'

# checkov, the auditor tests/terraform/test_checkov.py runs, in its own venv: its pins (boto3, networkx, packaging)
# clash with Ember's. About 45 s on a warm pip cache, 2-3 minutes cold.
if [ ! -x .tools/checkov/bin/checkov ]; then
  echo "== installing checkov into .tools/checkov"
  "$PYTHON" -m venv .tools/checkov && .tools/checkov/bin/pip install -q checkov==3.3.30
fi
