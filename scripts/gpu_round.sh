#!/usr/bin/env bash
# One GPU call that checks and measures the current state, logging into OUTDIR (at most 8 files):
#   source .device/setup.sh && tar -xJf .device/kcache.tar.xz -C "$TILELANG_CACHE_DIR" && scripts/gpu_round.sh "$OUT"
# 1. the tests of the newest kernels (the pytest -k expression GPU_ROUND_NEW, default the backward's A/Bs not yet
#    run on the GPU: chunk_grad's batched GEMMs and the staged state stores), verbose so that a time limit still
#    leaves each test's outcome, in a run of their own (gpu-new.log), so that a hang there cannot cost the rest their
#    results; 2. stage timings of the backward with those A/Bs beside the defaults (stages.json, stages.log;
#    `stage_timing.py --backward-only`) and where a training step's peak memory is (memory-peak.json, .log;
#    `benchmarks/memory_peak.py`); 3. flashgdn's forward + backward with the A/Bs switched on, on the bwd
#    set's part 1/4 (16/32), to set beside parts/bwd-f.json (bench-bwd.json, bench-bwd.log), if the new tests
#    passed; 4. the rest of the GPU suite (gpu-suite.log) without the harness test, which runs every anchor (~5 min
#    of FlashQLA compiles; GPU_ROUND_HARNESS=1 includes it). Later steps run even when a test fails; each has a time
#    limit so the whole call ends inside ten minutes.
set -uo pipefail
out=${1:?usage: scripts/gpu_round.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1

deselect=(--deselect tests/test_bench_cli.py::test_harness_on_the_gpu)
[ "${GPU_ROUND_HARNESS:-0}" = 1 ] && deselect=()
new=${GPU_ROUND_NEW:-batched or staged}
timeout "${GPU_ROUND_NEW_TEST_S:-120}" python3 -m pytest -m gpu -v -rfEx --durations=10 "${deselect[@]}" -k "$new" \
  > "$out/gpu-new.log" 2>&1
rc=$?
echo "# exit status $rc" >> "$out/gpu-new.log"
if [ "$rc" != 124 ]; then  # a time limit there may be a hang: leave the new kernels out of the timings
  timeout 110 python3 benchmarks/stage_timing.py --loops rs --backward-only --out "$out/stages.json" \
    > "$out/stages.log" 2>&1
  echo "# exit status $?" >> "$out/stages.log"
fi

# where the training step's peak memory is (the backward's memory is above FlashQLA's)
timeout 60 python3 benchmarks/memory_peak.py --heads 16/32 --seqlens 32768 --out "$out/memory-peak.json" \
  > "$out/memory-peak.log" 2>&1
echo "# exit status $?" >> "$out/memory-peak.log"

if [ "$rc" = 0 ]; then
  FLASHGDN_HOPPER_CHUNK_GRAD_BATCHED=1 FLASHGDN_HOPPER_STAGED_STATE_STORES=1 timeout 70 python3 -m flashgdn.bench \
    --set bwd --part 1/4 --impls flashgdn --time-budget 50 --no-plots --out-dir /tmp/bench-bwd --name bench-bwd \
    > "$out/bench-bwd.log" 2>&1
  echo "# exit status $?" >> "$out/bench-bwd.log"
  cp /tmp/bench-bwd/bench-bwd.json "$out/" 2>/dev/null
fi

timeout "${GPU_ROUND_TEST_S:-220}" python3 -m pytest -m gpu -q -rfEx --durations=10 "${deselect[@]}" -k "not ($new)" \
  > "$out/gpu-suite.log" 2>&1
echo "# exit status $?" >> "$out/gpu-suite.log"
