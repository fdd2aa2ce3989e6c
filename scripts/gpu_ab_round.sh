#!/usr/bin/env bash
# The v0.16 A/Bs on the GPU, in two calls of under ten minutes each, on the GPU machine from the project root:
#   source .device/setup.sh && scripts/gpu_ab_round.sh backward "$OUT"
#   source .device/setup.sh && scripts/gpu_ab_round.sh forward "$OUT"
# backward: the fused backward's tests with the two A/Bs' same-bits checks (backward.FUSED_P_FIRST,
#   FUSED_LEAN_GATES; gpu-fused.log), its trace at each of the four settings on 16/32 8 x 4096 and at the default on
#   CP-sized items (4/8 16 x 2048: a CTA's edges; trace-*.json, trace-*.log), the splice tests with both builds
#   (forward.SPLICE_BLOCKED; gpu-splice.log), and a training step's kernels with each splice build on three
#   few-head shapes (step-kernels-splice*.json).
# forward: the forward's suite on the rso loop with its defaults (gpu-fwd.log), and the fused kernel timed beside
#   the two kernels at the default and with both fused A/Bs (stages-bwd-*.json).
# Every step has a time limit; later steps run when one fails.
set -uo pipefail
part=${1:?usage: scripts/gpu_ab_round.sh backward|forward OUTDIR}
out=${2:?usage: scripts/gpu_ab_round.sh backward|forward OUTDIR}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
quiet() { grep -v "^  \|Warning\|^$\|INFO" "$1" | tail -"${2:-3}"; }
if [ "$part" = backward ]; then
  timeout 150 python3 -m pytest -m gpu -q -rfEx -n 8 tests/test_gpu_hopper_backward.py -k "fused or own_plan" \
    > "$out/gpu-fused.log" 2>&1; echo "# exit status $?" >> "$out/gpu-fused.log"; quiet "$out/gpu-fused.log"
  for ab in "0 0" "1 0" "0 1" "1 1"; do
    set -- $ab
    FLASHGDN_HOPPER_FUSED_P_FIRST=$1 FLASHGDN_HOPPER_FUSED_LEAN_GATES=$2 timeout 50 \
      python3 benchmarks/fused_backward_trace.py --heads 16/32 --seqlens 4096,4096,4096,4096,4096,4096,4096,4096 \
      --out "$out/trace-16x32-p$1-g$2.json" > "$out/trace-p$1-g$2.log" 2>&1
    echo "# exit status $?" >> "$out/trace-p$1-g$2.log"; grep "median chunk step\|exit" "$out/trace-p$1-g$2.log"
  done
  timeout 50 python3 benchmarks/fused_backward_trace.py --heads 4/8 \
    --seqlens "$(python3 -c 'print(",".join(["2048"] * 16))')" --out "$out/trace-4x8-2048x16.json" \
    > "$out/trace-4x8.log" 2>&1; echo "# exit status $?" >> "$out/trace-4x8.log"
  grep "median chunk step\|edges\|exit" "$out/trace-4x8.log"
  timeout 80 python3 -m pytest -m gpu -q -rfEx -n 4 tests/test_gpu_hopper_cp.py -k splice > "$out/gpu-splice.log" 2>&1
  echo "# exit status $?" >> "$out/gpu-splice.log"; quiet "$out/gpu-splice.log"
  for sk in 0 1; do
    FLASHGDN_HOPPER_SPLICE_BLOCKED=$sk timeout 60 python3 benchmarks/step_kernels.py --cp auto --sequence \
      --shape 2/4:32768 --shape 1/4:131072 --shape 4/8:32768 --out "$out/step-kernels-splice$sk.json" \
      > "$out/step-kernels-splice$sk.log" 2>&1
    echo "# exit status $?" >> "$out/step-kernels-splice$sk.log"
    grep "kernels per step\|splice_kernel\|exit" "$out/step-kernels-splice$sk.log" | grep -v "^    "
  done
elif [ "$part" = forward ]; then
  FLASHGDN_TEST_CHUNK_LOOPS=rso timeout 200 python3 -m pytest -m gpu -q -rfEx -n 8 tests/test_gpu_hopper_forward.py \
    tests/test_gpu_hopper_stage1.py tests/test_gpu_hopper_plan.py > "$out/gpu-fwd.log" 2>&1
  echo "# exit status $?" >> "$out/gpu-fwd.log"; quiet "$out/gpu-fwd.log" 5
  for ab in "0 0" "1 1"; do
    set -- $ab
    FLASHGDN_HOPPER_FUSED_P_FIRST=$1 FLASHGDN_HOPPER_FUSED_LEAN_GATES=$2 timeout 70 python3 benchmarks/stage_timing.py \
      --backward-only --columns bwd_fused_kernel --out "$out/stages-bwd-p$1-g$2.json" > "$out/stages-bwd-p$1-g$2.log" 2>&1
    echo "# exit status $?" >> "$out/stages-bwd-p$1-g$2.log"
    grep "^{" "$out/stages-bwd-p$1-g$2.log" | cut -c1-200
  done
else
  echo "usage: scripts/gpu_ab_round.sh backward|forward OUTDIR" >&2
  exit 2
fi
