# Steps the GPU call scripts share (scripts/gpu_round.sh, scripts/gpu_bench_round.sh); sourced, run from the project
# root, each logging into the OUTDIR given first.

# The whole GPU suite (gpu-suite.log) within LIMIT_S seconds on GPU_ROUND_WORKERS pytest-xdist workers (default 8),
# so that kernels missing from the cache compile on the CPU cores side by side; without the harness test, which
# runs every anchor (~5 min of FlashQLA compiles; GPU_ROUND_HARNESS=1 includes it).
gpu_suite() {
  local out=$1 limit=$2
  local deselect=(--deselect tests/test_bench_cli.py::test_harness_on_the_gpu)
  [ "${GPU_ROUND_HARNESS:-0}" = 1 ] && deselect=()
  timeout "$limit" python3 -m pytest -m gpu -q -rfEx --durations=15 -n "${GPU_ROUND_WORKERS:-8}" "${deselect[@]}" \
    > "$out/gpu-suite.log" 2>&1
  echo "# exit status $?" >> "$out/gpu-suite.log"
}

# Where one training step's peak memory is, 16/32 32768x1 with CP as CP says (memory-peak-NAME.json, appended to
# memory-peak.log; benchmarks/memory_peak.py), under the environment the caller gives it.
memory_peak() {
  local out=$1 name=$2 cp=$3
  timeout 60 python3 benchmarks/memory_peak.py --case 16/32:32768 --cp "$cp" \
    --out "$out/memory-peak-$name.json" >> "$out/memory-peak.log" 2>&1
  echo "# exit status $? ($name)" >> "$out/memory-peak.log"
}

# The same with and without CP (memory-peak-{auto,off}.json).
memory_peaks() {
  local out=$1 cp
  for cp in auto off; do
    memory_peak "$out" "$cp" "$cp"
  done
}
