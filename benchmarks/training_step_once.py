"""A few forward + backward calls of one implementation on one shape, and nothing else: the process to run under
Nsight Compute when the kernels of a training step are to be profiled side by side with an anchor's (flashgdn's
fused backward beside FlashQLA's, say), each implementation in its own process so that each profile holds only its
own kernels. The inputs are the benchmark's (``flashgdn.bench.inputs.make_inputs``, so the same tensors for every
implementation); the first ``--warmup`` calls compile and warm, and the profiler is told to skip their launches.

    python benchmarks/training_step_once.py --impl flashqla --shape 16/32:4096x8 --calls 2
    ncu -k regex:fused_chunk_gdr_bwd --launch-skip 1 --launch-count 1 python benchmarks/training_step_once.py ...

Prints each call's wall time (a sanity check, not a benchmark: ``python -m flashgdn.bench`` times)."""
from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", default="flashgdn", help="flashgdn, flashgdn:BACKEND, flashqla or fla")
    ap.add_argument("--shape", default="16/32:4096x8", help="HQK/HV:SEQLENS, as the benchmark's --heads/--seqlens")
    ap.add_argument("--calls", type=int, default=2, help="forward + backward calls after the warm-up")
    ap.add_argument("--warmup", type=int, default=1, help="calls before them (compiles and first launches)")
    ap.add_argument("--mode", choices=("fwdbwd", "fwd"), default="fwdbwd")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--nvtx", action="store_true",
                    help="put each call after the warm-up in an NVTX range named \"call\" (for ncu --nvtx "
                         "--nvtx-include call/, where an implementation's launches per call are not known)")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.warmup < 0:
        ap.error("--calls must be at least 1 and --warmup at least 0")

    from flashgdn.bench.impls import one_impl
    from flashgdn.bench.runner import shape_call
    from flashgdn.bench.shapes import parse_shape

    try:
        shape = parse_shape(args.shape)
        impl = one_impl(args.impl)
    except ValueError as e:
        ap.error(str(e))
    device = torch.device(args.device)
    missing = impl.missing_reason(device)
    if missing:
        print(f"{impl.label} cannot run here: {missing}", file=sys.stderr)
        return 2
    call = shape_call(impl, shape, device, args.mode)
    for i in range(args.warmup + args.calls):
        t = time.perf_counter()
        ranged = args.nvtx and i >= args.warmup and device.type == "cuda"
        if ranged:
            torch.cuda.nvtx.range_push("call")
        call()
        if ranged:
            torch.cuda.nvtx.range_pop()
        if device.type == "cuda":
            torch.cuda.synchronize()
        what = "warm-up" if i < args.warmup else "call"
        print(f"{impl.label} {args.mode} {args.shape} {what} {i}: {1e3 * (time.perf_counter() - t):.2f} ms (wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
