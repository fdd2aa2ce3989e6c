#!/usr/bin/env bash
# On the GPU machine (it has cuobjdump; this machine has not), from the project root with .device/ brought along:
#   OUT=DIR bash scripts/sass_segments.sh [CUBIN_DIR]
# disassembles every cubin of CUBIN_DIR (default .device/sass, made by benchmarks/stage1_cubins.py) into DIR/NAME.sass and
# prints, a line per build, its SASS instructions between CTA barriers (BAR.SYNC) in program order, the last number
# after the last barrier.
set -u
dis=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
for f in "${1:-.device/sass}"/*.cubin; do
  b=$(basename "$f" .cubin)
  "$dis" -sass "$f" > "${OUT:?}/$b.sass"
  awk -v name="$b" '/\/\*[0-9a-f]+\*\/ /{n++; if ($0 ~ /BAR\.SYNC/) {printf "%d ", n; n=0}} END {printf "%d  %s\n", n, name}' \
    "$OUT/$b.sass"
done
