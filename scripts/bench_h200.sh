#!/usr/bin/env bash
# Run the benchmark harness on the GPU machine and keep everything it writes in OUTDIR:
#   <stem>.json, <stem>.md, <stem>-fwd.png, <stem>-fwdbwd.png and bench.log (at most 5 files).
#
# Usage, from the project root, with the TileLang stack set up (and FlashInfer on PYTHONPATH when wanted):
#   source .device/setup.sh && scripts/bench_h200.sh "$OUT" --set quick
#   source .device/setup.sh && scripts/bench_h200.sh "$OUT" --set canonical --modes fwd --part 1/5 --time-budget 480
# Any argument after OUTDIR goes to `python3 -m flashgdn.bench` (see its --help).
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: scripts/bench_h200.sh OUTDIR [python -m flashgdn.bench args...]" >&2
  exit 2
fi
out=$1
shift
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log="$out/bench.log"
export PYTHONUNBUFFERED=1
# where .device/setup.sh keeps compiled TileLang kernels; set here too for a shell that could not source it
# (the FlashInfer command, which cannot bring .device/ along)
export TILELANG_CACHE_DIR="${TILELANG_CACHE_DIR:-/tmp/tilelang-cache}"
mkdir -p "$TILELANG_CACHE_DIR"
{
  echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) scripts/bench_h200.sh $out $*"
  echo "# commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit --format=csv,noheader 2>/dev/null \
    | sed 's/^/# gpu: /'
} > "$log"
python3 -m flashgdn.bench --out-dir "$out" "$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "# exit status $rc" >> "$log"
ls -l "$out" >> "$log"
exit "$rc"
