"""Where a chunk step of the fused backward goes, role by role (GPU).

Runs the trace build of ``flashgdn/kernels/hopper/fused_backward.py`` (``trace=True``: the SM's cycle counter at
fixed points of each role's chunk step, for the first chunk steps of the CTA of value head 0 and sequence 0) on one
shape, and prints, for each role (state, value side, gate side, producer) and point, the median cycle at which it is
reached counted from the value side's start of the same chunk step, and the median step length. The trace build
computes the same gradients as the default one; only the stamps are added.

    python benchmarks/fused_backward_trace.py --heads 16/32 --seqlens 4096,4096,4096,4096,4096,4096,4096,4096 \
        [--options default|none|p_first,lean_gates] --out trace.json
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_stamps  # noqa: E402

ROLES = ("state", "value side", "gate side", "producer")


def summarize(stamps, points_of, skip=2):
    """Medians over chunk steps ``skip`` .. n - 2 of a trace ``stamps[role][step][point]`` (cycles, 0 where never
    written), each point counted from the value side's point 0 of the same step: ``{"step_cycles": median step
    length, "roles": {role: [(point description, median offset or None), ...]}}``."""
    length, roles = trace_stamps.medians_by_point(stamps, points_of, ROLES, 1, skip)
    return {"step_cycles": length, "roles": roles}


def edges_of(stamps, num_points, edges):
    """The state side's once-per-CTA stamps (``fused_backward.TRACE_EDGES``, the last points of chunk step 0's row),
    each counted from the first: ``[(description, cycles)]``, or [] when the trace has none."""
    row = stamps[0][0][num_points - len(edges):]
    if not all(row):
        return []
    return [(desc, t - row[0]) for desc, t in zip(edges, row)]


def parse_options(text):
    """``--options`` as ``build_fused_backward``'s keyword arguments: "default" for the switches' build
    (``backward.fused_backward_options``), else comma-separated option names (p_first, lean_gates), "none" for none
    of them."""
    if text == "default":
        return None
    return {} if text == "none" else {name: True for name in text.split(",")}


def fused_inputs(Hqk, Hv, seqlens, seed=0):
    """The fused kernel's arguments on random inputs (bf16, K = V = 128, mild decay, an initial state and a final
    state's gradient), from the states pass and stage 1 as the backward makes them: ``(args, outputs)``,
    ``outputs(options)`` a list of fresh NaN-filled tensors ``(dv, dq, dk, dg, dbeta, dh0)`` for a build with these
    options: dq and dk per value head, per qk head for ``cluster_sum``, or zeros per pair of value heads for
    ``pair_sums`` (the kernel adds into them, so a pair_sums build's outputs hold the sum of its calls)."""
    import torch

    from flashgdn.kernels.hopper.backward import HopperBackwardStages
    from flashgdn.kernels.hopper.forward import _output

    K = V = 128
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    T = sum(seqlens)
    cu = torch.tensor([0] + list(seqlens), device=dev).cumsum(0).to(torch.int32)
    bf = torch.bfloat16
    q = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, generator=gen, device=dev), dim=-1).to(bf)
    k = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, generator=gen, device=dev), dim=-1).to(bf)
    v = torch.randn(1, T, Hv, V, generator=gen, device=dev).to(bf)
    g = -torch.rand(1, T, Hv, generator=gen, device=dev) * 0.1
    beta = torch.rand(1, T, Hv, generator=gen, device=dev)
    h0 = torch.randn(len(seqlens), Hv, K, V, generator=gen, device=dev)
    do = torch.randn(1, T, Hv, V, generator=gen, device=dev).to(bf)
    dht = torch.randn(len(seqlens), Hv, K, V, generator=gen, device=dev)
    scale = K ** -0.5

    st = HopperBackwardStages()
    states = st.chunk_states(q, k, v, g, beta, h0, cu, cu.cpu())
    (qf, kf), cu_k, N, st1 = st._stage1_for(q, k, g, beta, cu, cu.cpu())

    def outputs(options=None):
        options = options or {}
        if options.get("pair_sums"):
            dq, dk = (torch.zeros((1, T, Hv // 2, K), dtype=bf, device=dev) for _ in range(2))
        else:
            Hq = Hqk if options.get("cluster_sum") else Hv
            dq, dk = _output((1, T, Hq, K), bf, dev), _output((1, T, Hq, K), bf, dev)
        return [_output((1, T, Hv, V), bf, dev), dq, dk, _output((1, T, Hv), torch.float32, dev),
                _output((1, T, Hv), torch.float32, dev), _output((N, Hv, K, V), torch.float32, dev)]

    args = (qf, kf, v, do, st1.gcum, beta.contiguous(), st1.Ag, st1.A, cu_k, st1.first_slot, states,
            dht.contiguous(), float(scale))
    return args, outputs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16/32", help="Hqk/Hv")
    ap.add_argument("--seqlens", default=",".join(["4096"] * 8), help="comma-separated lengths")
    ap.add_argument("--options", default="default",
                    help="the build's options: default (the switches'), none, or names (p_first,lean_gates,...)")
    ap.add_argument("--out", default=None, help="JSON file for the stamps and the summary")
    args = ap.parse_args(argv)

    import torch

    from flashgdn.kernels.hopper.backward import fused_backward_options
    from flashgdn.kernels.hopper.common import tl_dtype
    from flashgdn.kernels.hopper.fused_backward import (TRACE_CHUNKS, TRACE_EDGES, TRACE_POINTS, TRACE_POINTS_OF,
                                                        build_fused_backward)

    Hqk, Hv = (int(x) for x in args.heads.split("/"))
    seqlens = [int(x) for x in args.seqlens.split(",")]
    K = V = 128
    call_in, outputs = fused_inputs(Hqk, Hv, seqlens)
    tr = torch.zeros((4, TRACE_CHUNKS, TRACE_POINTS), dtype=torch.int64, device=call_in[0].device)
    options = parse_options(args.options)
    if options is None:  # the build the switches give (FLASHGDN_HOPPER_FUSED_*)
        options = fused_backward_options(Hv, Hv // Hqk)
    call_args = (*call_in, *outputs(options))
    if options.get("p_given"):  # P after the outputs (from PyTorch, as fused_backward_options.py gives it)
        from fused_backward_options import given_p

        call_args = (*call_args, given_p(call_in, Hqk, Hv))
    # with and without its stamps
    kernel = build_fused_backward(Hqk, Hv, K, V, tl_dtype(torch.bfloat16), True, trace=True, **options)
    plain = build_fused_backward(Hqk, Hv, K, V, tl_dtype(torch.bfloat16), True, **options)
    times = trace_stamps.time_both({"trace": lambda: kernel(*call_args, tr), "plain": lambda: plain(*call_args)})
    stamps = tr.cpu().tolist()
    summary = summarize(stamps, TRACE_POINTS_OF)
    print(f"{args.heads} {args.seqlens} ({', '.join(sorted(options)) or 'no options'}): kernel {times['plain']:.3f} ms "
          f"(trace build {times['trace']:.3f} ms); median chunk step {summary['step_cycles']} cycles")
    for role, rows in summary["roles"].items():
        print(f"  {role}:")
        for desc, off in rows:
            if off is None and desc.startswith("exchange:"):  # cluster_sum's points, in a build without it
                continue
            print(f"    {'-' if off is None else off:>8}  {desc}")
    edges = edges_of(stamps, TRACE_POINTS, TRACE_EDGES)
    if edges:
        print("  the CTA's edges (state side, cycles from its start): "
              + ", ".join(f"{desc} {off}" for desc, off in edges))
        summary["edges"] = edges
    if args.out:
        from stage_timing import results_header  # this script's folder is on the path when run as a script

        with open(args.out, "w") as f:
            json.dump(results_header(argv, "fused_backward_trace.py")
                      | {"heads": args.heads, "seqlens": seqlens, "options": sorted(options), "ms": times,
                         "stamps": stamps, "points": TRACE_POINTS_OF, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
