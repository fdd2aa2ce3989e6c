"""Where one training step's GPU time goes, kernel by kernel (GPU only; torch.profiler).

    python benchmarks/step_kernels.py --shape 16/32:4096x8 --shape 2/8:32768 --out step.json
    python benchmarks/step_kernels.py --impl flashgdn --impl flashqla --cp auto --shape 16/32:8192

Runs an implementation's forward and backward (flashgdn's unless ``--impl`` names others, each shape for each) as the
benchmark harness does (``flashgdn.bench``: bf16 q/k/v, float32 g, beta and initial state, every input a leaf,
``torch.autograd.grad``), twice to load the kernels, then ``--steps``
times under the profiler, and prints each kernel's time per step with its share of the step's kernel time,
grouped by the kernel's name (TileLang kernels by their stage, PyTorch's by theirs). The stage timings
(``stage_timing.py``) time each stage alone; this says what else runs between them and how long it takes.
"""
import argparse
import json
import sys
from collections import defaultdict

import torch


def step_fn(impl_name: str, h_qk: int, h_v: int, seqlens, cp: str, mode: str = "fwdbwd"):
    """One call of ``impl_name`` (flashgdn, flashgdn:BACKEND, flashqla, fla, flashinfer) as the benchmark harness
    makes it (``flashgdn.bench.runner.step_call``); ``cp`` reaches flashgdn only (the anchors choose their own)."""
    from flashgdn.bench.impls import one_impl
    from flashgdn.bench.runner import shape_call
    from flashgdn.bench.shapes import Shape

    impl = one_impl(impl_name, cp=cp)
    device = torch.device("cuda")
    missing = impl.missing_reason(device)
    if missing:
        raise RuntimeError(f"{impl.label} cannot run here: {missing}")
    return shape_call(impl, Shape("custom", h_qk, h_v, tuple(seqlens)), device, mode)


def profile(step, steps: int):
    from torch.profiler import ProfilerActivity, profile as tprofile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = prof.events()
    return per_kernel(events, steps), one_step_in_order(events, steps)


def one_step_in_order(events, steps: int):
    """``[(kernel name, start us, ms)]`` of the last profiled step, in launch order, start relative to the step's
    first kernel: the chain of kernels (and the gaps between them) that the totals hide."""
    gpu = sorted((ev for ev in events if ev.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda ev: ev.time_range.start)
    per_step = len(gpu) // steps
    last = gpu[len(gpu) - per_step:]
    if not last:
        return []
    t0 = last[0].time_range.start
    return [(ev.name, ev.time_range.start - t0, ev.device_time_total / 1000.0) for ev in last]


def per_kernel(events, steps: int):
    """``[(kernel name, ms per step, calls per step)]``, most time first, from the profiler's events (the GPU ones:
    ``device_type`` CUDA, ``device_time_total`` in us) of ``steps`` steps."""
    per = defaultdict(lambda: [0.0, 0])
    for ev in events:
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time_total / 1000.0 / steps
            per[ev.name][1] += 1
    return sorted(((name, ms, n // steps) for name, (ms, n) in per.items()), key=lambda r: -r[1])


def side_by_side(results):
    """One line per shape: each implementation's kernel time per step, and its ratio to the first one's (the
    records of ``main``, in their order: every implementation of a shape together)."""
    by_shape = {}
    for r in results:
        by_shape.setdefault((r["heads"], tuple(r["seqlens"]), r["mode"]), []).append(r)
    lines = []
    for (heads, seqlens, mode), rs in by_shape.items():
        base = rs[0]["total_ms"]
        mix = "+".join(map(str, seqlens)) if len(seqlens) <= 4 else f"{len(seqlens)} seqs of {sum(seqlens)} tokens"
        parts = [f"{r['impl']} {r['total_ms']:.3f}" + ("" if i == 0 else f" ({r['total_ms'] / base:.2f}x)")
                 for i, r in enumerate(rs)]
        lines.append(f"{heads} {mix} {mode}: " + ", ".join(parts))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", help="HQK/HV:MIX (MIX as the harness's --seqlens: 4096x8, "
                    "1000+3000); repeatable; default 16/32:4096x8")
    ap.add_argument("--impl", action="append", help="flashgdn (default), flashgdn:BACKEND, flashqla, fla or "
                    "flashinfer; repeatable: each shape profiled for each, in the order given")
    ap.add_argument("--cp", default="off", help="flashgdn's cp= (off, auto or a segment length in chunks)")
    ap.add_argument("--mode", choices=("fwdbwd", "fwd"), default="fwdbwd")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sequence", action="store_true", help="also print the last step's kernels in launch order")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("step_kernels.py needs a CUDA device")
    from flashgdn.bench.shapes import parse_seqlens

    results = []
    for spec, impl in [(s, i) for s in args.shape or ["16/32:4096x8"] for i in args.impl or ["flashgdn"]]:
        heads, mix = spec.split(":")
        h_qk, h_v = (int(x) for x in heads.split("/"))
        seqlens = parse_seqlens(mix)[0]
        rows, sequence = profile(step_fn(impl, h_qk, h_v, seqlens, args.cp, args.mode), args.steps)
        total = sum(ms for _, ms, _ in rows)
        cp = f", cp={args.cp}" if impl.startswith("flashgdn") else ""
        label = f"{impl} {args.mode} {h_qk}/{h_v} {len(seqlens)} seqs, {sum(seqlens)} tokens{cp}"
        print(f"\n{label}: {total:.3f} ms of kernels per step")
        for name, ms, n in rows:
            print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{n:<3d} {name[:110]}")
        if args.sequence:
            print("  the last step in launch order (start us, ms):")
            for name, start, ms in sequence:
                print(f"    {start:9.1f} {ms:8.4f}  {name[:100]}")
        results.append(dict(impl=impl, mode=args.mode, heads=heads, seqlens=list(seqlens),
                            cp=args.cp if impl.startswith("flashgdn") else None, total_ms=total,
                            kernels=[dict(name=name, ms=ms, calls=n) for name, ms, n in rows],
                            sequence=[dict(name=name, start_us=start, ms=ms) for name, start, ms in sequence]))
    if len(args.impl or []) > 1:
        print("\nkernel time per step, side by side (ms; each against the first implementation):")
        for line in side_by_side(results):
            print("  " + line)
    if args.out:
        sys.path.insert(0, "benchmarks")
        from stage_timing import results_header

        with open(args.out, "w") as f:
            json.dump(results_header(argv, "step_kernels.py") | dict(results=results), f, indent=1)


if __name__ == "__main__":
    main()
