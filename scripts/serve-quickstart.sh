#!/usr/bin/env bash
# Set up (if needed) and serve examples/hello.py on https://127.0.0.1:8443 with a fresh API key;
# prints the URL, the CA path and a curl to paste. State lives in EMBER_HOME (default ~/.ember).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ember serve examples/hello.py --host "${EMBER_HOST:-127.0.0.1}" --port "${EMBER_PORT:-8443}" --new-key "quickstart-$(date +%Y%m%d-%H%M%S)"
