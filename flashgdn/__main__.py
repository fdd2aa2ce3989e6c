"""The main job: run the operator on realistic random inputs with the best backend here, check it against the
float64 oracle on a slice, and report backend, shapes, error and time.

    python -m flashgdn [--heads 4/8] [--seqlens 500,1500,1000] [--dtype bf16] [--backend auto] [--backward]

The slice is one whole sequence and the first qk head(s) with every value head reading them. Sequences and
qk-head groups are independent, so the full run's outputs and gradients on the slice equal the slice's own:
the forward is checked against the float64 token recurrence, the gradients against the chunked reference in
float64 (itself checked against the recurrence by the test suite). Exits 1 when an error is above its bar.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from .reference.metrics import BARS_16BIT, rel_rms

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
# DESIGN.md §3 bars for 16-bit inputs; tighter ones where q, k, v are exact in fp32/fp64
BARS = {
    torch.bfloat16: BARS_16BIT,
    torch.float16: BARS_16BIT,
    torch.float32: dict(BARS_16BIT, **dict.fromkeys(("o", "final_state", "q", "k", "v", "initial_state"), 1e-4),
                        g=1e-3, beta=1e-3),
    torch.float64: dict.fromkeys(BARS_16BIT, 1e-9),
}
CPU_DEFAULTS = dict(heads="4/8", seqlens="500,1500,1000")
GPU_DEFAULTS = dict(heads="16/32", seqlens="8192,4096,2048,1024,1000")
INPUT_NAMES = ("q", "k", "v", "g", "beta", "initial_state")
LABELS = dict(o="o", final_state="ht", q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0")


def _heads(text: str):
    try:
        hqk, hv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HQK/HV, e.g. 4/8, got {text!r}")
    if hqk < 1 or hv < 1 or hv % hqk:
        raise argparse.ArgumentTypeError(f"need HQK, HV >= 1 with HV a multiple of HQK, got {text!r}")
    return hqk, hv


def _seqlens(text: str) -> List[int]:
    try:
        lens = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths, e.g. 1000,3000, got {text!r}")
    if not lens or min(lens) < 0 or sum(lens) == 0:
        raise argparse.ArgumentTypeError(f"need non-negative lengths with at least one token, got {text!r}")
    return lens


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m flashgdn", description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=_heads, help="HQK/HV (default 4/8 on CPU, 16/32 on GPU)")
    ap.add_argument("--seqlens", type=_seqlens, help="packed sequence lengths (default 500,1500,1000 on CPU)")
    ap.add_argument("--dim", type=int, default=128, help="head dim K = V (default 128)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="q, k, v dtype (default bf16)")
    ap.add_argument("--backend", default="auto", help="auto, hopper or reference (default auto)")
    ap.add_argument("--cp", default="auto", help="context parallelism: auto, off or a segment length in chunks")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--backward", action="store_true", help="also time fwd+bwd and check the gradients")
    ap.add_argument("--check-heads", type=int, default=1, help="qk heads in the checked slice (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs after one warm-up (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    defaults = GPU_DEFAULTS if args.device.type == "cuda" else CPU_DEFAULTS
    args.heads = args.heads or _heads(defaults["heads"])
    args.seqlens = args.seqlens or _seqlens(defaults["seqlens"])
    if args.dim < 1 or args.repeat < 1 or not 1 <= args.check_heads <= args.heads[0]:
        ap.error("--dim and --repeat must be >= 1, --check-heads between 1 and HQK")
    return args


def make_problem(args) -> Dict[str, torch.Tensor]:
    """Realistic inputs: L2-normalised q/k, g = logsigmoid(randn)/16, beta = sigmoid(randn) (fp32, or fp64 for
    fp64 runs), packed sequences, a random initial state."""
    (hqk, hv), D, dt, dev = args.heads, args.dim, DTYPES[args.dtype], args.device
    side = torch.float64 if dt == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(args.seed)
    T, N = sum(args.seqlens), len(args.seqlens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    cu = torch.tensor([0] + args.seqlens).cumsum(0).to(torch.int32)
    t = dict(
        q=F.normalize(randn(1, T, hqk, D), dim=-1).to(dt),
        k=F.normalize(randn(1, T, hqk, D), dim=-1).to(dt),
        v=randn(1, T, hv, D).to(dt),
        g=(F.logsigmoid(randn(1, T, hv)) / 16).to(side),
        beta=torch.sigmoid(randn(1, T, hv)).to(side),
        initial_state=randn(N, hv, D, D).to(side),
    )
    t = {n: x.to(dev) for n, x in t.items()}
    t["cu_seqlens"], t["cu_seqlens_cpu"] = cu.to(dev), cu
    return t


def run_op(t, backend: str, cp="auto"):
    from . import chunk_gated_delta_rule

    return chunk_gated_delta_rule(
        t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["initial_state"], output_final_state=True,
        cu_seqlens=t["cu_seqlens"], cu_seqlens_cpu=t["cu_seqlens_cpu"], backend=backend, cp=cp,
    )


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median wall time of ``fn()`` in ms after one warm-up (which also pays any compile)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import flashgdn
    from .api.dispatch import known_backends, select_backend
    from .api.validate import validate
    from .reference.chunked import chunk_gated_delta_rule_reference
    from .reference.recurrent import recurrent_gated_delta_rule

    args = parse_args(argv)
    t = make_problem(args)
    (hqk, hv), group = args.heads, args.heads[1] // args.heads[0]
    p = validate(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["initial_state"], output_final_state=True,
                 cu_seqlens=t["cu_seqlens"], cu_seqlens_cpu=t["cu_seqlens_cpu"], backend=args.backend, cp=args.cp,
                 known_backends=known_backends())
    chosen = select_backend(p, args.backend).name
    dev_name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    print(f"flashgdn {flashgdn.__version__} | torch {torch.__version__} | device {args.device} ({dev_name})")
    print(f"backend: {chosen} (asked: {args.backend})")
    T, N, D = sum(args.seqlens), len(args.seqlens), args.dim
    print(f"shapes: q, k [1, {T}, {hqk}, {D}] v [1, {T}, {hv}, {D}] {args.dtype}; g, beta {_dt(t['g'].dtype)}; "
          f"{N} sequences {','.join(map(str, args.seqlens))}; initial state [{N}, {hv}, {D}, {D}] {_dt(t['initial_state'].dtype)}")

    def forward():
        with torch.no_grad():
            return run_op(t, args.backend, args.cp)

    ms = timed(forward, args.device, args.repeat)
    print(f"forward: {ms:.2f} ms (median of {args.repeat})")
    o, ht = forward()

    grads = None
    if args.backward:
        gen = torch.Generator().manual_seed(args.seed + 1)
        do = torch.randn(o.shape, generator=gen).to(args.device, o.dtype)
        dht = torch.randn(ht.shape, generator=gen).to(args.device, ht.dtype)
        leaves = {n: t[n].detach().requires_grad_() for n in INPUT_NAMES}
        tg = {**t, **leaves}

        def fwd_bwd():
            o_, ht_ = run_op(tg, args.backend, args.cp)
            return torch.autograd.grad((o_.float() * do.float()).sum() + (ht_ * dht).sum(), list(leaves.values()))

        ms_fb = timed(fwd_bwd, args.device, args.repeat)
        print(f"forward+backward: {ms_fb:.2f} ms (median of {args.repeat})")
        grads = dict(zip(leaves, fwd_bwd()))

    # the checked slice: the shortest non-empty sequence, qk heads [0, m) and value heads [0, m * group)
    n = min((i for i, s in enumerate(args.seqlens) if s > 0), key=lambda i: args.seqlens[i])
    lo, hi = int(t["cu_seqlens_cpu"][n]), int(t["cu_seqlens_cpu"][n + 1])
    m = args.check_heads
    sl_qk, sl_v = slice(0, m), slice(0, m * group)

    def cut(name, x):
        if name in ("q", "k"):
            return x[:, lo:hi, sl_qk]
        if name == "initial_state":
            return x[n : n + 1, sl_v]
        return x[:, lo:hi, sl_v]

    sub = {name: cut(name, t[name]).detach().double() for name in INPUT_NAMES}
    with torch.no_grad():
        o_ref, ht_ref = recurrent_gated_delta_rule(sub["q"], sub["k"], sub["v"], sub["g"], sub["beta"],
                                                   initial_state=sub["initial_state"], output_final_state=True)
    errs = {"o": rel_rms(o[:, lo:hi, sl_v], o_ref), "final_state": rel_rms(ht[n : n + 1, sl_v], ht_ref)}
    if grads is not None:
        leaves = {name: x.requires_grad_() for name, x in sub.items()}
        o64, ht64 = chunk_gated_delta_rule_reference(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                                                     leaves["beta"], initial_state=leaves["initial_state"],
                                                     output_final_state=True)
        loss = (o64 * do[:, lo:hi, sl_v].double()).sum() + (ht64 * dht[n : n + 1, sl_v].double()).sum()
        refs = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        errs.update({name: rel_rms(cut(name, grads[name]), refs[name]) for name in INPUT_NAMES})
    bars = BARS[DTYPES[args.dtype]]
    failed = [name for name, e in errs.items() if not e <= bars[name]]
    print(f"check vs float64 oracle (sequence {n}: {hi - lo} tokens; qk heads 0..{m - 1}, "
          f"value heads 0..{m * group - 1}), relative RMS:")
    print("  " + "  ".join(f"{LABELS[name]} {e:.1e}" for name, e in errs.items()))
    print("result: " + ("OK" if not failed else "FAILED: " + ", ".join(f"{LABELS[x]} > {bars[x]:.0e}" for x in failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
