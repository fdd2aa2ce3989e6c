"""The splice kernel alone: time per chain step, by build, heads and segments (GPU only; CUDA events).

    python benchmarks/splice_timing.py --heads 4,8,32 --segments 8,32 --builds plain:8,blocked:8 --out splice.json

Each case is one sequence of ``S`` segments: its transition pairs (M near 0.9 I, as a decaying segment's are, and b
random), a start state, and for the reverse splice a D per segment; the splice then makes ``S - 1`` dependent
steps, so the time per step is the slope of the kernel's time over S. A build is ``plain:BV`` (``splice.py``'s
128-thread steps over BV state columns a CTA, both directions) or ``blocked:BV`` (its register-blocked build, the
reverse splice's). Checks each build against the torch splice (``flashgdn.cp.exact`` / ``flashgdn.cp.backward``'s
formulas, float64) before timing it.
"""
import argparse
import json
import sys

import torch


def make_case(Hv: int, S: int, K: int = 128, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    eye = torch.eye(K, dtype=torch.float32)
    M = 0.9 * eye + 0.02 * torch.randn(S, Hv, K, K, generator=gen)
    b = torch.randn(S, Hv, K, K, generator=gen)
    pairs = torch.stack([b, M], dim=2).reshape(S, 2 * Hv, K, K)
    start = torch.randn(1, Hv, K, K, generator=gen)
    D = torch.randn(S, Hv, K, K, generator=gen)
    first = torch.zeros(1, dtype=torch.int64)
    count = torch.full((1,), S, dtype=torch.int64)
    return pairs, start, D, first, count


def torch_splice(pairs, start, D, reverse: bool):
    """float64: forward S_0 = h0, S_1 = b_0, S_{i+1} = M_i S_i + b_i; reverse E_last = start, E_{i-1} = M_i^T E_i + D_i."""
    S = pairs.shape[0]
    Hv = start.shape[1]
    p = pairs.double().reshape(S, Hv, 2, *pairs.shape[2:])
    b, M = p[:, :, 0], p[:, :, 1]
    out = torch.empty(S, *start.shape[1:], dtype=torch.float64)
    if not reverse:
        out[0] = start[0].double()
        if S > 1:
            out[1] = b[0]
        for i in range(1, S - 1):
            out[i + 1] = M[i] @ out[i] + b[i]
    else:
        out[S - 1] = start[0].double()
        for i in range(S - 1, 0, -1):
            out[i - 1] = M[i].transpose(-1, -2) @ out[i] + D[i].double()
    return out


def parse_build(text: str):
    kind, bv = text.split(":")
    if kind not in ("plain", "blocked"):
        raise SystemExit(f"--builds: {text!r} is not plain:BV or blocked:BV")
    return dict(BV=int(bv), blocked=kind == "blocked")


def time_kernel(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3  # us


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="4,8,32")
    ap.add_argument("--segments", default="8,32")
    ap.add_argument("--builds", default="plain:8,blocked:8,blocked:16,blocked:32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="run each case a few times untimed (under ncu)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    from flashgdn.kernels.hopper.splice import build_splice

    rows = []
    for Hv in map(int, args.heads.split(",")):
        for S in map(int, args.segments.split(",")):
            pairs_c, start_c, D_c, first_c, count_c = make_case(Hv, S)
            ref = {r: torch_splice(pairs_c, start_c, D_c, r) for r in (False, True)}
            pairs, start, D = pairs_c.cuda(), start_c.cuda(), D_c.cuda()
            first, count = first_c.cuda(), count_c.cuda()
            for text in args.builds.split(","):
                opts = parse_build(text)
                # the blocked build is the reverse splice's (its forward, with M transposed, was slower than plain)
                for reverse in (True,) if opts["blocked"] else (False, True):
                    kernel = build_splice(Hv, 128, 128, reverse, **opts)
                    out = torch.full((S, Hv, 128, 128), float("nan"), device="cuda")

                    def run():
                        kernel(pairs, D if reverse else start, start, first, count, out)

                    run()
                    torch.cuda.synchronize()
                    err = ((out.cpu().double() - ref[reverse]).norm() / ref[reverse].norm()).item()
                    if args.profile:
                        for _ in range(3):
                            run()
                        torch.cuda.synchronize()
                        us = float("nan")
                    else:
                        us = time_kernel(run, args.reps)
                    row = dict(h_v=Hv, segments=S, build=text, reverse=reverse, us=us,
                               us_per_step=us / max(S - 1, 1), rel_err=err)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if not err < 1e-5:
                        print(f"  MISMATCH: {text} reverse={reverse} rel err {err:.3e}", file=sys.stderr)
    if args.out:
        from stage_timing import results_header  # this script's folder is on the path when run as a script

        with open(args.out, "w") as f:
            json.dump(results_header(argv, "splice_timing.py") | dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
