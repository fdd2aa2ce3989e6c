#!/usr/bin/env bash
# What travels to the GPU machine, in KiB as the disk counts it (CONTRIBUTING.md: under 64 MiB in all): the tracked
# files, untracked files git does not ignore, and .device/; with the share of benchmarks/results/, which nothing on
# the GPU machine reads, so that a round whose caches need the room can move it out of the tree for the call.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
files() { git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done; }
tree_k=$(files | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
results_k=$(files | grep -z '^benchmarks/results/' | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
device_k=$([ -d .device ] && du -sk .device | cut -f1 || echo 0)
total=$((tree_k + device_k))
echo "tree ${tree_k} KiB (benchmarks/results/ ${results_k:-0}), .device/ ${device_k} KiB: ${total} KiB of 65536"
[ "$total" -lt 65536 ] || { echo "over the limit: move benchmarks/results/ out of the tree for the call, or ship less" >&2; exit 1; }
