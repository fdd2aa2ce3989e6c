#!/usr/bin/env bash
# One GPU call for the forward's open A/Bs, logging into OUTDIR (at most 8 files; the larger ones compressed):
#   source .device/setup.sh && scripts/gpu_forward_round.sh "$OUT" [HEADS SEQLENS]
# 1. the two open A/Bs against the defaults, bit for bit: the rso loop's state paths with their column factors in
#    registers (forward.RSO_LEAN_STATE), then the rs state-only passes the same way (forward.LEAN_STATE_PASSES: CP's
#    transitions, the backward's chunk states), then the forward's tests on rso with the first (gpu-ab.log);
# 2. the stages timed with the A/B columns, twice in opposite order (on full shapes the board's power cap makes
#    whichever runs second look slower): stages.json / stages-2.json (stage_timing.py --loops rso,rs
#    --rso-lean-state --rso-plain --rs-lean --columns ...);
# 3. Nsight Compute on the rso loop and stage 1 of one shape (default 16/32, 8 x 4096): ncu.txt, ncu-sass.csv.xz,
#    ncu-sass-kkt.csv.xz (scripts/profile_h200.sh), to read with benchmarks/sass_wavefronts.py and by role.
# Every step has a time limit, so the call ends inside ten minutes; later steps run when a test fails.
set -uo pipefail
out=${1:?usage: scripts/gpu_forward_round.sh OUTDIR [HEADS SEQLENS]}
heads=${2:-16/32}
seqlens=${3:-4096,4096,4096,4096,4096,4096,4096,4096}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1

{
  FLASHGDN_TEST_CHUNK_LOOPS=rso timeout 90 python3 -m pytest -m gpu -q -rfEx -n 2 tests/test_gpu_hopper_forward.py \
    -k lean_state; echo "# exit status $?"
  timeout 120 python3 -m pytest -m gpu -q -rfEx -n 2 tests/test_gpu_hopper_cp.py -k lean_rs; echo "# exit status $?"
  FLASHGDN_HOPPER_RSO_LEAN_STATE=1 FLASHGDN_TEST_CHUNK_LOOPS=rso timeout 150 python3 -m pytest -m gpu -q -rfEx \
    -n 8 tests/test_gpu_hopper_forward.py; echo "# exit status $?"
} 2>&1 | grep -v "Warning\|warner\|warnings.warn" | tail -40 > "$out/gpu-ab.log"

cols=loop_rso,loop_rso_lean_state,loop_rso_plain,op,op_rso_lean_state,op_rso_plain,loop_rs_state,loop_rs_state_lean
cols=$cols,op_cp64,op_cp64_rs_lean
rev=$(echo "$cols" | tr , '\n' | tac | paste -sd, -)
ab=(--loops rso,rs --rso-lean-state --rso-plain --rs-lean)
timeout 100 python3 benchmarks/stage_timing.py "${ab[@]}" --columns "$cols" --out "$out/stages.json" > "$out/stages.log" 2>&1
timeout 100 python3 benchmarks/stage_timing.py "${ab[@]}" --columns "$rev" --out "$out/stages-2.json" >> "$out/stages.log" 2>&1
echo "# exit status $?" >> "$out/stages.log"

STEPS=ncu LOOP=rso NCU_SKIP=2 NCU_COUNT=2 timeout 150 scripts/profile_h200.sh "$out" "$heads" "$seqlens"
