#!/usr/bin/env bash
# One GPU call that checks the current state and measures the backward, logging into OUTDIR (at most 8 files):
#   source .device/setup.sh && tar -xJf .device/kcache.tar.xz -C "$TILELANG_CACHE_DIR" && scripts/gpu_round.sh "$OUT"
# 1. the whole GPU suite (gpu-suite.log; scripts/gpu_steps.sh: gpu_suite);
# 2. where one training step's peak memory is (memory-peak*; gpu_steps.sh: memory_peaks);
# 3. one training step's time by kernel (step-kernels.json, .log; benchmarks/step_kernels.py);
# 4. the backward's stage timings with their A/B columns (stages.json, stages.log; stage_timing.py --backward-only).
# Every step has a time limit, so the call ends inside ten minutes, and later steps run when a test fails.
set -uo pipefail
out=${1:?usage: scripts/gpu_round.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1

. scripts/gpu_steps.sh
gpu_suite "$out" "${GPU_ROUND_TEST_S:-330}"
memory_peaks "$out"
timeout 90 python3 benchmarks/step_kernels.py --shape 16/32:4096x8 --shape 16/64:4096x8 --shape 2/8:1024x8 \
  --out "$out/step-kernels.json" > "$out/step-kernels.log" 2>&1
echo "# exit status $?" >> "$out/step-kernels.log"

timeout "${GPU_ROUND_STAGES_S:-110}" python3 benchmarks/stage_timing.py --loops rs --backward-only \
  --out "$out/stages.json" > "$out/stages.log" 2>&1
echo "# exit status $?" >> "$out/stages.log"
