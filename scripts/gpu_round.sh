#!/usr/bin/env bash
# One GPU call that checks and measures the current state, logging into OUTDIR (at most 8 files):
#   source .device/setup.sh && tar -xJf .device/kcache.tar.xz -C "$TILELANG_CACHE_DIR" && scripts/gpu_round.sh "$OUT"
# 1. the whole GPU suite (gpu-suite.log); 2. stage timings with the context-parallel columns (stages.json,
# stages.log); 3. flashgdn alone on the cp shape set, without and with context parallelism chosen by the cost
# model (bench-cp-off.json, bench-cp-auto.json). Later steps run even when a test fails.
set -uo pipefail
out=${1:?usage: scripts/gpu_round.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1

python3 -m pytest -m gpu -q 2>&1 | tail -60 > "$out/gpu-suite.log"
echo "# exit status ${PIPESTATUS[0]}" >> "$out/gpu-suite.log"

python3 benchmarks/stage_timing.py --loops rs,ws --out "$out/stages.json" > "$out/stages.log" 2>&1

for cp in off auto; do
  FLASHGDN_HOPPER_CP=$cp python3 -m flashgdn.bench --set cp --modes fwd --impls flashgdn --time-budget 120 \
    --no-plots --out-dir /tmp/bench-cp --name "bench-cp-$cp" > /dev/null 2>&1
  cp /tmp/bench-cp/"bench-cp-$cp".json "$out/" 2>/dev/null
done
