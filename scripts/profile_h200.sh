#!/usr/bin/env bash
# Check and time the Hopper forward on the GPU machine, and profile its stages, logging into OUTDIR:
#   source .device/setup.sh && scripts/profile_h200.sh "$OUT" [HEADS SEQLENS]
# 1. the Hopper forward's GPU tests (gpu-hopper.log)
# 2. per-stage CUDA-graph timings (stages.json, stages.log)
# 3. Nsight Compute on both stages of one shape (default 16/64, 8 x 4096), with per-instruction stall samples
#    of the chunk loop named by $LOOP (default rs) (ncu.txt: speed of light, occupancy, warp states;
#    ncu-sass.csv.xz, ncu-sass-kkt.csv.xz); with PROFILE=backward, of the backward's walk and chunk_grad instead
#    (ncu-sass.csv.xz: chunk_grad, ncu-sass-kkt.csv.xz: the walk).
# Steps 2 and 3 run even when a test fails, so one call gives the whole picture. STEPS (default "tests stages ncu")
# picks which run.
set -uo pipefail
out=${1:?usage: scripts/profile_h200.sh OUTDIR [HEADS SEQLENS]}
heads=${2:-16/64}
seqlens=${3:-4096,4096,4096,4096,4096,4096,4096,4096}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
loop=${LOOP:-rs}
if [ "${PROFILE:-forward}" = backward ]; then
  kernels="state_grad_walk|chunk_grad|chunk_forward_rs"; main="chunk_grad"; second="state_grad_walk"; extra=(--backward)
else
  # rsd and fused are builds of the rs loop: their kernel is named chunk_forward_rs
  kname=chunk_forward_$loop; [[ $loop == rsd || $loop == fused ]] && kname=chunk_forward_rs
  kernels="kkt_inverse|$kname"; main="$kname"; second="kkt_inverse"; extra=(--loops "$loop")
fi

steps=${STEPS:-tests stages ncu}
if [[ $steps == *tests* ]]; then
  python3 -m pytest -m gpu -q -x tests/test_gpu_hopper_forward.py 2>&1 | tail -40 > "$out/gpu-hopper.log"
  echo "# exit status ${PIPESTATUS[0]}" >> "$out/gpu-hopper.log"
fi

[[ $steps == *stages* ]] && python3 benchmarks/stage_timing.py --out "$out/stages.json" > "$out/stages.log" 2>&1

if [[ $steps != *ncu* ]]; then
  :
elif [ -x "$ncu" ]; then
  "$ncu" --clock-control none -k regex:"$kernels" --launch-skip "${NCU_SKIP:-2}" --launch-count "${NCU_COUNT:-2}" \
    --set full --import-source yes -f -o /tmp/prof \
    python3 benchmarks/profile_stages.py --heads "$heads" --seqlens "$seqlens" "${extra[@]}" > /tmp/ncu-run.log 2>&1
  {
    tail -5 /tmp/ncu-run.log
    "$ncu" -i /tmp/prof.ncu-rep --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats
  } > "$out/ncu.txt" 2>&1
  "$ncu" -i /tmp/prof.ncu-rep --page source --csv --print-source sass -k regex:"$main" 2>&1 \
    | xz -9 > "$out/ncu-sass.csv.xz"
  "$ncu" -i /tmp/prof.ncu-rep --page source --csv --print-source sass -k regex:"$second" 2>&1 \
    | xz -9 > "$out/ncu-sass-kkt.csv.xz"
else
  echo "ncu not found" > "$out/ncu.txt"
fi
