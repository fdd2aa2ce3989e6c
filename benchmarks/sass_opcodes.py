"""What each role of a warp-specialised kernel executes, by opcode, from Nsight Compute's source page (CPU only);
two kernels side by side, each with its own roles, paired by name.

    python benchmarks/sass_opcodes.py benchmarks/results/h100/profiles/anchor-bwd-v0.33-sass-flashgdn.csv.xz \\
        --other benchmarks/results/h100/profiles/anchor-bwd-v0.33-sass-flashqla.csv.xz \\
        --other-roles "24=producer,144=K side,184=A side,160=state" \\
        --pair "value side=K side,gate side=A side,state=state,producer=producer" --per 65536

Each role's warp-level instructions executed, grouped by opcode (``HGMMA``, ``FFMA``, ``LDS``, ... without their
modifiers; the second kernel's then its difference from the first), divided by ``--per`` (CTAs x warps a role x chunk steps gives instructions a warp and step). The roles are
``sass_stalls.py``'s (split at ``USETMAXREG``, the out-of-line mbarrier retry loops given to the role that jumps to
them). ``SYNCS``, ``BRA`` and ``NANOSLEEP`` are mostly those retry loops: they count the waits, not the work, so each
role's total is printed with and without them.

Why: Nsight Compute's instruction statistics count the whole kernel; two kernels of the same structure (the fused
backward and FlashQLA's, notes "profile-anchor-bwd measured") differ in which role does how much of which work.
"""
import argparse
import sys
from collections import Counter
from typing import Dict, List, Optional, Tuple

from sass_stalls import FUSED_BACKWARD_ROLES, parse_roles, regions
from sass_wavefronts import number, opcode, read_rows

#: the opcodes of the mbarrier retry loops (waiting, not working)
WAIT_OPCODES = ("SYNCS", "BRA", "NANOSLEEP")


def opcode_mix(rows: List[Dict[str, str]], roles: Dict[int, str]) -> Dict[str, Counter]:
    """``{role: Counter(opcode without modifiers -> warp instructions executed)}``."""
    out: Dict[str, Counter] = {}
    for name, rs in regions(rows, roles):
        c: Counter = Counter()
        for r in rs:
            op = opcode(r.get("Source", "")).split(".")[0]
            if op:
                c[op] += number(r, "Instructions Executed")
        out[name] = c
    return out


def working(c: Counter) -> float:
    """Instructions executed less those of the retry loops."""
    return sum(v for k, v in c.items() if k not in WAIT_OPCODES)


def parse_pairs(text: Optional[str], a: Dict[str, Counter], b: Dict[str, Counter]) -> List[Tuple[str, str]]:
    """``"value side=K side,..."``: A's role beside B's; default: the roles both have, in A's order."""
    if not text:
        return [(n, n) for n in a if n in b]
    return [tuple(x.strip() for x in item.split("=", 1)) for item in text.split(",")]


def table(a: Dict[str, Counter], b: Optional[Dict[str, Counter]], pairs: List[Tuple[str, str]], per: float,
          top: int) -> str:
    out = []
    for ra, rb in pairs:
        ca = a.get(ra, Counter())
        cb = b.get(rb, Counter()) if b is not None else None
        head = f"== {ra}: {sum(ca.values()) / per:.0f} ({working(ca) / per:.0f} working)"
        if cb is not None:
            head += f"  |  {rb}: {sum(cb.values()) / per:.0f} ({working(cb) / per:.0f} working)"
        out.append(head)
        both = ca + cb if cb is not None else ca
        for op, _ in both.most_common(top):
            line = f"   {op:12s} {ca[op] / per:9.0f}"
            if cb is not None:
                line += f" {cb[op] / per:9.0f} {(cb[op] - ca[op]) / per:+9.0f}"
            out.append(line)
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="an ncu source-page CSV (plain or .xz)")
    ap.add_argument("--roles", default=None, help="REGS=NAME,... (default: the fused backward's roles)")
    ap.add_argument("--other", help="a second kernel's CSV, set beside the first")
    ap.add_argument("--other-roles", default=None, help="its REGS=NAME,... (default: as --roles)")
    ap.add_argument("--pair", default=None, help="ROLE=OTHER_ROLE,... (default: the roles of the same name)")
    ap.add_argument("--per", type=float, default=1.0, help="divide the counts by this (e.g. CTAs x 4 x steps)")
    ap.add_argument("--top", type=int, default=16, help="opcodes to list per role")
    args = ap.parse_args(argv)
    if args.per <= 0:
        ap.error("--per must be positive")
    roles = parse_roles(args.roles) if args.roles else dict(FUSED_BACKWARD_ROLES)
    a = opcode_mix(read_rows(args.csv), roles)
    b = None
    if args.other:
        b = opcode_mix(read_rows(args.other), parse_roles(args.other_roles) if args.other_roles else roles)
    pairs = parse_pairs(args.pair, a, b if b is not None else a)
    missing = [n for n, _ in pairs if n not in a] + ([m for _, m in pairs if m not in b] if b is not None else [])
    if missing:
        ap.error(f"--pair: no role named {', '.join(map(repr, missing))} (roles: {sorted(a)}"
                 + (f" and {sorted(b)})" if b is not None else ")"))
    print(table(a, b, pairs, args.per, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
