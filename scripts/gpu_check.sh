#!/usr/bin/env bash
# The GPU check, on the GPU machine from the project root, with the TileLang stack set up:
#   source .device/setup.sh && scripts/gpu_check.sh "$OUT"
# Runs the GPU test suite (pytest -m gpu), then the quick benchmark when the benchmark harness is there,
# logging both into LOGDIR (gpu-tests.log, bench-quick.log). Exits non-zero when the GPU suite failed.
set -uo pipefail
if [ $# -ne 1 ]; then
  echo "usage: scripts/gpu_check.sh LOGDIR" >&2
  exit 2
fi
logdir=$1
mkdir -p "$logdir"
logdir=$(cd "$logdir" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1

# The suite in parallel processes when pytest-xdist is there (GPU_CHECK_WORKERS: a count, 0 for one process; default
# the cores less four): the kernels a carried cache lacks then compile side by side instead of one after another
# (the whole suite took 430 s in 12 processes on a 16-core H200 machine, most of it compiling).
workers=${GPU_CHECK_WORKERS:-auto}
xdist=()
if [ "$workers" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
  [ "$workers" = auto ] && workers=$(( $(nproc) > 5 ? $(nproc) - 4 : 1 ))
  [ "$workers" -gt 1 ] && xdist=(-n "$workers")
fi

{
  echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/# gpu: /'
  python3 -m pytest -m gpu -q "${xdist[@]}"
} 2>&1 | tee "$logdir/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
echo "# GPU suite exit status $tests_rc" | tee -a "$logdir/gpu-tests.log"

if python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('flashgdn.bench.__main__') is None)" 2>/dev/null; then
  # keep the benchmark's result files with the logs when the harness can write them elsewhere
  out_args=()
  python3 -m flashgdn.bench --help 2>/dev/null | grep -q -- '--out-dir' && out_args=(--out-dir "$logdir")
  python3 -m flashgdn.bench --set quick "${out_args[@]}" 2>&1 | tee "$logdir/bench-quick.log"
  echo "# benchmark exit status ${PIPESTATUS[0]}" | tee -a "$logdir/bench-quick.log"
else
  echo "flashgdn.bench has no __main__ yet: quick benchmark skipped" | tee "$logdir/bench-quick.log"
fi
exit "$tests_rc"
