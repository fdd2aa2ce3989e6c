"""How long stage 1's phases take one CTA, alone on its SM and on a full GPU (GPU).

Runs the trace build of ``flashgdn/kernels/hopper/kkt_inverse.py`` (``trace=True``: thread 0 reads the SM's cycle
counter after each barrier between the phases, ``TRACE_POINTS_OF``) beside the forward's default build of the same
head configuration, checks that both give the same Ag and g~ bit for bit, and prints per phase the median over CTAs
of its cycles (and the 10th and 90th percentiles), for two launches:

* ``alone``: as many chunk slots as make at most one CTA an SM (``--alone-ctas``, 128 by default), so each phase's
  time is its latency with nothing beside it: what a warpgroup making the same inverse inside the chunk loop, one
  chunk ahead of the state paths, would spend on it (notes "The forward's next structure");
* ``full``: ``--seqlens`` (4096 x 8 by default), where 5-7 CTAs share an SM and hide each other's waits.

``--registers16`` runs the same beside it on the builds with ``registers16`` (the 16x16 diagonal blocks by
elimination in registers, ``forward.KKT_REGISTERS16``), with ``merge16_registers`` on top (the 16 -> 32 merges by
fp16 mma from those registers) and with ``merge32_registers`` on that (the 32 -> 64 merge too), whose Ag is also
compared with the default build's.

    python benchmarks/stage1_trace.py --heads 32/32,16/32 --out stage1-trace.json
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_stamps  # noqa: E402


#: the v0.38 builds that --registers16 times beside the default (a registers16, b merge16_registers, c
#: merge32_registers, d merge32_quadrants, e registers8: docs/hopper-notes.md v0.38a-e)
REGISTER_BUILDS = {"a": {"registers16": True}, "a-b": {"registers16": True, "merge16_registers": True},
                   "a-b-c": {"registers16": True, "merge16_registers": True, "merge32_registers": True},
                   "a-b-d": {"registers16": True, "merge16_registers": True, "merge32_quadrants": True},
                   "a-e": {"registers16": True, "registers8": True},
                   "a-e-b-d": {"registers16": True, "registers8": True, "merge16_registers": True,
                               "merge32_quadrants": True}}


def phase_cycles(tr, points_of):
    """Per phase (point p - 1 to point p, p >= 1), the median, 10th and 90th percentile over CTAs of its cycles,
    and the same for the whole CTA (the last point minus the first), from ``tr [S, Hqk, P]`` (0 where a point was
    never reached: a slot past the plan, or its idle branch); CTAs with a missing stamp are left out."""
    rows = [r for r in tr.reshape(-1, tr.shape[-1]).tolist() if all(r)]

    def stats(vals):
        vals = sorted(vals)
        n = len(vals)
        return {"median": statistics.median(vals), "p10": vals[n // 10], "p90": vals[(9 * n) // 10]} if n else None

    out = [{"phase": f"{points_of[p - 1]} -> {points_of[p]}", **(stats([r[p] - r[p - 1] for r in rows]) or {})}
           for p in range(1, len(points_of))]
    out.append({"phase": "whole CTA", **(stats([r[-1] - r[0] for r in rows]) or {})})
    return out, len(rows)


def stage1_inputs(Hqk, Hv, seqlens, seed=0):
    """k, g, beta (the harness's: normalised bf16 keys, log-sigmoid decays / 16, sigmoid betas) and the chunk plan
    for ``seqlens``: ``(k, g, beta, bounds)``."""
    import torch

    from flashgdn.kernels.hopper.forward import chunk_plan

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    T = sum(seqlens)
    cu = torch.tensor([0] + list(seqlens), device=dev).cumsum(0).to(torch.int32)
    k = torch.nn.functional.normalize(torch.randn(1, T, Hqk, 128, generator=gen, device=dev), dim=-1).to(torch.bfloat16)
    g = (torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen, device=dev)) / 16).contiguous()
    beta = torch.sigmoid(torch.randn(1, T, Hv, generator=gen, device=dev)).contiguous()
    bounds, _ = chunk_plan(cu, T, len(seqlens), cu.cpu())
    return k, g, beta, bounds


def run_one(Hqk, Hv, seqlens, reps, extra=None):
    """One launch shape: the trace build's phases, the bitwise check against the plain build of the same options
    (the default's, plus ``extra``), both timed; with ``extra``, also how far its Ag is from the default build's
    (relative RMS) and the default plain build's time."""
    import torch

    from flashgdn.kernels.hopper.forward import KKT_ASYNC_LOADS, _kkt_build_options
    from flashgdn.kernels.hopper.kkt_inverse import TRACE_POINTS, TRACE_POINTS_OF, build_kkt_inverse

    k, g, beta, bounds = stage1_inputs(Hqk, Hv, seqlens)
    S = bounds.shape[0]
    opts = {"async_loads": KKT_ASYNC_LOADS, **_kkt_build_options(Hv // Hqk), **(extra or {})}
    plain = build_kkt_inverse(Hqk, Hv, 128, "bfloat16", "bfloat16", **opts)
    traced = build_kkt_inverse(Hqk, Hv, 128, "bfloat16", "bfloat16", trace=True, **opts)
    dev = k.device

    def outs():
        return (torch.full((Hv, S * 64), float("nan"), device=dev),
                torch.full((S, Hv, 64, 64), float("nan"), device=dev, dtype=torch.bfloat16))

    gc0, ag0 = outs()
    gc1, ag1 = outs()
    tr = torch.zeros((S, Hqk, TRACE_POINTS), dtype=torch.int64, device=dev)
    plain(k, g, beta, bounds, gc0, ag0)
    traced(k, g, beta, bounds, gc1, ag1, tr)
    torch.cuda.synchronize()
    same = bool(torch.equal(gc0, gc1) and torch.equal(ag0.view(torch.int16), ag1.view(torch.int16)))
    tr.zero_()
    traced(k, g, beta, bounds, gc1, ag1, tr)  # a second launch: the first paid the module's load
    torch.cuda.synchronize()
    phases, ctas = phase_cycles(tr.cpu(), TRACE_POINTS_OF)
    fns = {"plain": lambda: plain(k, g, beta, bounds, gc0, ag0),
           "trace": lambda: traced(k, g, beta, bounds, gc1, ag1, tr)}
    vs_default = None
    if extra:
        default = build_kkt_inverse(Hqk, Hv, 128, "bfloat16", "bfloat16", async_loads=KKT_ASYNC_LOADS,
                                    **{**_kkt_build_options(Hv // Hqk), **{o: False for o in extra}})
        gc2, ag2 = outs()
        default(k, g, beta, bounds, gc2, ag2)
        fns["default"] = lambda: default(k, g, beta, bounds, gc2, ag2)
        a, b = ag0.double(), ag2.double()
        vs_default = ((a - b).norm() / b.norm()).item()
    times = trace_stamps.time_both(fns, reps)
    return {"ag_vs_default": vs_default, "h_qk": Hqk, "h_v": Hv, "seqlens": list(seqlens), "slots": S,
            "ctas": S * Hqk, "ctas_stamped": ctas, "same_bits": same, "phases": phases, "ms": times, "options": opts}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/32,16/32", help="Hqk/Hv configurations, comma-separated")
    ap.add_argument("--seqlens", default="4096x8",
                    help="the full launch's sequence mix, in flashgdn.bench's syntax (4096x8, 24576+8192)")
    ap.add_argument("--alone-ctas", type=int, default=128, help="CTAs of the alone launch (at most one an SM)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--registers16", action="store_true", help="also the builds with registers16, side by side")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from flashgdn.bench.shapes import parse_seqlens

    mixes = parse_seqlens(args.seqlens)
    if len(mixes) != 1:
        ap.error(f"--seqlens: one sequence mix, got {len(mixes)} from {args.seqlens!r}")
    full = list(mixes[0])
    records = []
    for spec in args.heads.split(","):
        Hqk, Hv = (int(x) for x in spec.split("/"))
        slots = max(1, args.alone_ctas // Hqk)
        for load, seqlens in (("alone", [64 * slots]), ("full", full)):
            for extra in [None] + (list(REGISTER_BUILDS.values()) if args.registers16 else []):
                rec = {"load": load, **run_one(Hqk, Hv, seqlens, args.reps, extra)}
                records.append(rec)
                print(f"## {Hqk}/{Hv} {load}{''.join(' ' + o for o in extra or {})}: {rec['ctas']} CTAs, same bits "
                      f"{rec['same_bits']}, ms " + ", ".join(f"{n} {t:.4f}" for n, t in rec["ms"].items())
                      + ("" if extra is None else f", Ag {rec['ag_vs_default']:.2e} from the default build's"))
                print("| phase | median cycles | p10 | p90 |")
                print("|---|---|---|---|")
                for ph in rec["phases"]:
                    print(f"| {ph['phase']} | {ph.get('median')} | {ph.get('p10')} | {ph.get('p90')} |")
    if args.out:
        from stage_timing import results_header  # this script's folder is on the path when run as a script

        with open(args.out, "w") as f:
            json.dump(results_header(argv, "stage1_trace.py") | {"records": records}, f, indent=1)
    if not all(r["same_bits"] for r in records):
        sys.exit("the trace build's outputs differ from the default build's")


if __name__ == "__main__":
    main()
