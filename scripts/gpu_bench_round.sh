#!/usr/bin/env bash
# One GPU call after a change to the backward: the whole GPU suite, the training step's memory peak with and
# without CP, flashgdn's fwd and fwd+bwd on the bwd set, and the 12 canonical shapes that fill the GPU without CP
# which the cost model splits (two sequences, one long, on 32 value heads) with cp="off" and cp="auto" in one
# process each; logs into OUTDIR (8 files):
#   source .device/setup.sh && tar -xJf .device/kcache.tar.xz -C "$TILELANG_CACHE_DIR" && scripts/gpu_bench_round.sh "$OUT"
set -uo pipefail
out=${1:?usage: scripts/gpu_bench_round.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1

. scripts/gpu_steps.sh
gpu_suite "$out" "${GPU_ROUND_TEST_S:-200}"
memory_peaks "$out"

timeout 190 python3 -m flashgdn.bench --set bwd --impls flashgdn --time-budget 170 --no-plots --out-dir /tmp/b \
  --name bwd >> "$out/bench.log" 2>&1
echo "# exit status $?" >> "$out/bench.log"
cp /tmp/b/bwd.json "$out/" 2>/dev/null

for cp in off auto; do
  timeout 75 python3 -m flashgdn.bench --heads 8/32,16/32,32/32 \
    --seqlens 28672+4096,4096+28672,24576+8192,8192+24576 --modes fwd,fwdbwd --cp "$cp" --impls flashgdn \
    --time-budget 60 --no-plots --out-dir /tmp/b --name "full12-$cp" >> "$out/bench.log" 2>&1
  echo "# exit status $?" >> "$out/bench.log"
  cp "/tmp/b/full12-$cp.json" "$out/" 2>/dev/null
done
