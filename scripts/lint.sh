#!/usr/bin/env bash
# ruff and mypy over the tree, configured in pyproject.toml (installed by the dev extra); scripts/test.sh (CI) runs it
# before the tests, and any finding fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ROOT=$PWD

"$PYTHON" -m ruff check --output-format concise .

# mypy cannot follow setup.py's folder mapping (gateway/ is ember.gateway): it reads a tree of links in that shape.
TREE=$(mktemp -d)
trap 'rm -rf "$TREE"' EXIT
mkdir "$TREE/ember"
for entry in ember/*; do ln -s "$ROOT/$entry" "$TREE/ember/"; done
for folder in gateway runtime snapshot; do ln -s "$ROOT/$folder" "$TREE/ember/$folder"; done
(cd "$TREE" && "$PYTHON" -m mypy --config-file "$ROOT/pyproject.toml" --cache-dir "$ROOT/.mypy_cache" -p ember)
