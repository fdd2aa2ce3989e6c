#!/usr/bin/env bash
# One GPU call that checks and measures the current state, logging into OUTDIR (at most 8 files):
#   source .device/setup.sh && tar -xJf .device/kcache.tar.xz -C "$TILELANG_CACHE_DIR" && scripts/gpu_round.sh "$OUT"
# 1. the tests of the newest kernels (the pytest -k expression GPU_ROUND_NEW: the Hopper backward, the paired
#    CP pass, the captured training step), verbose so that a time limit still leaves each test's outcome, in a run
#    of their own (gpu-new.log), so that a hang there
#    cannot cost the rest their results (the CP splice kernel too); 2. stage timings of the forward (rs and uw loops, the op with and without
#    context parallelism) and of the backward's stages (stages.json, stages.log); 3. flashgdn's forward + backward
#    with the backward kernels (FLASHGDN_HOPPER_BACKWARD=kernels) on the bwd set's part 1/4 (16/32), gradients
#    checked and memory recorded (bench-bwd.json, bench-bwd.log), if the new tests passed; 4. the rest of the GPU
#    suite (gpu-suite.log) without the harness test, which runs every anchor (~5 min of FlashQLA compiles;
#    GPU_ROUND_HARNESS=1 includes it). Later steps run even when a test fails; each has a time limit so the whole
#    call ends inside ten minutes.
set -uo pipefail
out=${1:?usage: scripts/gpu_round.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1

deselect=(--deselect tests/test_bench_cli.py::test_harness_on_the_gpu)
[ "${GPU_ROUND_HARNESS:-0}" = 1 ] && deselect=()
new=${GPU_ROUND_NEW:-hopper_backward or paired or splice or fused or segment_index or training_step}
timeout "${GPU_ROUND_NEW_TEST_S:-200}" python3 -m pytest -m gpu -v -rfEx --durations=10 "${deselect[@]}" -k "$new" \
  > "$out/gpu-new.log" 2>&1
rc=$?
echo "# exit status $rc" >> "$out/gpu-new.log"
extra=()
[ "$rc" = 124 ] && extra=(--no-paired)  # the new tests timed out: maybe a hang, so leave the new kernels out
[ "$rc" = 0 ] && extra=(--backward)

FLASHGDN_HOPPER_CP=auto timeout 110 python3 benchmarks/stage_timing.py --loops rs,uw "${extra[@]}" \
  --out "$out/stages.json" > "$out/stages.log" 2>&1
echo "# exit status $?" >> "$out/stages.log"

if [ "$rc" = 0 ]; then
  FLASHGDN_HOPPER_BACKWARD=kernels timeout 70 python3 -m flashgdn.bench --set bwd --part 1/4 \
    --impls flashgdn --time-budget 50 --no-plots --out-dir /tmp/bench-bwd --name bench-bwd > "$out/bench-bwd.log" 2>&1
  echo "# exit status $?" >> "$out/bench-bwd.log"
  cp /tmp/bench-bwd/bench-bwd.json "$out/" 2>/dev/null
fi

timeout "${GPU_ROUND_TEST_S:-170}" python3 -m pytest -m gpu -q -rfEx --durations=10 "${deselect[@]}" -k "not ($new)" \
  > "$out/gpu-suite.log" 2>&1
echo "# exit status $?" >> "$out/gpu-suite.log"
