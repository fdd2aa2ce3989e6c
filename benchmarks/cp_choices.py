"""``cp="auto"``'s choices on the GPU: the op timed with CP off, with the segment length the cost model picks and
with other lengths, shape by shape (GPU only).

    python benchmarks/cp_choices.py --shape 8/32:24576+8192 --shape 2/8:8192x4 [--segments 16,32,128]
        [--skip-unread both] [--fwdbwd] [--gate-scale 0.1] [--out F.json]

For each shape: the model's pick (``plan_segments(..., "auto")``) and its predicted times, and the measured op
(CUDA-graph replay, median) with ``cp="off"``, ``cp="auto"`` and each segment length asked for. What it answers:
whether the cost model's choice is within a few percent of the best measured one (``docs/context-parallel.md``).
``--skip-unread both`` times every CP setting twice in the same process, with the paired pass walking every
transition item and skipping those no splice reads (``backend.CP_SKIP_UNREAD``): fields ``ms_<cp>`` and
``ms_<cp>_skip``, and the model's prediction for each (a forward's: the model has no backward terms). ``on`` or
``off`` times one of them (the default: as the backend is set). ``--fwdbwd`` times the forward and the backward
(``torch.autograd.grad`` of o and the final state) instead of the forward alone. ``--gate-scale`` multiplies the
log decays g (the benchmark's average about -0.05 a token): at 0.1 (about -0.005 a token) no transition M of 128 chunks or
fewer falls below float32's range, so the transition pass and the splices walk and multiply every one of them.
"""
import argparse
import json
import sys

import torch


def parse_shape(text):
    from flashgdn.bench.shapes import parse_shape as shape_of

    shape = shape_of(text)
    return shape.h_qk, shape.h_v, list(shape.seqlens)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", required=True, help="HQK/HV:SEQLENS, e.g. 8/32:24576+8192")
    ap.add_argument("--segments", default="", help="segment lengths (chunks) to time besides off and auto")
    ap.add_argument("--skip-unread", choices=("as-set", "off", "on", "both"), default="as-set",
                    help="the paired pass with or without skipping unread transition items, or both side by side")
    ap.add_argument("--fwdbwd", action="store_true",
                    help="time the forward and the backward (torch.autograd.grad of o and the final state)")
    ap.add_argument("--gate-scale", type=float, default=1.0,
                    help="multiply the log decays g by this (slower decay below 1: fewer transitions vanish)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from triton.testing import do_bench_cudagraph

    from flashgdn import chunk_gated_delta_rule
    from flashgdn.cp.plan import estimated_us, plan_segments
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.backend import cp_cost_model

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from stage_timing import make, results_header

    modes = {"as-set": [backend.CP_SKIP_UNREAD], "off": [False], "on": [True], "both": [False, True]}[
        args.skip_unread]
    extra = [int(x) for x in args.segments.split(",") if x]
    rows = []
    for text in args.shape:
        hq, hv, seqlens = parse_shape(text)
        q, k, v, g, beta, h0, cu = make(hq, hv, seqlens)
        g = g * args.gate_scale
        cu_cpu = cu.cpu()
        xs = [t.detach().requires_grad_(args.fwdbwd) for t in (q, k, v, g, beta)]
        if args.fwdbwd:
            gen = torch.Generator(device=q.device).manual_seed(3)
            do = torch.randn(v.shape, generator=gen, device=q.device).to(v.dtype)
            dht = torch.randn(h0.shape, generator=gen, device=q.device)
        row = {"shape": text, "mode": "fwdbwd" if args.fwdbwd else "fwd", "gate_scale": args.gate_scale}
        for skip in modes:
            backend.CP_SKIP_UNREAD = skip
            tag = "_skip" if skip else ""
            model = cp_cost_model(torch.device("cuda"))  # the model the backend plans with
            pick = plan_segments(seqlens, hv, "auto", model, qk_heads=hq).segment_chunks
            row |= {f"auto_pick{tag}": pick,
                    "model_off_ms": estimated_us(seqlens, hv, None, model, hq) / 1e3,
                    f"model_pick{tag}_ms": estimated_us(seqlens, hv, pick, model, hq) / 1e3}
            for cp in (["off"] if skip == modes[0] else []) + ["auto"] + extra:
                def op(cp=cp):
                    return chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True,
                                                  cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, backend="hopper", cp=cp)

                def step(op=op):
                    o, ht = op()
                    return torch.autograd.grad([o, ht], xs, [do, dht])
                with torch.enable_grad() if args.fwdbwd else torch.no_grad():
                    fn = step if args.fwdbwd else op
                    fn()
                    torch.cuda.synchronize()
                    row[f"ms_{cp}{'' if cp == 'off' else tag}"] = do_bench_cudagraph(fn, rep=50,
                                                                                     return_mode="median")
                if cp != "off":
                    row[f"model_{cp}{tag}_ms"] = estimated_us(seqlens, hv, pick if cp == "auto" else cp, model,
                                                             hq) / 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(results_header(argv, "cp_choices.py") | {"rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
