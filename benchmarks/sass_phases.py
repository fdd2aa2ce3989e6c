"""Where a barrier-phased kernel's time goes, phase by phase, from Nsight Compute's source page (CPU only).

    python benchmarks/sass_phases.py benchmarks/results/h100/profiles/stage1-v0.37d-32x32-sass.csv.xz [--names a,b,..]

Stage 1 (``kkt_inverse.py``) has one role on all of its threads and runs as a straight line of phases separated by
CTA barriers (``BAR.SYNC``): k's tile and K K^T, the cumsum, the diagonal blocks' substitution, the two levels of
merges, the gating and Ag's stores. ``sass_stalls.py`` splits a kernel by the registers its roles ask for, which says
nothing here. This script splits the SASS, in address order, after every ``BAR`` instruction (the last phase runs to the
kernel's end), and prints per phase: the stall samples and their share, the warp instructions executed, the shared-memory wavefronts,
the leading stall reasons and opcodes. ``--names`` labels the phases in order (the barrier count of a build is fixed,
so the labels can be read off its source once).

A warp-specialised kernel's role runs the same way inside its own step, between the named barriers of its warpgroup
(``BAR.SYNC 0x5, 0x80``): ``--role REGS`` keeps the code of the role whose ``USETMAXREG`` asks for REGS registers
(``sass_stalls.regions``, with the out-of-line retry loops of its waits) and splits that, e.g. ``--role 96`` for the
fused loop's gate warpgroup, whose samples then say which phase of its chain holds the chunk (its stalls at the
barrier after a phase that only some of its warps run are the others' wait for it).

Why: stage 1 is a third of the op where the forward is behind FlashInfer (32/32 and 16/16 on whole waves), and its
last profile (v0.20) predates the 16x16 diagonal blocks and the warp-mma merges. Which phase holds its samples says
whether a cheaper inverse (fp16 merges, ``inverse_numerics.py``) or the phases around it are worth building.
"""
import argparse
import sys
from collections import Counter
from typing import Dict, List, Tuple

from sass_stalls import SAMPLES, reasons, regions
from sass_wavefronts import number, opcode, read_rows

WAVEFRONTS = "L1 Wavefronts Shared"


def phases(rows: List[Dict[str, str]]) -> List[List[Dict[str, str]]]:
    """The rows cut after every barrier: each phase ends with its ``BAR`` (the last one runs to the end)."""
    out: List[List[Dict[str, str]]] = [[]]
    for r in rows:
        out[-1].append(r)
        if opcode(r.get("Source", "")).split(".")[0] == "BAR":
            out.append([])
    return [p for p in out if p]


def phase_table(rows: List[Dict[str, str]], names: List[str], opcodes: int = 4) -> Tuple[str, List[dict]]:
    total = sum(number(r, SAMPLES) for r in rows) or 1.0
    stats = []
    lines = ["| phase | instructions (static) | samples | share | executed | shared wavefronts | reasons | opcodes |",
             "|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(phases(rows)):
        s = sum(number(r, SAMPLES) for r in p)
        ex = sum(number(r, "Instructions Executed") for r in p)
        wf = sum(number(r, WAVEFRONTS) for r in p)
        why = reasons(p)
        ops: Counter = Counter()
        for r in p:
            ops[opcode(r.get("Source", "")).split(".")[0]] += number(r, "Instructions Executed")
        name = names[i] if i < len(names) else f"phase {i}"
        stats.append(dict(name=name, samples=s, share=s / total, executed=ex, wavefronts=wf, static=len(p)))
        lines.append(
            f"| {name} | {len(p)} | {s:.0f} | {s / total:.1%} | {ex:.0f} | {wf:.0f} | "
            + ", ".join(f"{k} {v / s:.0%}" for k, v in why.most_common(3) if s and v > 0) + " | "
            + ", ".join(f"{k} {v:.0f}" for k, v in ops.most_common(opcodes) if v > 0) + " |")
    return "\n".join(lines), stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu source-page CSV (plain or .xz)")
    ap.add_argument("--names", default="", help="comma-separated labels of the phases, in order")
    ap.add_argument("--role", type=int, default=None,
                    help="only the code of the role that asks for this many registers (USETMAXREG)")
    args = ap.parse_args(argv)
    rows = read_rows(args.csv)
    if args.role is not None:
        rows = dict(regions(rows, {args.role: "role"})).get("role", [])
        if not rows:
            ap.error(f"no role asks for {args.role} registers in {args.csv}")
    table, stats = phase_table(rows, [n for n in args.names.split(",") if n])
    total = sum(number(r, SAMPLES) for r in rows)
    print(f"{len(rows)} instructions, {len(stats)} phases, {total:.0f} stall samples, "
          f"{sum(number(r, WAVEFRONTS) for r in rows):.0f} shared wavefronts")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
