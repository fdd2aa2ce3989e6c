"""Where a chunk of the forward's rso loop goes, role by role (GPU).

Runs the trace build of ``flashgdn/kernels/hopper/chunk_forward_rso.py`` (``trace=True``: the SM's cycle counter at
fixed points of each role's chunk, for the first chunks of the CTA of value head 0 and sequence 0) on one shape, and
prints, for each role (the two state paths, the output path, the decay warp) and point, the median cycle at which it
is reached counted from state path 0's start of the same chunk, and the median chunk length. The trace build gives
the same outputs as the default one (checked here, bit for bit); only the stamps are added. The loop runs alone,
without context parallelism, on stage 1's outputs as the forward makes them.

    python benchmarks/rso_trace.py --heads 16/32 --seqlens 8192,8192,8192,8192 --out trace.json
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_stamps  # noqa: E402

ROLES = ("state path 0", "state path 1", "output path", "decay warp")


def summarize(stamps, points_of, skip=2):
    """Medians over chunks ``skip`` .. n - 2 of a trace ``stamps[role][chunk][point]`` (cycles, 0 where never
    written), each point counted from state path 0's point 0 of the same chunk: ``{"chunk_cycles": median chunk
    length, "roles": {role: [(point description, median offset or None), ...]}}``."""
    length, roles = trace_stamps.medians_by_point(stamps, points_of, ROLES, 0, skip)
    return {"chunk_cycles": length, "roles": roles}


def loop_inputs(Hqk, Hv, seqlens, seed=0):
    """The rso loop's arguments on random inputs (``trace_stamps.loop_tensors``), from stage 1 as the forward makes it:
    ``(args, outputs)``, ``outputs()`` fresh NaN-filled ``(o, ht)``."""
    from flashgdn.kernels.hopper.forward import hopper_stage1

    q, k, v, g, beta, h0, cu, outputs = trace_stamps.loop_tensors(Hqk, Hv, seqlens, seed)
    st1 = hopper_stage1(k, g, beta, cu, cu_cpu=cu.cpu())
    return (q, k, v, st1.gcum, st1.Ag, cu, st1.first_slot, h0, float(q.shape[-1] ** -0.5)), outputs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16/32", help="Hqk/Hv")
    ap.add_argument("--seqlens", default=",".join(["8192"] * 4), help="comma-separated lengths")
    ap.add_argument("--out", default=None, help="JSON file for the stamps and the summary")
    args = ap.parse_args(argv)

    import torch

    from flashgdn.kernels.hopper.chunk_forward_rso import TRACE_CHUNKS, TRACE_POINTS, TRACE_POINTS_OF, \
        build_chunk_forward_rso
    from flashgdn.kernels.hopper.forward import rso_options

    Hqk, Hv = (int(x) for x in args.heads.split("/"))
    seqlens = [int(x) for x in args.seqlens.split(",")]
    K = V = 128
    call_in, outputs = loop_inputs(Hqk, Hv, seqlens)
    tr = torch.zeros((4, TRACE_CHUNKS, TRACE_POINTS), dtype=torch.int64, device=call_in[0].device)
    options = rso_options()
    kernel = build_chunk_forward_rso(Hqk, Hv, K, V, "bfloat16", True, True, False, trace=True, **options)
    plain = build_chunk_forward_rso(Hqk, Hv, K, V, "bfloat16", True, True, False, **options)
    outs = {"trace": outputs(), "plain": outputs()}
    times = trace_stamps.time_both({"trace": lambda: kernel(*call_in, *outs["trace"], tr),
                                    "plain": lambda: plain(*call_in, *outs["plain"])})
    same = all(torch.equal(a, b) for a, b in zip(outs["trace"], outs["plain"]))
    stamps = tr.cpu().tolist()
    summary = summarize(stamps, TRACE_POINTS_OF)
    print(f"{args.heads} {args.seqlens} ({', '.join(sorted(options)) or 'default options'}): loop {times['plain']:.3f}"
          f" ms (trace build {times['trace']:.3f} ms, same outputs: {same}); median chunk {summary['chunk_cycles']}"
          f" cycles")
    trace_stamps.print_roles(summary["roles"])
    if args.out:
        from stage_timing import results_header  # this script's folder is on the path when run as a script

        with open(args.out, "w") as f:
            json.dump(results_header(argv, "rso_trace.py")
                      | {"heads": args.heads, "seqlens": seqlens, "options": sorted(options), "ms": times,
                         "same_outputs": same, "stamps": stamps, "points": TRACE_POINTS_OF, "summary": summary},
                      f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
