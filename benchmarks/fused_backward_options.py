"""The fused backward kernel alone under several option sets, side by side in one process (GPU).

For each shape, builds ``flashgdn/kernels/hopper/fused_backward.py`` with each option set, runs every build on the
same inputs (the states pass and stage 1 as the backward makes them, ``fused_backward_trace.fused_inputs``), checks
that each gives the first set's gradients bit for bit (or reports where not), then times them in interleaved rounds
(CUDA events, a few calls per round) and prints the median per build and its ratio to the first set's.

    python benchmarks/fused_backward_options.py --shape 16/32:4096x8 --shape 2/8:32768 \
        --sets none p_first lean_gates p_first,lean_gates --out options.json

An option set is "none", "default" (what ``backward.fused_backward_options`` gives for the shape's head count) or
comma-separated ``build_fused_backward`` option names, with "default+" in front to add them to the defaults
(``default+p_first``).
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_shape(text):
    """``Hqk/Hv:LENS`` with LENS ``4096x8`` or ``700,64,9``: ``(Hqk, Hv, [lengths])``."""
    heads, _, lens = text.partition(":")
    Hqk, Hv = (int(x) for x in heads.split("/"))
    if "x" in lens:
        length, count = lens.split("x")
        return Hqk, Hv, [int(length)] * int(count)
    return Hqk, Hv, [int(x) for x in lens.split(",")]


def set_options(text, Hv, group=1):
    """An option set's keyword arguments (module docstring)."""
    from fused_backward_trace import parse_options
    from flashgdn.kernels.hopper.backward import fused_backward_options

    base = {}
    if text.startswith("default"):
        base = dict(fused_backward_options(Hv, group))
        text = text[len("default"):].lstrip("+")
    options = base if text == "" else base | parse_options(text)
    if options.get("cluster_sum"):  # the cluster sums the group itself: no pair sums beside it
        options.pop("pair_sums", None)
    return options


def given_p(args, Hqk, Hv):
    """``p_given``'s last argument made by PyTorch from the kernel's own arguments: P = scale Gam ⊙ Q K^T (lower) per
    chunk slot and value head, in float32 from the io-dtype Q and K and rounded once (the gate side's values, up to
    the order of its float32 sums and exp2 against exp), zero on rows and columns past a sequence's end."""
    import torch

    qf, kf, _, _, gcum, _, Ag, _, cu, first_slot, *_, scale = args
    C = 64
    S = Ag.shape[0]
    cu_h, first_h = cu.cpu().tolist(), first_slot.cpu().tolist()
    tok = torch.full((S, C), -1, dtype=torch.long)
    for n in range(len(first_h)):
        bos, eos = cu_h[n], cu_h[n + 1]
        for j in range((eos - bos + C - 1) // C):
            rows = min(C, eos - bos - j * C)
            tok[first_h[n] + j, :rows] = torch.arange(bos + j * C, bos + j * C + rows)
    valid = (tok >= 0).to(qf.device)[:, :, None, None]
    tok = tok.clamp(min=0).to(qf.device)
    qs = (qf[0][tok].float() * valid)
    ks = (kf[0][tok].float() * valid)
    qk = torch.einsum("sihk,sjhk->shij", qs, ks).repeat_interleave(Hv // Hqk, dim=1)
    gc = gcum[:, :S * C].reshape(Hv, S, C).permute(1, 0, 2)
    lower = torch.ones(C, C, dtype=torch.bool, device=qf.device).tril()
    p = torch.where(lower, qk * scale * torch.exp(gc[..., :, None] - gc[..., None, :]), 0.0)
    return p.to(qf.dtype).contiguous()


def summed(outs, Hqk):
    """The outputs with dq and dk summed over each qk head's value heads in head order in float32 and rounded once
    (``group_sum.py``'s arithmetic), where a build left them per value head: what a ``cluster_sum`` build writes."""
    def total(x):
        x = x.unflatten(2, (Hqk, -1))
        s = x[:, :, :, 0].float()
        for j in range(1, x.shape[3]):
            s = s + x[:, :, :, j].float()
        return s.to(x.dtype)

    dv, dq, dk, *rest = outs
    if dq.shape[2] != Hqk:
        dq, dk = total(dq), total(dk)
    return [dv, dq, dk, *rest]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", required=True, help="Hqk/Hv:4096x8 or Hqk/Hv:700,64,9")
    ap.add_argument("--sets", nargs="+", default=["none", "p_first", "lean_gates", "p_first,lean_gates"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3, help="calls per build and round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from fused_backward_trace import fused_inputs
    from flashgdn.kernels.hopper.common import tl_dtype
    from flashgdn.kernels.hopper.fused_backward import build_fused_backward

    rows = []
    for text in args.shape:
        Hqk, Hv, seqlens = parse_shape(text)
        call_in, outputs = fused_inputs(Hqk, Hv, seqlens)
        p_in = None
        builds = []
        for name in args.sets:
            opts = set_options(name, Hv, Hv // Hqk)
            kernel = build_fused_backward(Hqk, Hv, 128, 128, tl_dtype(torch.bfloat16), True, **opts)
            outs = outputs(opts)
            if opts.get("p_given"):  # P as its last argument, after the outputs
                p_in = given_p(call_in, Hqk, Hv) if p_in is None else p_in
                outs = outs + [p_in]
            kernel(*call_in, *outs)
            builds.append((name, opts, kernel, outs))
        torch.cuda.synchronize()
        names = ("dv", "dq", "dk", "dg", "dbeta", "dh0")
        # (the bits are those of each build's first call: a pair_sums build adds every later call into its outputs)
        sums = {name: summed(outs, Hqk) for name, _, _, outs in builds}
        ref = sums[builds[0][0]]
        same = {name: [n for n, a, b in zip(names, ref, sums[name]) if not torch.equal(a, b)] for name in sums}
        # where the bits differ, by how much: the relative RMS difference from the first set's
        apart = {name: {n: (float((b.double() - a.double()).norm() / a.double().norm()) if a.double().norm() > 0
                            else float("nan"))
                        for n, a, b in zip(names, ref, sums[name]) if n in same[name]}
                 for name in sums}
        times = {name: [] for name, *_ in builds}
        for _ in range(args.rounds):
            for name, _, kernel, outs in builds:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.calls):
                    kernel(*call_in, *outs)
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / args.calls)
        base = statistics.median(times[builds[0][0]])
        print(f"{text}:")
        row = {"shape": text, "sets": {}}
        for name, opts, _, _ in builds:
            ms = statistics.median(times[name])
            differs = same[name]
            how = ", ".join(f"{n} ({apart[name][n]:.1e})" for n in differs)
            print(f"  {name:<32} {ms:8.3f} ms  {ms / base:6.3f}x  {'same bits' if not differs else 'differs in ' + how}")
            row["sets"][name] = {"options": sorted(opts), "ms": ms, "ms_rounds": times[name], "ratio": ms / base,
                                 "differs_in": differs, "relative_rms_difference": apart[name]}
        rows.append(row)
    if args.out:
        from stage_timing import results_header

        with open(args.out, "w") as f:
            json.dump(results_header(argv, "fused_backward_options.py") | {"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
