#!/usr/bin/env bash
# One GPU call for the forward's open A/Bs, logging into OUTDIR (at most 8 files; the larger ones compressed):
#   source .device/setup.sh && scripts/gpu_forward_round.sh "$OUT" [HEADS SEQLENS]
# 1. stage 1 at five CTAs per SM against the default, bit for bit, and the forward's tests with it
#    (gpu-kkt5.log: tests/test_gpu_hopper_stage1.py, then tests/test_gpu_hopper_forward.py on rso with
#    FLASHGDN_HOPPER_KKT_BLOCKS_PER_SM=5);
# 2. the stages timed with the A/B columns (stages.json, stages.log: stage_timing.py --loops rso --kkt-5
#    --unswizzled-v --no-paired);
# 3. Nsight Compute on the swizzled rso loop and stage 1 of one shape (default 16/32, 8 x 4096): ncu.txt,
#    ncu-sass.csv.xz, ncu-sass-kkt.csv.xz (scripts/profile_h200.sh), to read with benchmarks/sass_wavefronts.py.
# Every step has a time limit, so the call ends inside ten minutes; later steps run when a test fails.
set -uo pipefail
out=${1:?usage: scripts/gpu_forward_round.sh OUTDIR [HEADS SEQLENS]}
heads=${2:-16/32}
seqlens=${3:-4096,4096,4096,4096,4096,4096,4096,4096}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1

{
  timeout 110 python3 -m pytest -m gpu -q -rfEx -n 8 tests/test_gpu_hopper_stage1.py; echo "# exit status $?"
  FLASHGDN_HOPPER_KKT_BLOCKS_PER_SM=5 FLASHGDN_TEST_CHUNK_LOOPS=rso timeout 150 python3 -m pytest -m gpu -q -rfEx \
    -n 8 tests/test_gpu_hopper_forward.py; echo "# exit status $?"
} 2>&1 | grep -v "Warning\|warner\|warnings.warn" | tail -40 > "$out/gpu-kkt5.log"

timeout 120 python3 benchmarks/stage_timing.py --loops rso --kkt-5 --unswizzled-v --no-paired \
  --out "$out/stages.json" > "$out/stages.log" 2>&1
echo "# exit status $?" >> "$out/stages.log"

STEPS=ncu LOOP=rso NCU_SKIP=2 NCU_COUNT=2 timeout 150 scripts/profile_h200.sh "$out" "$heads" "$seqlens"
