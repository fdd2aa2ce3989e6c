"""Stage 1 (``kkt_inverse``) with its build options, side by side in one process (GPU only).

    python benchmarks/kkt_options.py --options triangle --rounds 3 --out X.json

For each shape, the build without options (five CTAs per SM, k by cp.async; named "default" in the output) and each
option set are run on the same inputs: g~ and Ag (and A with ``--store-inverse``) must come out with the same bits
as the base's (``--base``, "default" unless given), and each is timed by CUDA-graph replay
(``flashgdn.bench.timing.measure``), in rotating order over ``--rounds`` rounds so that no build always runs first.
Ratios are of the medians over rounds, option / base; with another base than "default" the build without options is
not run. An option set joins flags (``diag16+mma32``) and integer
settings (``blocks_per_sm=7``) with "+".

An option that rounds differently (``diag16``: tf32 products where the default substitutes in fp32) is run with
``--max-diff X``: g~ must still have the same bits, and Ag (and A) may differ from the default's by a relative RMS of at
most X (``max_rel_diff`` in each row). Accuracy against the float64 oracle is for the GPU tests.
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = [  # (Hqk, Hv, seqlens): the GPU full, groups of one to four, then a few-CTA shape
    (16, 32, [4096] * 8),
    (32, 32, [4096] * 8),
    (16, 16, [8192] * 4),
    (16, 64, [4096] * 8),
    (16, 48, [8192] * 4),
    (8, 32, [4096] * 8),
    (4, 16, [8192] * 4),
    (2, 8, [1024] * 8),
]


def parse_shapes(spec: str):
    """"16/32:4096x8,2/8:1024x8" -> [(16, 32, [4096] * 8), (2, 8, [1024] * 8)]."""
    shapes = []
    for item in spec.split(","):
        try:
            heads, lens = item.split(":")
            Hqk, Hv = map(int, heads.split("/"))
            L, n = map(int, lens.split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: expected HQK/HV:LENxCOUNT items, got {item!r}")
        if Hqk < 1 or Hv % Hqk or L < 1 or n < 1:
            raise SystemExit(f"--shapes: {item!r} needs Hv a multiple of Hqk and positive lengths")
        shapes.append((Hqk, Hv, [L] * n))
    return shapes


def parse_options(spec: str) -> dict:
    """"diag16+mma32+blocks_per_sm=7" -> {"diag16": True, "mma32": True, "blocks_per_sm": 7}."""
    options = {}
    for token in spec.split("+"):
        name, eq, value = token.partition("=")
        if not name or (eq and not value.isdigit()):
            raise SystemExit(f"--options: expected FLAG or NAME=INT items joined by '+', got {spec!r}")
        options[name] = int(value) if eq else True
    return options


def main(argv=None) -> int:
    from flashgdn.bench.timing import measure, timed_call
    from flashgdn.kernels.hopper.forward import chunk_plan
    from flashgdn.kernels.hopper.kkt_inverse import build_kkt_inverse
    from flashgdn.reference.metrics import rel_rms
    from stage_timing import make, results_header

    ap = argparse.ArgumentParser()
    ap.add_argument("--options", default="triangle",
                    help="option sets, comma separated, each a +-joined list of build_kkt_inverse flags or "
                         "NAME=INT settings (e.g. diag16+mma32+blocks_per_sm=7)")
    ap.add_argument("--base", default="default",
                    help="the set the others are compared with, bits and time: \"default\" (no options) or one of "
                         "--options")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--store-inverse", action="store_true", help="the backward's build (A stored as well)")
    ap.add_argument("--shapes", default=None, help="e.g. 16/32:4096x8,32/32:4096x8 (default: SHAPES)")
    ap.add_argument("--max-diff", type=float, default=None,
                    help="pass on Ag (and A) within this relative RMS of the default's instead of equal bits")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sets = {"default": {}}
    for spec in args.options.split(","):
        sets[spec] = parse_options(spec)
    if args.base not in sets:
        raise SystemExit(f"--base: {args.base!r} is neither \"default\" nor one of --options")
    if args.base != "default":  # the build without options is then not asked for
        del sets["default"]
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    rows = []
    ok = True
    for Hqk, Hv, seqlens in shapes:
        q, k, v, g, beta, h0, cu = make(Hqk, Hv, seqlens)
        T, N = k.shape[1], len(seqlens)
        bounds, _ = chunk_plan(cu, T, N)
        S = bounds.shape[0]
        live = bounds[:, 1] > 0
        g32, b32 = g.float().contiguous(), beta.float().contiguous()
        runs, outs = {}, {}
        for name, opts in sets.items():
            kernel = build_kkt_inverse(Hqk, Hv, 128, "bfloat16", "bfloat16", store_inverse=args.store_inverse,
                                       **{"async_loads": True, "blocks_per_sm": 5, **opts})
            gcum = torch.full((Hv, S * 64), float("nan"), device="cuda")
            Ag = torch.full((S, Hv, 64, 64), float("nan"), device="cuda", dtype=k.dtype)
            call = [k, g32, b32, bounds, gcum, Ag] + ([torch.full_like(Ag, float("nan"))] if args.store_inverse else [])
            runs[name] = (lambda kernel=kernel, call=call: kernel(*call))
            runs[name]()
            torch.cuda.synchronize()
            outs[name] = [gcum.view(Hv, S, 64)[:, live].clone(), Ag[live].clone()] + (
                [call[-1][live].clone()] if args.store_inverse else [])
        times = {name: [] for name in sets}
        names = list(sets)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                _, dt = timed_call(runs[name], torch.device("cuda"))
                times[name].append(measure(runs[name], torch.device("cuda"), dt).ms)
        ref = args.base
        base = statistics.median(times[ref])
        row = {"h_qk": Hqk, "h_v": Hv, "seqlens": seqlens, "base": ref,
               "ms": {n: statistics.median(t) for n, t in times.items()}, "ms_rounds": times}
        row["ratio"] = {n: row["ms"][n] / base for n in sets if n != ref}
        row["same_bits"] = {n: all(torch.equal(a, b) for a, b in zip(outs[ref], outs[n])) for n in sets if n != ref}
        row["max_rel_diff"] = {n: max(rel_rms(b, a) for a, b in zip(outs[ref], outs[n])) for n in sets if n != ref}
        row["finite"] = all(bool(torch.isfinite(t.float()).all()) for o in outs.values() for t in o)
        for n in row["same_bits"]:
            close = (args.max_diff is not None and torch.equal(outs[ref][0], outs[n][0])
                     and row["max_rel_diff"][n] <= args.max_diff)
            ok &= row["same_bits"][n] or close
        ok &= row["finite"]
        rows.append(row)
        print(f"{Hqk}/{Hv} {seqlens[0]}x{len(seqlens)}: {ref} {base:.4f} ms; "
              + "; ".join(f"{n} {row['ratio'][n]:.3f}x"
                          + ('' if row['same_bits'][n] else f" (BITS DIFFER, max rel diff {row['max_rel_diff'][n]:.1e})")
                          for n in row["ratio"]), flush=True)
    for n in sets:
        if n == args.base:
            continue
        rs = [r["ratio"][n] for r in rows]
        print(f"{n}: geometric mean {statistics.geometric_mean(rs):.3f}x, {min(rs):.3f}x-{max(rs):.3f}x")
    if args.out:
        out = {**results_header(argv, "kkt_options.py"), "store_inverse": args.store_inverse,
               "max_diff": args.max_diff, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
