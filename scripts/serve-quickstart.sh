#!/usr/bin/env bash
# Set up (if needed) and serve examples/hello.py on https://127.0.0.1:8443 with an API key named "quickstart"
# (each run revokes the previous run's); prints the URL, the CA path and a curl to paste. State lives in EMBER_HOME
# (default ~/.ember). PYTHON picks the interpreter (e.g. a venv's: PYTHON=.venv/bin/python), no activation needed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}
bash scripts/setup.sh --serve
exec "$PYTHON" -m ember.cli serve examples/hello.py --host "${EMBER_HOST:-127.0.0.1}" --port "${EMBER_PORT:-8443}" \
  --new-key quickstart
