"""Where a chunk of the "fused" loop goes, role by role (GPU): the loop with stage 1 inside its gate warpgroup.

Runs the trace build of ``flashgdn/kernels/hopper/chunk_forward_rs.py`` with ``inverse_in_loop`` (``trace=True``: the
SM's cycle counter at fixed points of each role's chunk, for the first chunks of the CTA of value head 0 and sequence
0) on one shape, for each build asked for (``BUILDS``: the gate's inverse by substitution, by stage 1's register
pieces, with P made by the state paths, ...), and prints, for each role (the two state paths, the gate path) and
point, the median cycle at which it is reached counted from state path 0's start of the same chunk, and the median
chunk length. Each trace build gives the same outputs as its plain build (checked here, bit for bit); only the stamps
are added.

    python benchmarks/fused_trace.py --heads 32/32 --seqlens 4096,4096,4096,4096,4096,4096,4096,4096 --out trace.json
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_stamps  # noqa: E402

ROLES = ("state path 0", "state path 1", "gate path")
#: the builds this script can trace, by name: their options of ``build_chunk_forward_rs``
BUILDS = {
    "substitution": dict(decayed_k=True, inverse_in_loop=True),
    "registers": dict(decayed_k=True, inverse_in_loop=True, register_inverse=True),
    "state_p": dict(inverse_in_loop=True, state_p=True),
    # its A/Bs: v's tile swizzled (the state paths' V^T reads free of bank conflicts), the register inverse, both
    "state_p_swizzled": dict(inverse_in_loop=True, state_p=True, swizzled_v=True),
    "state_p_registers": dict(inverse_in_loop=True, state_p=True, register_inverse=True),
    "state_p_registers_swizzled": dict(inverse_in_loop=True, state_p=True, register_inverse=True, swizzled_v=True),
}


def summarize(stamps, points_of, skip=2):
    """Medians over chunks ``skip`` .. n - 2 of a trace ``stamps[role][chunk][point]`` (cycles, 0 where never
    written), each point counted from state path 0's point 0 of the same chunk: ``{"chunk_cycles": median chunk
    length, "roles": {role: [(point description, median offset or None), ...]}}``."""
    length, roles = trace_stamps.medians_by_point(stamps, points_of, ROLES, 0, skip)
    return {"chunk_cycles": length, "roles": roles}


def loop_inputs(Hqk, Hv, seqlens, seed=0):
    """The fused loop's arguments on random inputs (``trace_stamps.loop_tensors``): ``(args, outputs)``, ``outputs()``
    fresh NaN-filled ``(o, ht)``."""
    q, k, v, g, beta, h0, cu, outputs = trace_stamps.loop_tensors(Hqk, Hv, seqlens, seed)
    return (q, k, v, g, beta, cu, h0, float(q.shape[-1] ** -0.5)), outputs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/32", help="Hqk/Hv")
    ap.add_argument("--seqlens", default=",".join(["4096"] * 8), help="comma-separated lengths")
    ap.add_argument("--builds", default="substitution,registers",
                    help=f"comma-separated, of {', '.join(BUILDS)} (default: the two inverses, as round fused-trace "
                         "traced them before this option)")
    ap.add_argument("--out", default=None, help="JSON file for the stamps and the summaries")
    args = ap.parse_args(argv)
    unknown = [b for b in args.builds.split(",") if b not in BUILDS]
    if unknown:
        ap.error(f"--builds: unknown {', '.join(unknown)}; expected some of {', '.join(BUILDS)}")

    import torch

    from flashgdn.kernels.hopper.chunk_forward_rs import TRACE_CHUNKS, TRACE_POINTS, TRACE_POINTS_OF, \
        build_chunk_forward_rs

    Hqk, Hv = (int(x) for x in args.heads.split("/"))
    seqlens = [int(x) for x in args.seqlens.split(",")]
    K = V = 128
    call_in, outputs = loop_inputs(Hqk, Hv, seqlens)
    runs, all_same = {}, True
    for inverse in args.builds.split(","):
        tr = torch.zeros((3, TRACE_CHUNKS, TRACE_POINTS), dtype=torch.int64, device=call_in[0].device)
        build = BUILDS[inverse]
        kernel = build_chunk_forward_rs(Hqk, Hv, K, V, "bfloat16", True, True, False, True, trace=True, **build)
        plain = build_chunk_forward_rs(Hqk, Hv, K, V, "bfloat16", True, True, False, True, **build)
        outs = {"trace": outputs(), "plain": outputs()}
        times = trace_stamps.time_both({"trace": lambda: kernel(*call_in, *outs["trace"], tr),
                                        "plain": lambda: plain(*call_in, *outs["plain"])})
        same = all(torch.equal(a, b) for a, b in zip(outs["trace"], outs["plain"]))
        all_same = all_same and same
        stamps = tr.cpu().tolist()
        summary = summarize(stamps, TRACE_POINTS_OF)
        runs[inverse] = {"ms": times, "same_outputs": same, "stamps": stamps, "summary": summary}
        print(f"## {args.heads} {args.seqlens}, build {inverse}: loop {times['plain']:.3f} ms (trace build "
              f"{times['trace']:.3f} ms, same outputs: {same}); median chunk {summary['chunk_cycles']} cycles")
        trace_stamps.print_roles(summary["roles"])
    if args.out:
        from stage_timing import results_header  # this script's folder is on the path when run as a script

        with open(args.out, "w") as f:
            json.dump(results_header(argv, "fused_trace.py")
                      | {"heads": args.heads, "seqlens": seqlens, "points": TRACE_POINTS_OF, "runs": runs},
                      f, indent=1)
    return 0 if all_same else 1


if __name__ == "__main__":
    raise SystemExit(main())
