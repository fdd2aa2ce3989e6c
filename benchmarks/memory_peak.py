"""Where one training step's peak device memory is: the allocations live at the peak, by the code that made them.

    python benchmarks/memory_peak.py --heads 16/32 --seqlens 32768 [--cp auto|off|CHUNKS] [--out peak.json]

Runs a forward and backward of ``chunk_gated_delta_rule`` (Hopper backend, autograd, the final state's gradient
included) once to load the kernels, then once more with torch's allocator history recorded. The recorded trace
is replayed to the peak of allocated bytes (counted from the step's start, as ``max_memory_allocated`` minus what
was allocated before it), and the allocations live there are printed largest first, grouped by the innermost
two flashgdn frames that made them (file:line function < its caller), beside what torch itself reports as the peak. GPU only.
"""
import argparse
import json
import sys
from collections import defaultdict
from typing import Dict, Iterable, List, Tuple


def peak_allocations(trace: Iterable[dict]) -> Tuple[int, List[dict]]:
    """``(peak, live)``: the most bytes allocated at once above the trace's start, and the allocation events live
    at that moment. ``trace`` is a device trace of ``torch.cuda.memory._snapshot()``: "alloc" adds its size,
    "free_requested" removes its size (also for blocks allocated before the trace began, so the count follows
    ``torch.cuda.memory_allocated``); other actions (segment maps, the completion of a free) change nothing."""
    live: Dict[int, dict] = {}
    current = peak = 0
    at_peak: List[dict] = []
    for event in trace:
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, at_peak = current, list(live.values())
        elif action == "free_requested":
            live.pop(event["addr"], None)
            current -= event["size"]
    return peak, at_peak


def _frame(f: dict) -> str:
    name = f.get("filename", "")
    short = name.split("flashgdn/")[-1] if "flashgdn/" in name else name
    return f"{short}:{f.get('line')} {f.get('name')}"


def made_by(event: dict) -> str:
    """The innermost flashgdn frame of an allocation's Python stack (``file:line function``) and, after " < ", the
    flashgdn frame that called it (so allocations made by a shared helper are told apart by their call sites);
    without a flashgdn frame, the innermost frame outside torch; else "?"."""
    frames = [f for f in event.get("frames") or [] if f.get("filename") and "/torch/" not in f["filename"]]
    ours = [f for f in frames if "flashgdn" in f["filename"]]
    if ours:
        return " < ".join(_frame(f) for f in ours[:2])
    return _frame(frames[0]) if frames else "?"


def by_origin(live: Iterable[dict]) -> List[Tuple[str, int, int]]:
    """Live allocations summed by ``made_by``: ``(origin, bytes, count)``, largest first."""
    total: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    for event in live:
        t = total[made_by(event)]
        t[0] += event["size"]
        t[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in total.items()), key=lambda x: -x[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="16/32")
    ap.add_argument("--seqlens", default="32768", help="comma-separated lengths")
    ap.add_argument("--cp", default="auto")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("memory_peak.py needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, "benchmarks")
    from stage_timing import make

    from flashgdn import chunk_gated_delta_rule
    from flashgdn.cp.plan import parse_cp

    Hqk, Hv = (int(x) for x in args.heads.split("/"))
    seqlens = [int(x) for x in args.seqlens.split(",")]
    q, k, v, g, beta, h0, cu = make(Hqk, Hv, seqlens)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta, h0)]

    def step():
        qq, kk, vv, gg, bb, hh = leaves
        o, ht = chunk_gated_delta_rule(q=qq, k=kk, v=vv, g=gg, beta=bb, scale=128 ** -0.5, initial_state=hh,
                                       output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
                                       backend="hopper", cp=parse_cp(args.cp))
        (o.float().square().sum() + ht.square().sum()).backward()
        for t in leaves:
            t.grad = None

    step()  # loads the kernels, fills the allocator's cache
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500000, stacks="python")
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    torch_peak = torch.cuda.max_memory_allocated() - before
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, live = peak_allocations(trace)
    rows = by_origin(live)
    mib = 2 ** 20
    print(f"{args.heads} {args.seqlens} cp={args.cp}: peak {peak / mib:.1f} MiB above the step's start "
          f"(torch: {torch_peak / mib:.1f} MiB); live at the peak, by origin:")
    for origin, size, count in rows[:args.top]:
        print(f"  {size / mib:9.1f} MiB  {count:4d} x  {origin}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"heads": args.heads, "seqlens": seqlens, "cp": args.cp, "peak_mib": peak / mib,
                       "torch_peak_mib": torch_peak / mib,
                       "live": [{"origin": o, "mib": s / mib, "count": c} for o, s, c in rows]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
