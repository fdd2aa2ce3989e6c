#!/usr/bin/env bash
# The two kernel caches that travel to the GPU machine in .device/ (CONTRIBUTING.md), compiled here for sm_90a. From
# the project root, after ../shared/device/pack.sh (a fresh clone has neither .device/ nor its caches):
#   bash scripts/device_caches.sh HEADS [SETS]
# HEADS (e.g. 2/8,4/16): the default training builds of those head configurations (python -m flashgdn.precompile
#   --kernels training --flags common), and the same again under each setting of DEVICE_CACHE_SWITCHES (space-separated
#   VAR=VALUE, e.g. "FLASHGDN_HOPPER_FUSED_AG_FROM_A=1" for a round that times that switch), exported and packed as
#   .device/kcache.tar.xz. DEVICE_CACHE_DTYPES (default bfloat16; e.g. bfloat16,float16) are the builds' q/k/v dtypes.
# SETS (e.g. cp or cp,bwd; optional): FlashQLA's builds for those benchmark sets (benchmarks/anchor_cache.py, on the
#   flash_qla package of .device/stack.tar.xz; ANCHOR_HEADS=HQK/HV,... for those head configurations of the sets
#   only), packed as .device/anchor-kcache.tar.xz.
# SERVING_HEADS (e.g. the canonical set's 2/8,4/16,8/24,8/32,16/16,16/32,16/48,16/64,32/32; optional): the serving builds
#   of those head configurations too, into the same packed cache, for a round that runs the canonical forward beside
#   one on the sets.
# JOBS (default: the CPU count) compiles that many at once. scripts/gpu_rounds.sh unpacks both on the GPU machine.
# Checking a packed cache against the code as it is now: python3 -m flashgdn.precompile ... --expect-cached, with
#   TILELANG_CACHE_DIR set to a folder the cache was unpacked into (the script does it for its own heads and settings).
set -euo pipefail
heads=${1:?usage: bash scripts/device_caches.sh HEADS [SETS]}
sets=${2:-}
jobs=${JOBS:-$(nproc)}
[ -f .device/setup.sh ] || { echo "no .device/: run ../shared/device/pack.sh first" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# ours: each setting's builds into one development cache, exported (just those entries) into one folder
for setting in "" ${DEVICE_CACHE_SWITCHES:-}; do
  echo "== our training builds for $heads${setting:+ with $setting}"
  env TILELANG_CACHE_DIR="$work/cache" $setting python3 -m flashgdn.precompile --heads "$heads" --kernels training \
    --flags common --dtypes "${DEVICE_CACHE_DTYPES:-bfloat16}" --jobs "$jobs" --export "$work/ours" | tail -2
done
if [ -n "${SERVING_HEADS:-}" ]; then
  echo "== our serving builds for $SERVING_HEADS"
  env TILELANG_CACHE_DIR="$work/cache" python3 -m flashgdn.precompile --heads "$SERVING_HEADS" --kernels serving \
    --flags common --dtypes "${DEVICE_CACHE_DTYPES:-bfloat16}" --jobs "$jobs" --export "$work/ours" | tail -2
fi
tar -cf - -C "$work/ours" . | xz -9 > .device/kcache.tar.xz
echo "ours: $(find "$work/ours" -name executable.so | wc -l) entries, $(du -h .device/kcache.tar.xz | cut -f1)"
# the packed cache, unpacked alone, must hold every build of every setting as the code now makes it (a kernel file
# edited while this ran would leave some out, and the GPU machine would compile them on its own time)
mkdir -p "$work/check"
tar -xJf .device/kcache.tar.xz -C "$work/check"
for setting in "" ${DEVICE_CACHE_SWITCHES:-}; do
  env TILELANG_CACHE_DIR="$work/check" $setting python3 -m flashgdn.precompile --heads "$heads" --kernels training \
    --flags common --dtypes "${DEVICE_CACHE_DTYPES:-bfloat16}" --jobs "$jobs" --expect-cached | tail -1
done
if [ -n "${SERVING_HEADS:-}" ]; then
  env TILELANG_CACHE_DIR="$work/check" python3 -m flashgdn.precompile --heads "$SERVING_HEADS" --kernels serving \
    --flags common --dtypes "${DEVICE_CACHE_DTYPES:-bfloat16}" --jobs "$jobs" --expect-cached | tail -1
fi

if [ -n "$sets" ]; then
  echo "== FlashQLA's builds for the sets $sets"
  mkdir -p "$work/site"
  tar -xJf .device/stack.tar.xz -C "$work/site" ./flash_qla
  TILELANG_CACHE_DIR="$work/anchor" python3 benchmarks/anchor_cache.py --site "$work/site" --set "$sets" --compile \
    --jobs "$jobs" ${ANCHOR_HEADS:+--only-heads "$ANCHOR_HEADS"} | grep -v '^  '
  tar -cf - -C "$work/anchor" . | xz -9 > .device/anchor-kcache.tar.xz
  echo "FlashQLA's: $(du -h .device/anchor-kcache.tar.xz | cut -f1)"
fi
du -sh .device
