#!/usr/bin/env bash
# Set up (if needed), lint and type-check, then run every test that does not need a GPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh  # ruff and mypy: a finding fails the run before any test starts
exec "${PYTHON:-python3}" -m pytest -q -m "not gpu" "$@"
