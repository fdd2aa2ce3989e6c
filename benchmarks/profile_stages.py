"""Run each Hopper forward stage once on one shape, for a profiler to attach to (GPU only).

    ncu --clock-control none -k regex:"kkt_inverse|chunk_forward" --section SpeedOfLight ... \
        python benchmarks/profile_stages.py --heads 16/32 --seqlens 32768

Runs the stages twice (the first call loads the kernels) with a synchronisation in between. With ``--backward``
it runs the Hopper backward (``backward.hopper_backward``: stage 1 with A, the chunk states, the walk,
``chunk_grad``) instead.
"""
import argparse
import sys

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="16/32")
    ap.add_argument("--seqlens", default="32768", help="comma-separated lengths")
    ap.add_argument("--loops", default="rs,ws,simple")
    ap.add_argument("--backward", action="store_true", help="run the Hopper backward instead of the forward")
    args = ap.parse_args(argv)
    sys.path.insert(0, "benchmarks")
    from stage_timing import make

    from flashgdn.kernels.hopper import forward as fw
    from flashgdn.kernels.hopper.chunk_forward import build_chunk_forward
    from flashgdn.kernels.hopper.chunk_forward_rs import build_chunk_forward_rs
    from flashgdn.kernels.hopper.chunk_forward_rso import build_chunk_forward_rso
    from flashgdn.kernels.hopper.chunk_forward_uw import build_chunk_forward_uw
    from flashgdn.kernels.hopper.chunk_forward_ws import build_chunk_forward_ws
    from flashgdn.kernels.hopper.kkt_inverse import build_kkt_inverse

    Hqk, Hv = (int(x) for x in args.heads.split("/"))
    seqlens = [int(x) for x in args.seqlens.split(",")]
    q, k, v, g, beta, h0, cu = make(Hqk, Hv, seqlens)
    T, N = q.shape[1], len(seqlens)
    if args.backward:
        from flashgdn.kernels.hopper.backward import hopper_backward

        do, dht = torch.randn_like(v), torch.randn_like(h0)
        with torch.no_grad():
            for _ in range(2):
                hopper_backward(q, k, v, g, beta, do, dht, 128 ** -0.5, h0, cu, False, None, cu.cpu())
                torch.cuda.synchronize()
        return 0
    # stage 1 as the forward builds it (its occupancy and the switched options: diag16 and mma32 by default)
    prep = build_kkt_inverse(Hqk, Hv, 128, "bfloat16", "bfloat16", async_loads=fw.KKT_ASYNC_LOADS,
                             **fw._kkt_build_options(Hv // Hqk))
    builders = {  # only the loops asked for are built (a build not in the cache is a compile)
        "simple": lambda: build_chunk_forward(Hqk, Hv, 128, 128, 128, "bfloat16", True, True, False),
        "ws": lambda: build_chunk_forward_ws(Hqk, Hv, 128, 128, "bfloat16", True, True, False),
        "rs": lambda: build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False),
        "uw": lambda: build_chunk_forward_uw(Hqk, Hv, 128, 128, "bfloat16", True, True, False),
        "rsd": lambda: build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False, decayed_k=True),
        "rso": lambda: build_chunk_forward_rso(Hqk, Hv, 128, 128, "bfloat16", True, True, False),
        # stage 1 inside the loop (its kernel is also named chunk_forward_rs): g and beta instead of stage 1's tiles
        "fused": lambda: build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False, decayed_k=True,
                                                inverse_in_loop=True),
        # the same with P made by its state paths (forward.FUSED_STATE_P)
        "fused_state_p": lambda: build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False,
                                                        inverse_in_loop=True, state_p=True),
        # and with its two options (forward.FUSED_REGISTER_INVERSE, FUSED_SWIZZLED_V)
        "fused_state_p_both": lambda: build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False,
                                                             inverse_in_loop=True, state_p=True, register_inverse=True,
                                                             swizzled_v=True),
    }
    loops = {name: builders[name]() for name in args.loops.split(",")}
    bounds, first_slot = fw.chunk_plan(cu, T, N)
    S = bounds.shape[0]
    gcum = torch.empty(Hv, S * 64, device="cuda")
    Ag = torch.empty(S, Hv, 64, 64, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(1, T, Hv, 128, device="cuda", dtype=torch.bfloat16)
    ht = torch.empty(N, Hv, 128, 128, device="cuda")
    for _ in range(2):
        prep(k, g, beta, bounds, gcum, Ag)
        for name in args.loops.split(","):
            if name.startswith("fused"):
                loops[name](q, k, v, g, beta, cu, h0, 128 ** -0.5, o, ht)
            else:
                loops[name](q, k, v, gcum, Ag, cu, first_slot, h0, 128 ** -0.5, o, ht)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
