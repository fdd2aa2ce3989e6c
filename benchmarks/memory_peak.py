"""Where one training step's peak device memory is: the allocations live at the peak, by the code that made them.

    python benchmarks/memory_peak.py --case 16/32:32768 [--case 8/16:949,465 ...] [--impl flashgdn|flashqla]
                                     [--cp auto|off|CHUNKS] [--out peak.json]

Runs what the benchmark's fwd+bwd measures (``flashgdn.bench``: the forward under autograd, then
``torch.autograd.grad`` of o and the final state with given output gradients, the final state's included), once to
load the kernels, then once more with torch's allocator history recorded. The recorded trace is replayed to the
peak of allocated bytes (counted from the step's start, as the benchmark's ``max_memory_allocated`` minus what was
allocated before it), and the allocations live there are printed largest first, grouped by the innermost two
flashgdn frames that made them (file:line function < its caller), beside what torch itself reports as the peak.
``--impl flashqla`` runs FlashQLA's op instead (its allocations are then named by their innermost frame outside
torch), to see what the other side holds at its peak on the same inputs. GPU only.
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


def _case(text: str):
    heads, _, lens = text.partition(":")
    Hqk, Hv = (int(x) for x in heads.split("/"))
    return Hqk, Hv, [int(x) for x in lens.split(",")]


def step_peak(impl: str, Hqk: int, Hv: int, seqlens: List[int], cp: str, top: int) -> dict:
    """One case: the peak above the step's start, torch's own figure, and the live allocations by origin."""
    import torch

    from stage_timing import make

    q, k, v, g, beta, h0, cu = make(Hqk, Hv, seqlens)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    do = torch.randn_like(v)
    dht = torch.randn_like(h0)
    if impl == "flashqla":
        from flash_qla import chunk_gated_delta_rule as op
        extra = {}
    else:
        from flashgdn import chunk_gated_delta_rule as op
        from flashgdn.cp.plan import parse_cp
        extra = dict(cu_seqlens_cpu=cu.cpu(), backend="hopper", cp=parse_cp(cp))

    def step():
        o, ht = op(q=leaves[0], k=leaves[1], v=leaves[2], g=leaves[3], beta=leaves[4], scale=128 ** -0.5,
                   initial_state=leaves[5], output_final_state=True, cu_seqlens=cu, **extra)
        grads = torch.autograd.grad((o, ht), leaves, (do, dht), allow_unused=True)
        return o, ht, grads

    out = step()  # loads the kernels, fills the allocator's cache
    del out
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500000, stacks="python")
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = step()
    torch.cuda.synchronize()
    torch_peak = torch.cuda.max_memory_allocated() - before
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    del out
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, live = peak_allocations(trace)
    rows = by_origin(live)
    mib = 2 ** 20
    lens = ",".join(map(str, seqlens))
    print(f"{impl} {Hqk}/{Hv} {lens} cp={cp}: peak {peak / mib:.2f} MiB above the step's start "
          f"(torch: {torch_peak / mib:.2f} MiB); live at the peak, by origin:")
    for origin, size, count in rows[:top]:
        print(f"  {size / mib:9.2f} MiB  {count:4d} x  {origin}")
    return {"impl": impl, "heads": f"{Hqk}/{Hv}", "seqlens": seqlens, "cp": cp, "peak_mib": peak / mib,
            "torch_peak_mib": torch_peak / mib, "live": [{"origin": o, "mib": s / mib, "count": c} for o, s, c in rows]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", default=None, metavar="HQK/HV:LEN[,LEN...]",
                    help="heads and sequence lengths, repeatable (default 16/32:32768)")
    ap.add_argument("--impl", default="flashgdn", choices=["flashgdn", "flashqla"])
    ap.add_argument("--cp", default="auto")
    ap.add_argument("--out", default=None, help="write the summaries as JSON here")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("memory_peak.py needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, "benchmarks")
    results = [step_peak(args.impl, *_case(c), args.cp, args.top) for c in args.case or ["16/32:32768"]]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
