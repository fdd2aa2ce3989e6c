#!/usr/bin/env bash
# The open A/Bs and the sets the last changes move, on the GPU, in calls of under ten minutes each, on the GPU
# machine from the project root (OUTDIR best a local folder packed afterwards: the parts write many files):
#   source .device/setup.sh && scripts/gpu_ab_round.sh splice OUTDIR
#   source .device/setup.sh && scripts/gpu_ab_round.sh bwd-set OUTDIR
# splice: the CP suite (every splice build, both directions; gpu-cp.log), the splice alone by build
#   (splice-timing.json: plain against blocked, the forward's blocked build with its 4 x 4 transposes,
#   forward.SPLICE_BLOCKED_FORWARD), and a training step's kernels with the forward splice plain and blocked on
#   four few-head shapes (step-kernels-fwd{0,1}.json); the backward's own-plan tests both ways and the same step
#   with the backward started from the forward's segment starts (backend.CP_REUSE_STARTS; gpu-bwd-plan.log,
#   step-kernels-reuse.json).
# bwd-set: the bwd set's fwd+bwd with the reverse splice blocked (the default since v0.16c), flashgdn beside
#   FlashQLA in one process, with both peak memories (bwd-set.json).
# Every step has a time limit; later steps run when one fails.
set -uo pipefail
part=${1:?usage: scripts/gpu_ab_round.sh splice|bwd-set OUTDIR}
out=${2:?usage: scripts/gpu_ab_round.sh splice|bwd-set OUTDIR}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
quiet() { grep -v "^  \|Warning\|^$\|INFO" "$1" | tail -"${2:-3}"; }
if [ "$part" = splice ]; then
  timeout 120 python3 -m pytest -m gpu -q -rfEx -n 8 tests/test_gpu_hopper_cp.py > "$out/gpu-cp.log" 2>&1
  echo "# exit status $?" >> "$out/gpu-cp.log"; quiet "$out/gpu-cp.log"
  timeout 60 python3 benchmarks/splice_timing.py --heads 4,8,16,32 --segments 2,32 \
    --builds plain:8,blocked:8,blocked:16 --out "$out/splice-timing.json" > "$out/splice-timing.log" 2>&1
  echo "# exit status $?" >> "$out/splice-timing.log"; grep -i "mismatch\|exit" "$out/splice-timing.log"
  for fwd in 0 1; do
    FLASHGDN_HOPPER_SPLICE_BLOCKED_FORWARD=$fwd timeout 60 python3 benchmarks/step_kernels.py --cp auto --sequence \
      --shape 2/4:32768 --shape 1/4:131072 --shape 4/8:32768 --shape 16/32:32768 \
      --out "$out/step-kernels-fwd$fwd.json" > "$out/step-kernels-fwd$fwd.log" 2>&1
    echo "# exit status $?" >> "$out/step-kernels-fwd$fwd.log"; grep "kernels per step\|exit" "$out/step-kernels-fwd$fwd.log"
  done
  timeout 90 python3 -m pytest -m gpu -q -rfEx -n 6 tests/test_gpu_hopper_backward.py -k own_plan \
    > "$out/gpu-bwd-plan.log" 2>&1
  echo "# exit status $?" >> "$out/gpu-bwd-plan.log"; quiet "$out/gpu-bwd-plan.log"
  FLASHGDN_HOPPER_CP_REUSE_STARTS=1 timeout 60 python3 benchmarks/step_kernels.py --cp auto --sequence \
    --shape 2/4:32768 --shape 1/4:131072 --shape 4/8:32768 --shape 16/32:32768 \
    --out "$out/step-kernels-reuse.json" > "$out/step-kernels-reuse.log" 2>&1
  echo "# exit status $?" >> "$out/step-kernels-reuse.log"; grep "kernels per step\|exit" "$out/step-kernels-reuse.log"
elif [ "$part" = bwd-set ]; then
  timeout 560 python3 -m flashgdn.bench --set bwd --impls flashgdn,flashqla --modes fwdbwd --time-budget 520 \
    --no-plots --out-dir "$out" --name bwd-set > "$out/bwd-set.log" 2>&1
  echo "# exit status $?" >> "$out/bwd-set.log"; tail -3 "$out/bwd-set.log"
else
  echo "usage: scripts/gpu_ab_round.sh splice|bwd-set OUTDIR" >&2
  exit 2
fi
