#!/usr/bin/env bash
# One GPU call that checks and measures the current state, logging into OUTDIR (at most 8 files):
#   source .device/setup.sh && tar -xJf .device/kcache.tar.xz -C "$TILELANG_CACHE_DIR" && scripts/gpu_round.sh "$OUT"
# 1. the GPU suite (gpu-suite.log; the tests of the newest kernels, the pytest -k expression GPU_ROUND_NEW, last) without the harness test, which runs every anchor (~5 min of FlashQLA
#    compiles; GPU_ROUND_HARNESS=1 includes it); 2. stage timings of the rs and uw loops, the op with context
#    parallelism chosen by the cost model (stages.json, stages.log); 3. flashgdn's forward + backward with the
#    Hopper backward kernels (FLASHGDN_HOPPER_BACKWARD=kernels) on the bwd set's part 1/4 (16/32), with
#    its gradients checked and its memory recorded (bench-bwd.json, bench-bwd.log), unless the new tests failed.
#    Later steps run even when a test fails; each has a time limit so the whole call ends inside ten minutes.
set -uo pipefail
out=${1:?usage: scripts/gpu_round.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1

deselect=(--deselect tests/test_bench_cli.py::test_harness_on_the_gpu)
[ "${GPU_ROUND_HARNESS:-0}" = 1 ] && deselect=()
# the newest kernel's tests in a run of their own, so that a hang there cannot cost the rest their results
new=${GPU_ROUND_NEW:-hopper_backward or paired or training_step or fullgraph}
timeout "${GPU_ROUND_TEST_S:-150}" python3 -m pytest -m gpu -q -rfEx --durations=10 "${deselect[@]}" -k "not ($new)" \
  > "$out/gpu-suite.log" 2>&1
echo "# exit status $?" >> "$out/gpu-suite.log"
timeout "${GPU_ROUND_NEW_TEST_S:-90}" python3 -m pytest -m gpu -q -rfEx --durations=5 "${deselect[@]}" -k "$new" \
  >> "$out/gpu-suite.log" 2>&1
rc=$?
echo "# exit status $rc" >> "$out/gpu-suite.log"
paired=()
[ "$rc" = 124 ] && paired=(--no-paired)  # the new tests timed out: maybe a hang, so leave the new kernels out

FLASHGDN_HOPPER_CP=auto timeout 130 python3 benchmarks/stage_timing.py --loops rs,uw "${paired[@]}" --out "$out/stages.json" \
  > "$out/stages.log" 2>&1
echo "# exit status $?" >> "$out/stages.log"

if [ "$rc" = 0 ]; then
  FLASHGDN_HOPPER_BACKWARD=kernels timeout 110 python3 -m flashgdn.bench --set bwd --part 1/4 \
    --impls flashgdn --time-budget 90 --no-plots --out-dir /tmp/bench-bwd --name bench-bwd > "$out/bench-bwd.log" 2>&1
  echo "# exit status $?" >> "$out/bench-bwd.log"
  cp /tmp/bench-bwd/bench-bwd.json "$out/" 2>/dev/null
fi
