"""Where a warp-specialised kernel's stall samples go, role by role, from Nsight Compute's source page (CPU only).

    python benchmarks/sass_stalls.py benchmarks/results/h200/profiles/backward-v0.14b-fused-sass.csv.xz
    python benchmarks/sass_stalls.py A.csv.xz B.csv.xz --top 8      # an A/B: each role's samples side by side

Reads the CSV that ``ncu --page source --csv --print-source sass`` writes (plain or xz-compressed;
``scripts/profile_h200.sh`` and ``scripts/gpu_ab_round.sh``'s ``profile-fused`` round make them). The SASS of a kernel
whose warpgroups each set their registers (``T.set_max_nreg``, ``USETMAXREG`` in the SASS) is split at those
instructions into regions, one per role, named by the register count a role asks for (the fused backward's
``STATE_REGS``, ``VALUE_REGS``, ``GATE_REGS``, ``PRODUCER_REGS``: 160, 168, 144, 40, unless given otherwise with
``--roles``); the code before the first is the common preamble. For each role it prints the warp stall samples, the
instructions executed, the stall reasons that hold most of its samples, and the instructions with the most samples.

Why: the fused backward's trace build (``fused_backward_trace.py``) stamps cycles per phase of one CTA, and its stamps
change the schedule. v0.27a-b (docs/hopper-notes.md) found reorderings that cut the trace build's cycles a step and
made the plain build slower at the same clock: the plain build's own stall samples, split by role, are what can say
where its time goes.
"""
import argparse
import sys
from collections import Counter
from typing import Dict, List, Optional, Tuple

from sass_wavefronts import number, read_rows

#: the fused backward's roles by the registers each asks for (fused_backward.py)
FUSED_BACKWARD_ROLES = {160: "state", 168: "value side", 144: "gate side", 40: "producer"}
SAMPLES = "Warp Stall Sampling (All Samples)"


def _target(source: str) -> Optional[int]:
    """The address a branch jumps to (``@!P0 BRA 0x7ef88e824290``), or None."""
    words = source.replace(",", " ").split()
    if "BRA" in words and words[-1].startswith("0x"):
        return int(words[-1], 16)
    return None


def regions(rows: List[Dict[str, str]], roles: Dict[int, str]) -> List[Tuple[str, List[Dict[str, str]]]]:
    """The rows split at each ``USETMAXREG``: ``[(name, rows)]`` in code order, the preamble first. A region is named
    by its register count (``roles``' name for it, else the count). ptxas puts the retry loops of mbarrier waits
    (``SYNCS.PHASECHK``, ``NANOSLEEP``) out of line after the last role's code: those rows go to the role whose branch
    jumps to them (each row after such a target belongs to the nearest target above it)."""
    named: List[Tuple[str, Dict[str, str]]] = []
    name, first_last = "preamble", 0  # the last region's name and its first row
    for i, r in enumerate(rows):
        source = r.get("Source", "")
        if "USETMAXREG" in source:
            regs = int(source.split()[-1], 16)
            name, first_last = roles.get(regs, f"{regs} registers"), i
        named.append((name, r))
    last = name
    jumps: Dict[int, str] = {}
    for n, r in named:
        t = _target(r.get("Source", ""))
        if t is not None and n != last:
            jumps.setdefault(t, n)
    owner = last
    for i in range(first_last, len(named)):
        addr = named[i][1].get("Address", "")
        try:
            a = int(addr, 16)
        except ValueError:
            a = None
        if a in jumps:
            owner = jumps[a]
        named[i] = (owner, named[i][1])
    merged: Dict[str, List[Dict[str, str]]] = {}
    for n, r in named:  # a role whose code sits in pieces counts once
        merged.setdefault(n, []).append(r)
    return list(merged.items())


def reasons(rows: List[Dict[str, str]]) -> Counter:
    """Stall samples by reason (the ``stall_*`` columns, issued or not) over ``rows``."""
    c: Counter = Counter()
    for r in rows:
        for key in r:
            if key.startswith("stall_") and "(Not Issued)" not in key:
                c[key[len("stall_"):]] += number(r, key)
    return c


def role_summary(name: str, rows: List[Dict[str, str]], total: float, top: int) -> List[str]:
    samples = sum(number(r, SAMPLES) for r in rows)
    executed = sum(number(r, "Instructions Executed") for r in rows)
    why = reasons(rows)
    out = [f"{name}: {samples:.0f} stall samples ({samples / max(total, 1):.1%}), {executed:.0f} instructions executed"]
    if samples:
        out.append("  reasons: " + ", ".join(f"{k} {v / samples:.0%}" for k, v in why.most_common(5) if v > 0))
    ranked = sorted(((number(r, SAMPLES), i, r) for i, r in enumerate(rows)), key=lambda t: (-t[0], t[1]))
    for s, _, r in ranked[:top]:
        if s <= 0:
            break
        mine = reasons([r]).most_common(1)
        out.append(f"  {s:7.0f}  {r.get('Source', '').strip()[:72]:72s}  {mine[0][0] if mine else ''}")
    return out


def summarize(rows: List[Dict[str, str]], roles: Dict[int, str], top: int = 8) -> str:
    total = sum(number(r, SAMPLES) for r in rows)
    out = [f"{len(rows)} instructions, {total:.0f} stall samples"]
    for name, rs in regions(rows, roles):
        out += role_summary(name, rs, total, top)
    return "\n".join(out)


def compare(a: List[Dict[str, str]], b: List[Dict[str, str]], roles: Dict[int, str]) -> str:
    """Each role's samples and leading reasons in A and B (two builds of one kernel, profiled the same way): the
    ratio B / A per role, and per reason within it."""
    ra, rb = dict(regions(a, roles)), dict(regions(b, roles))
    ta, tb = (sum(number(r, SAMPLES) for r in x) for x in (a, b))
    out = [f"stall samples: A {ta:.0f}, B {tb:.0f} (B / A {tb / max(ta, 1):.3f})",
           "| role | A samples | B samples | B / A | reasons, A -> B (samples) |", "|---|---|---|---|---|"]
    for name in list(ra) + [n for n in rb if n not in ra]:
        sa = sum(number(r, SAMPLES) for r in ra.get(name, []))
        sb = sum(number(r, SAMPLES) for r in rb.get(name, []))
        why_a, why_b = reasons(ra.get(name, [])), reasons(rb.get(name, []))
        keys = [k for k, _ in (why_a + why_b).most_common(4)]
        detail = ", ".join(f"{k} {why_a[k]:.0f} -> {why_b[k]:.0f}" for k in keys if why_a[k] + why_b[k] > 0)
        out.append(f"| {name} | {sa:.0f} | {sb:.0f} | {sb / sa if sa else float('nan'):.3f} | {detail} |")
    return "\n".join(out)


def parse_roles(text: Optional[str]) -> Dict[int, str]:
    """``--roles 160=state,168=value``: register counts to names (default: the fused backward's)."""
    if not text:
        return dict(FUSED_BACKWARD_ROLES)
    return {int(k): v for k, v in (item.split("=", 1) for item in text.split(","))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", help="one ncu source-page CSV, or two (A and B) to compare")
    ap.add_argument("--top", type=int, default=8, help="instructions with the most samples to list per role")
    ap.add_argument("--roles", default=None, help="REGS=NAME,... (default: the fused backward's roles)")
    args = ap.parse_args(argv)
    if len(args.csv) > 2:
        ap.error("one CSV, or two to compare")
    roles = parse_roles(args.roles)
    tables = [read_rows(p) for p in args.csv]
    for path, rows in zip(args.csv, tables):
        print(f"== {path}")
        print(summarize(rows, roles, args.top))
    if len(tables) == 2:
        print("== A/B")
        print(compare(*tables, roles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
