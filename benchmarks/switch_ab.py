"""One switch of the Hopper backend (or several set together) timed both ways, side by side in one process (GPU only).

    python benchmarks/switch_ab.py --switch flashgdn.cp.backward:OVERLAP --set bwd --modes fwd,fwdbwd \
        --rounds 2 --out overlap-ab.json

For each shape and mode, the op as the benchmark harness runs it (``flashgdn.bench``: its inputs, ``cp="auto"``,
CUDA-graph timing by ``flashgdn.bench.timing.measure``; fwdbwd is the forward and ``torch.autograd.grad`` of o and
the final state) with ``MODULE:NAME`` set False and True, in alternating order over ``--rounds`` rounds (so that
neither side always runs first), and whether the two give the same bits on every output and gradient. The switch
must be one the backend reads when it runs (a host switch, or a build switch passed to the kernels when they are
asked for, as the build switches of ``backward`` are). Ratios are on/off of the medians over rounds; single times drift, ratios in one
process are the figure.

A switch that changes the rounding (not the bits' contract, e.g. a reordered sum) is timed with ``--max-diff X``: every
record also carries the largest relative RMS difference between the two sides' outputs and gradients
(``max_rel_diff``), and the run passes when that stays at or under X instead of when the bits are equal. Accuracy
against the float64 oracle is for the GPU tests; this only bounds how far the two sides drift apart.
"""
import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def op_fn(inp, mode: str, cp, backend: str = "hopper"):
    """``fn()`` -> the op's outputs (and gradients) on ``inp`` (``flashgdn.bench.inputs.Inputs``)."""
    from flashgdn import chunk_gated_delta_rule

    leaves = [t.detach().clone().requires_grad_(mode == "fwdbwd") for t in (inp.q, inp.k, inp.v, inp.g, inp.beta,
                                                                           inp.h0)]

    def fn():
        with torch.set_grad_enabled(mode == "fwdbwd"):
            q, k, v, g, beta, h0 = leaves
            o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=inp.scale, initial_state=h0,
                                           output_final_state=True, cu_seqlens=inp.cu_seqlens,
                                           cu_seqlens_cpu=inp.cu_seqlens_cpu, backend=backend, cp=cp)
            if mode == "fwd":
                return [o, ht]
            return [o.detach(), ht.detach()] + list(torch.autograd.grad((o, ht), leaves, (inp.do, inp.dht)))

    return fn


def main(argv=None) -> int:
    from flashgdn.bench.inputs import make_inputs
    from flashgdn.bench.shapes import custom_shapes, named_set
    from flashgdn.bench.timing import measure, timed_call
    from stage_timing import results_header

    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", required=True, help="MODULE:NAME of a boolean or 'auto' switch (several, comma separated: "
                    "set together), e.g. flashgdn.cp.backward:OVERLAP; MODULE:NAME=OFF/ON for any other switch, its "
                    "two sides' values as strings, e.g. flashgdn.kernels.hopper.forward:DEFAULT_CHUNK_LOOP=rso/fused")
    ap.add_argument("--set", default=None, help="shape set(s), comma separated (flashgdn.bench's)")
    ap.add_argument("--heads", default=None, help="custom shapes: head configs, with --seqlens")
    ap.add_argument("--seqlens", default=None)
    ap.add_argument("--shape", action="append", default=[],
                    help="one custom shape HQK/HV:SEQLENS, e.g. 2/4:22306+10462 (repeatable; beside --set)")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--ctas", choices=("few", "full"), default=None)
    ap.add_argument("--only-heads", default=None, help="keep the shapes of these head configs, e.g. 2/4,16/32")
    ap.add_argument("--cp", default="auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--backend", default="hopper", help="the op's backend (reference: the harness on a CPU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-diff", type=float, default=None,
                    help="pass on a relative RMS difference between the sides of at most this instead of equal bits")
    args = ap.parse_args(argv)

    switches = []  # (module, name, the off side's value, the on side's): set together
    for text in args.switch.split(","):
        module_name, name = text.split(":")
        name, _, sides = name.partition("=")
        module = importlib.import_module(module_name)
        if sides:
            off_value, _, on_value = sides.partition("/")
            if not on_value or not isinstance(getattr(module, name), str):
                raise SystemExit(f"--switch: {text}: NAME=OFF/ON is for a string switch, two values")
            switches.append((module, name, off_value, on_value))
            continue
        # ("auto" switches too: each side sets them to False, then True)
        if not isinstance(getattr(module, name), bool) and getattr(module, name) != "auto":
            raise SystemExit(f"--switch: {text} is neither a boolean switch nor an \"auto\" one")
        switches.append((module, name, False, True))
    shapes = []
    if args.set:
        for s in args.set.split(","):
            shapes += named_set(s)
    if args.heads or args.seqlens:
        shapes += custom_shapes(args.heads, args.seqlens)
    for text in args.shape:
        heads, _, mix = text.partition(":")
        if not mix:
            raise SystemExit(f"--shape: expected HQK/HV:SEQLENS, got {text!r}")
        shapes += custom_shapes(heads, mix)
    if args.ctas:
        shapes = [s for s in shapes if s.fills_gpu == (args.ctas == "full")]
    if args.only_heads:
        keep = {tuple(int(x) for x in h.split("/")) for h in args.only_heads.split(",")}
        shapes = [s for s in shapes if (s.h_qk, s.h_v) in keep]
    cp = int(args.cp) if args.cp.isdigit() else args.cp
    dev = torch.device(args.device)
    saved = [getattr(module, name) for module, name, _, _ in switches]
    header = results_header(argv, "switch_ab.py") if dev.type == "cuda" else {"device": "cpu"}
    records = []
    t_start = time.time()

    def save(final: bool):
        """The records so far, with their summary (also after each shape: a run cut short keeps what it timed)."""
        summary = {}
        for mode in args.modes.split(","):
            for fills in (True, False):
                rs = [r["ratio"] for r in records if r["mode"] == mode and r["fills_gpu"] == fills]
                if rs:
                    key = f"{mode},{'full' if fills else 'few'}"
                    summary[key] = dict(n=len(rs), geomean=math.exp(sum(map(math.log, rs)) / len(rs)),
                                        min=min(rs), max=max(rs))
                    if final:
                        print(f"{key}: {len(rs)} shapes, on/off geometric mean {summary[key]['geomean']:.3f} "
                              f"({min(rs):.3f}-{max(rs):.3f})")
        if final:
            print(f"all same bits: {all(r['same_bits'] for r in records)}; largest relative difference "
                  f"{max((r['max_rel_diff'] for r in records), default=0.0):.2e}; {time.time() - t_start:.0f} s")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({**header, "switch": args.switch, "rounds": args.rounds, "complete": final,
                           "max_diff": args.max_diff,
                           "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FLASHGDN_")},
                           "summary": summary, "records": records}, f, indent=1)

    try:
        for shape in shapes:
            inp = make_inputs(shape, 128, 128, dev, with_grads=True)
            for mode in args.modes.split(","):
                fn = op_fn(inp, mode, cp, args.backend)
                outs, ms = {}, {False: [], True: []}
                for r in range(args.rounds):
                    for value in ((False, True) if r % 2 == 0 else (True, False)):
                        for module, name, off_value, on_value in switches:
                            setattr(module, name, on_value if value else off_value)
                        out, _ = timed_call(fn, dev)  # loads (or compiles) this side's kernels
                        if value not in outs:
                            outs[value] = [x.detach().clone() for x in out]
                        del out
                        _, steady = timed_call(fn, dev)
                        ms[value].append(measure(fn, dev, steady).ms)
                same = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
                diff = max(rel_diff(a, b) for a, b in zip(outs[True], outs[False]))
                off, on = statistics.median(ms[False]), statistics.median(ms[True])
                rec = dict(h_qk=shape.h_qk, h_v=shape.h_v, seqlens=list(shape.seqlens), mode=mode,
                           fills_gpu=shape.fills_gpu, ms_off=off, ms_on=on, ratio=on / off, same_bits=same,
                           max_rel_diff=diff,
                           ms_off_rounds=ms[False], ms_on_rounds=ms[True])
                records.append(rec)
                print(f"{shape.label:48s} {mode:6s} off {off:8.4f} on {on:8.4f} ms  on/off {on / off:.3f}"
                      f"  same bits {same}  max rel diff {diff:.2e}", flush=True)
                del outs, fn
                save(False)
            del inp
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        for (module, name, _, _), value in zip(switches, saved):
            setattr(module, name, value)
    save(True)
    if args.max_diff is not None:
        return 0 if all(r["max_rel_diff"] <= args.max_diff for r in records) else 1
    return 0 if all(r["same_bits"] for r in records) else 1


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS difference of ``a`` from ``b`` (float64; 0 when both are zero, inf where only ``b`` is)."""
    a, b = a.double(), b.double()
    num, den = torch.linalg.vector_norm(a - b).item(), torch.linalg.vector_norm(b).item()
    if num == 0.0:
        return 0.0
    return num / den if den > 0 else math.inf


if __name__ == "__main__":
    sys.exit(main())
