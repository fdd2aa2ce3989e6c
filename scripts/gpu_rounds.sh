#!/usr/bin/env bash
# On the GPU machine, from the project root with .device/ brought along (its TileLang stack and, if present, the
# kernel cache .device/kcache.tar.xz built here for sm_90a, and FlashQLA's, .device/anchor-kcache.tar.xz):
#   bash scripts/gpu_rounds.sh ROUND [ROUND...]
# runs each round of scripts/gpu_ab_round.sh in turn and packs its output folder into $OUT/ROUND.tgz (one file a
# round: a round writes many, and only a few come back from the machine).
set -u
source .device/setup.sh
# ours, and FlashQLA's builds for the benchmark sets compiled here by benchmarks/anchor_cache.py (its first calls then
# load them instead of compiling, ~160 s a head configuration); once per machine each
for cache in kcache anchor-kcache; do
  if [ -f ".device/$cache.tar.xz" ] && [ ! -f "/tmp/$cache.done" ]; then
    tar -xJf ".device/$cache.tar.xz" -C "$TILELANG_CACHE_DIR" && touch "/tmp/$cache.done"
  fi
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader
for r in "$@"; do
  echo "=== $r $(date -u +%H:%M:%S)"
  mkdir -p "/tmp/rounds/$r"
  bash scripts/gpu_ab_round.sh "$r" "/tmp/rounds/$r"
  tar -czf "${OUT:?}/$r.tgz" -C /tmp/rounds "$r"
done
echo "=== done $(date -u +%H:%M:%S)"
