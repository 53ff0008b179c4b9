# Sourced at the start of a command on the GPU machine (the `device` tool), from a script of one session's steps:
#
#     source bench/engine/on_device.sh
#     step tests 180 python3 -m pytest -q -m gpu tests/gpu/test_paged_decode_gpu.py
#     step speed 240 python3 bench/engine/speed.py --models 8B --parts fp8_kv --skip-transformers \
#         --record --results "$OUT/speed" --workdir /tmp/w
#
# It installs the wheels that ../shared/gpu/wheels.sh put in .whl (carry it) into .gpu-site, and Ember over them,
# and points flashinfer's compiled kernels at /tmp/fi, which outlives a command while the machine stays warm. Each
# step runs under its own time limit, so one that hangs leaves the later ones their time; its output goes to
# $OUT/NAME.log (fetched back), and its status, its seconds and its log's last 25 lines to the call's own output.
# The machine has no network: run nothing here that downloads.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ON_DEVICE_START=$(date +%s)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/fi /tmp/w
if ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "on_device.sh: no wheels in .whl: run ../shared/gpu/wheels.sh .whl here first and carry .whl" >&2
  return 1 2>/dev/null || exit 1
fi
rm -rf .gpu-site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$PWD/.gpu-site" .whl/*.whl > "$OUT/pip.log" 2>&1
export PYTHONPATH="$PWD/.gpu-site"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$OUT/pip.log" 2>&1
export FLASHINFER_WORKSPACE_BASE=/tmp/fi
echo "set-up $(( $(date +%s) - ON_DEVICE_START )) s on $(nvidia-smi --query-gpu=name --format=csv,noheader)"

step() {   # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 begun rc
  shift 2
  begun=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "=== $name: exit $rc$( [ "$rc" = 124 ] && echo ' (its time limit)') in $(( $(date +%s) - begun )) s," \
       "$(( $(date +%s) - ON_DEVICE_START )) s into the call"
  tail -25 "$OUT/$name.log"
}
