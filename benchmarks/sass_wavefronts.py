"""Where a kernel's shared-memory wavefronts go, from Nsight Compute's per-instruction source page (CPU only).

    python benchmarks/sass_wavefronts.py benchmarks/results/h200/profiles/forward-v0.12-rso-sass.csv.xz [--top 20]

Reads the CSV that ``scripts/profile_h200.sh`` writes (``ncu --page source --csv --print-source sass``, plain or
xz-compressed) and prints, for the kernel in it:

1. the shared-memory wavefronts in all and their ideal count (``L1 Wavefronts Shared`` and ``... Ideal``), and the
   stall samples;
2. the wavefronts by opcode (LDS.U16, HGMMA..., STS), each with its ideal count and executed instructions: an
   opcode whose wavefronts exceed its ideal has bank conflicts;
3. the instructions with the most excess wavefronts, with their per-instruction ratio.

What it answered at v0.12 (docs/hopper-notes.md): the rso loop's V^T reads (LDS.U16, 4-way conflicts, 23% of its
wavefronts) and where ``kkt_inverse``'s wavefronts go.
"""
import argparse
import csv
import io
import lzma
import sys
from collections import Counter
from typing import Dict, List, Tuple


def ncu_kernels(path: str) -> List[Tuple[str, List[Dict[str, str]]]]:
    """Each kernel's instruction rows of the CSV, which may hold several kernels, each after its ``"Kernel
    Name","..."`` line, in the file's order (a kernel without that line is named ``?``)."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", newline="") as fh:
        lines = list(csv.reader(io.StringIO(fh.read())))
    out: List[Tuple[str, List[Dict[str, str]]]] = []
    header = None
    for r in lines:
        if r and r[0] == "Kernel Name":
            header = None
            out.append((r[1] if len(r) > 1 else "?", []))
        elif r and r[0] == "Address":
            header = r
            if not out:
                out.append(("?", []))
        elif header is not None and len(r) == len(header):
            out[-1][1].append(dict(zip(header, r)))
    return [(n, rows) for n, rows in out if rows]


def read_rows(path: str) -> List[Dict[str, str]]:
    """The instruction rows of the CSV's first kernel (the lines before its header row, e.g. the kernel's name, are
    skipped)."""
    kernels = ncu_kernels(path)
    if not kernels:
        raise ValueError(f"{path}: no instruction rows after an \"Address\" header")
    return kernels[0][1]


def number(row: Dict[str, str], key: str) -> float:
    try:
        return float(row.get(key, "").replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    words = source.split()
    if not words:
        return ""
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def summarize(rows: List[Dict[str, str]], top: int = 20) -> str:
    wf, ideal = "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal"
    total, total_ideal = sum(number(r, wf) for r in rows), sum(number(r, ideal) for r in rows)
    samples = sum(number(r, "Warp Stall Sampling (All Samples)") for r in rows)
    by_op, by_op_ideal, by_op_instr = Counter(), Counter(), Counter()
    for r in rows:
        op = opcode(r.get("Source", ""))
        by_op[op] += number(r, wf)
        by_op_ideal[op] += number(r, ideal)
        by_op_instr[op] += number(r, "Instructions Executed")
    out = [f"shared wavefronts {total:.0f}, ideal {total_ideal:.0f} (excess {total - total_ideal:.0f}); "
           f"stall samples {samples:.0f}", "", "| opcode | wavefronts | share | ideal | instructions |",
           "|---|---|---|---|---|"]
    for op, v in by_op.most_common():
        if v <= 0:
            break
        out.append(f"| {op} | {v:.0f} | {v / total:.3f} | {by_op_ideal[op]:.0f} | {by_op_instr[op]:.0f} |")
    excess = sorted(((number(r, wf) - number(r, ideal), i, r) for i, r in enumerate(rows)),
                    key=lambda t: (-t[0], t[1]))
    out += ["", "| instruction (index, source) | excess wavefronts | wavefronts per execution |", "|---|---|---|"]
    for ex, i, r in excess[:top]:
        if ex <= 0:
            break
        per = number(r, wf) / max(1.0, number(r, "Instructions Executed"))
        out.append(f"| {i}: {r.get('Source', '').strip()[:70]} | {ex:.0f} | {per:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", help="ncu source-page CSV (plain or .xz)")
    ap.add_argument("--top", type=int, default=20, help="instructions with the most excess wavefronts to list")
    args = ap.parse_args(argv)
    print(summarize(read_rows(args.csv), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
