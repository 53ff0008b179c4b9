#!/usr/bin/env bash
# Set up (if needed) and run every test that does not need a GPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q -m "not gpu" "$@"
