"""The chunk-plan kernel (stage 0) timed alone, per build, side by side in one process (GPU only).

    python benchmarks/plan_timing.py --seqlens 28672+4096,32768,4096x8,2048,1000x500 --out plan-timing.json

For each sequence mix: the kernel's output against ``forward.chunk_plan_torch`` (bounds and first slots equal), and
its time per launch by ``flashgdn.bench.timing.measure`` (CUDA-graph replay, as the benchmark harness times the op).
(``forward/plan-timing-v0.22c.json`` was timed by a CUDA graph of 20 launches, median of 5 replays, and also timed the
build before v0.22c, in which each thread wrote its own sequence's slots, under "serial".)
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    from flashgdn.bench.shapes import parse_seqlens
    from flashgdn.bench.timing import measure, timed_call
    from flashgdn.kernels.hopper.chunk_plan import build_chunk_plan
    from flashgdn.kernels.hopper.forward import chunk_plan_torch, num_chunk_slots
    from stage_timing import results_header

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", required=True, help="mixes as flashgdn.bench writes them, comma separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    builds = {"parallel": build_chunk_plan()}
    dev = torch.device("cuda")
    out = {**results_header(argv, "plan_timing.py"), "rows": []}
    ok = True
    for mix in parse_seqlens(args.seqlens):
        cu_cpu = torch.tensor([0] + list(mix)).cumsum(0)
        cu = cu_cpu.to(torch.int32).cuda()
        N, T = len(mix), int(cu_cpu[-1])
        S = num_chunk_slots(T, N, cu_cpu)
        want_b, want_f = chunk_plan_torch(cu_cpu, T, N, cu_cpu)
        row = {"seqlens": list(mix), "slots": S, "us": {}, "timer": {}, "same": {}}
        for name, kernel in builds.items():
            bounds = torch.full((S, 2), -1, dtype=torch.int32, device="cuda")
            first = torch.full((N,), -1, dtype=torch.int32, device="cuda")
            kernel(cu, bounds, first)
            torch.cuda.synchronize()
            row["same"][name] = bool(torch.equal(bounds.cpu(), want_b) and torch.equal(first.cpu(), want_f))
            ok &= row["same"][name]
            _, steady_s = timed_call(lambda: kernel(cu, bounds, first), dev)
            timing = measure(lambda: kernel(cu, bounds, first), dev, steady_s)
            row["us"][name], row["timer"][name] = 1e3 * timing.ms, timing.timer
        out["rows"].append(row)
        label = "+".join(map(str, mix)) if N <= 4 else f"{N} sequences, {T} tokens"
        print(f"{label:<32} slots {S:6d}  " + "  ".join(f"{k} {v:7.2f} us" for k, v in row["us"].items())
              + f"  same as torch: {row['same']}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
