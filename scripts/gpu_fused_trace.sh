#!/usr/bin/env bash
# Where the fused backward's chunk step goes, on the GPU machine from the project root:
#   source .device/setup.sh && scripts/gpu_fused_trace.sh "$OUT"
# 1. the trace build's GPU test (the same bits as the default build, stamps in program order): gpu-trace.log;
# 2. benchmarks/fused_backward_trace.py on a full shape and on CP-sized segments: trace-16x32.json,
#    trace-2x8-segments.json, and their printed summaries in trace.log (per role, the median cycle of each point
#    from the value side's start of the chunk step; fused_backward.TRACE_POINTS_OF names the points).
set -uo pipefail
out=${1:?usage: scripts/gpu_fused_trace.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -m gpu -q -rfEx tests/test_gpu_hopper_backward.py -k trace_build > "$out/gpu-trace.log" 2>&1
echo "# exit status $?" >> "$out/gpu-trace.log"
{
  timeout 100 python3 benchmarks/fused_backward_trace.py --heads 16/32 \
    --seqlens 4096,4096,4096,4096,4096,4096,4096,4096 --out "$out/trace-16x32.json"
  timeout 100 python3 benchmarks/fused_backward_trace.py --heads 2/8 \
    --seqlens "$(python3 -c 'print(",".join(["1024"] * 32))')" --out "$out/trace-2x8-segments.json"
} > "$out/trace.log" 2>&1
echo "# exit status $?" >> "$out/trace.log"
