#!/usr/bin/env bash
# One GPU call that checks the current state and measures the backward, logging into OUTDIR (at most 8 files):
#   source .device/setup.sh && tar -xJf .device/kcache.tar.xz -C "$TILELANG_CACHE_DIR" && scripts/gpu_round.sh "$OUT"
# 1. the whole GPU suite (gpu-suite.log) on GPU_ROUND_WORKERS pytest-xdist workers (default 8), so that kernels
#    missing from the cache compile on the CPU cores side by side; without the harness test, which runs every
#    anchor (~5 min of FlashQLA compiles; GPU_ROUND_HARNESS=1 includes it);
# 2. where one training step's peak memory is, 16/32 32768x1 with and without CP (memory-peak.log,
#    memory-peak-{auto,off}.json; benchmarks/memory_peak.py);
# 3. the backward's stage timings with their A/B columns (stages.json, stages.log; stage_timing.py --backward-only).
# Every step has a time limit, so the call ends inside ten minutes, and later steps run when a test fails.
set -uo pipefail
out=${1:?usage: scripts/gpu_round.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1

deselect=(--deselect tests/test_bench_cli.py::test_harness_on_the_gpu)
[ "${GPU_ROUND_HARNESS:-0}" = 1 ] && deselect=()
timeout "${GPU_ROUND_TEST_S:-330}" python3 -m pytest -m gpu -q -rfEx --durations=15 -n "${GPU_ROUND_WORKERS:-8}" \
  "${deselect[@]}" > "$out/gpu-suite.log" 2>&1
echo "# exit status $?" >> "$out/gpu-suite.log"

for cp in auto off; do
  timeout 60 python3 benchmarks/memory_peak.py --heads 16/32 --seqlens 32768 --cp "$cp" \
    --out "$out/memory-peak-$cp.json" >> "$out/memory-peak.log" 2>&1
  echo "# exit status $?" >> "$out/memory-peak.log"
done

timeout "${GPU_ROUND_STAGES_S:-110}" python3 benchmarks/stage_timing.py --loops rs --backward-only \
  --out "$out/stages.json" > "$out/stages.log" 2>&1
echo "# exit status $?" >> "$out/stages.log"
