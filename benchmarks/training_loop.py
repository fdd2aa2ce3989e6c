"""A training loop as it runs without CUDA graphs: each step a new batch, eager forward and backward, timed from the
host (what a step costs a training job, host syncs, launches and compiles included), implementations side by side in
one process.

    python benchmarks/training_loop.py --impl flashgdn --impl flashqla --shape 16/32:32768/8 --steps 20 --out loop.json

``--shape HQK/HV:TOKENS/N``: ``TOKENS`` in ``N`` packed sequences. Two kinds of batches (``--batches``):
* ``fresh``: every step a new random split of the tokens into N sequences (``shapes.random_split``, step i's seed the
  same for every implementation), as varlen training draws them: a new ``cu_seqlens`` tensor with new values;
* ``fixed``: every step the same split, warm-up included, in new ``cu_seqlens`` tensors (what a data loader hands over
  each step).
q, k, v, g, beta, the initial state and the output gradients are the benchmark's (``flashgdn.bench.inputs``) and stay;
only the offsets change. Each step's offsets are made on the host and copied to the device before the step's clock
starts; flashgdn also gets the host copy (``cu_seqlens_cpu``, which a data loader has), FlashQLA the device tensor its
API takes. A step is the forward and the gradients of every input (``runner.step_call``), between two
``torch.cuda.synchronize()``.

The first ``--warmup`` steps (their own splits) compile and load what a configuration needs and are reported apart;
any compile or load a later batch triggers is in its step's time, and each step records how many kernels entered
TileLang's in-memory caches during it (``loads``: both implementations' kernels are TileLang's, and each step runs one
of them). ``--preload`` calls ``flashgdn.preload`` for the shape's heads (the training builds with the benchmark's
flags) before flashgdn's warm-up, and records its time. Each implementation and shape stops at ``--budget-s``
seconds of timed steps, and says so. The figures: median, mean and longest step, and how many steps took over a
second. Nothing here is a CUDA graph: ``python -m flashgdn.bench`` times the kernels alone that way.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time

import torch

SLOW_STEP_S = 1.0


def parse_loop_shape(text: str):
    """``HQK/HV:TOKENS/N`` -> (Hqk, Hv, tokens, sequences); a ValueError names what is wrong."""
    try:
        heads, _, rest = text.partition(":")
        hq, hv = (int(x) for x in heads.split("/"))
        tokens, n = (int(x) for x in rest.split("/"))
    except ValueError:
        raise ValueError(f"--shape: expected HQK/HV:TOKENS/N (e.g. 16/32:32768/8), got {text!r}") from None
    if min(hq, hv, tokens, n) < 1 or hv % hq or n > tokens:
        raise ValueError(f"--shape {text!r}: positive counts, HV a multiple of HQK and N <= TOKENS")
    return hq, hv, tokens, n


def step_split(tokens: int, n: int, batches: str, step: int):
    """The sequence lengths of ``step`` (warm-up steps are negative): ``fresh`` a split of its own, ``fixed`` the same
    one at every step, warm-up included (so that its timed steps differ from each other by their tensors only)."""
    from flashgdn.bench.shapes import random_split

    return random_split(tokens, n, 1000 + (0 if batches == "fixed" else step))


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_inputs(hq, hv, tokens, n, batches, mode, device):
    """The benchmark's inputs (``flashgdn.bench.inputs``) for step 0's split, with output gradients for fwd+bwd."""
    from flashgdn.bench.inputs import make_inputs
    from flashgdn.bench.shapes import Shape

    return make_inputs(Shape("loop", hq, hv, step_split(tokens, n, batches, 0)), 128, 128, device,
                       with_grads=mode == "fwdbwd")


def run_loop(impl, hq, hv, tokens, n, batches, steps, warmup, budget_s, mode, device, preload=False):
    """One implementation on one shape and kind of batches: the record (times in ms)."""
    from flashgdn.bench.runner import step_call
    from flashgdn.bench.shapes import Shape
    from flashgdn.kernels.hopper.common import kernels_in_memory

    base = first_inputs(hq, hv, tokens, n, batches, mode, device)
    rec = dict(impl=impl.label, h_qk=hq, h_v=hv, tokens=tokens, sequences=n, batches=batches, mode=mode,
               warmup_ms=[], step_ms=[], warmup_loads=[], step_loads=[], note="")
    if preload and impl.label.startswith("flashgdn"):
        import flashgdn

        _synchronize(device)
        t0 = time.perf_counter()
        rec["preloaded"] = flashgdn.preload([(hq, hv)], dtype=base.q.dtype, training=mode == "fwdbwd",
                                            flags="common")
        rec["preload_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
    start = None
    for i in range(-warmup, steps):
        seqlens = step_split(tokens, n, batches, i)
        cu_cpu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
        inp = dataclasses.replace(base, shape=Shape("loop", hq, hv, tuple(seqlens)), cu_seqlens=cu_cpu.to(device),
                                  cu_seqlens_cpu=cu_cpu)
        call = step_call(impl.prepare(inp, mode), mode)
        _synchronize(device)
        held = kernels_in_memory()
        t0 = time.perf_counter()
        out, _ = call()
        _synchronize(device)
        ms = 1e3 * (time.perf_counter() - t0)
        loads = None if held is None else kernels_in_memory() - held
        if not bool(torch.isfinite(out[0]).all()):
            raise RuntimeError(f"{impl.label}: non-finite output at step {i} ({seqlens})")
        (rec["warmup_ms"] if i < 0 else rec["step_ms"]).append(round(ms, 4))
        (rec["warmup_loads"] if i < 0 else rec["step_loads"]).append(loads)
        if i >= 0:
            start = start if start is not None else t0
            if time.perf_counter() - start > budget_s and i + 1 < steps:
                rec["note"] = f"stopped by the budget ({budget_s} s) after {i + 1} of {steps} steps"
                break
    times = rec["step_ms"]
    rec.update(median_ms=statistics.median(times), mean_ms=statistics.fmean(times), max_ms=max(times),
               slow_steps=sum(t > 1e3 * SLOW_STEP_S for t in times),
               steps_loading=sum(1 for x in rec["step_loads"] if x))
    return rec


def report(records):
    lines = ["| shape | batches | impl | median ms | mean ms | longest ms | steps > 1 s | steps loading kernels | "
             "warm-up ms | x flashgdn |", "|---|---|---|---|---|---|---|---|---|---|"]
    ours = {(r["h_qk"], r["h_v"], r["tokens"], r["sequences"], r["batches"]): r["median_ms"]
            for r in records if r["impl"] == "flashgdn"}
    for r in records:
        key = (r["h_qk"], r["h_v"], r["tokens"], r["sequences"], r["batches"])
        ratio = f"{r['median_ms'] / ours[key]:.2f}x" if key in ours else "-"
        lines.append(f"| {r['h_qk']}/{r['h_v']} {r['tokens']}/{r['sequences']} | {r['batches']} | {r['impl']} | "
                     f"{r['median_ms']:.3f} | {r['mean_ms']:.3f} | {r['max_ms']:.1f} | {r['slow_steps']} of "
                     f"{len(r['step_ms'])} | {_loading(r)} | {', '.join(f'{t:.0f}' for t in r['warmup_ms'])}"
                     + (f" (preload {r['preload_ms']:.0f})" if "preload_ms" in r else "") + f" | {ratio} |"
                     + (f" {r['note']}" if r["note"] else ""))
    return "\n".join(lines)


def host_profile(impl, hq, hv, tokens, n, mode, device, steps: int = 5, top: int = 30) -> str:
    """``steps`` eager steps of one implementation under cProfile (after the loops: everything loaded), one split for
    all of them: where a step's host time goes, by cumulative and by own time (the text of ``pstats``)."""
    import cProfile
    import io
    import pstats

    from flashgdn.bench.runner import step_call

    call = step_call(impl.prepare(first_inputs(hq, hv, tokens, n, "fixed", mode, device), mode), mode)
    call()
    _synchronize(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        call()
        _synchronize(device)
    prof.disable()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    out = io.StringIO()
    out.write(f"# {impl.label} {hq}/{hv} {tokens}/{n} {mode}: {steps} steps under cProfile, {ms:.2f} ms a step\n")
    for key in ("cumulative", "tottime"):
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
    return out.getvalue()


def _loading(r) -> str:
    """Which timed steps loaded kernels, and how many each (``-`` where they could not be counted)."""
    loads = r.get("step_loads") or []
    if not loads or any(x is None for x in loads):
        return "-"
    hits = [f"step {i}: {x}" for i, x in enumerate(loads) if x]
    return ", ".join(hits) if hits else "none"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", action="append", help="flashgdn (default with flashqla), flashgdn:BACKEND, flashqla")
    ap.add_argument("--shape", action="append", help="HQK/HV:TOKENS/N; repeatable; default 16/32:32768/8, "
                                                     "2/4:32768/8, 16/32:8192/4, 4/16:8192/1")
    ap.add_argument("--batches", default="fresh,fixed", help="fresh, fixed or both")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=40.0, help="seconds of timed steps per implementation and shape")
    ap.add_argument("--mode", choices=("fwdbwd", "fwd"), default="fwdbwd")
    ap.add_argument("--preload", action="store_true", help="flashgdn.preload the shape's heads before flashgdn's warm-up")
    ap.add_argument("--host-profile", default=None, metavar="FILE",
                    help="after the loops, profile a few steps of each implementation on each shape's fixed split "
                         "(cProfile) into FILE")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        shapes = [parse_loop_shape(s) for s in (args.shape or ["16/32:32768/8", "2/4:32768/8", "16/32:8192/4",
                                                               "4/16:8192/1"])]
    except ValueError as e:
        ap.error(str(e))
    batches = [b.strip() for b in args.batches.split(",") if b.strip()]
    if not batches or any(b not in ("fresh", "fixed") for b in batches):
        ap.error(f"--batches: fresh, fixed or both, got {args.batches!r}")
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be at least 1")
    if not torch.cuda.is_available():
        print("training_loop.py times a GPU training loop; no CUDA device here", file=sys.stderr)
        return 2
    from flashgdn.bench.impls import one_impl

    device = torch.device("cuda")
    impls = []
    for text in args.impl or ["flashgdn", "flashqla"]:
        impl = one_impl(text)
        missing = impl.missing_reason(device)
        if missing:
            print(f"{impl.label} cannot run here: {missing}", file=sys.stderr)
            continue
        impls.append(impl)
    header = dict(command="python benchmarks/training_loop.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  gpu=torch.cuda.get_device_name(device),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  versions=_versions())
    records = []
    for hq, hv, tokens, n in shapes:
        for kind in batches:
            if kind == "fresh" and n == 1:
                continue  # one sequence: every split is the same
            for impl in impls:
                rec = run_loop(impl, hq, hv, tokens, n, kind, args.steps, args.warmup, args.budget_s, args.mode,
                               device, preload=args.preload)
                records.append(rec)
                print(report([rec]).splitlines()[-1], flush=True)
                if args.out:  # after every loop: a run cut short keeps what it measured
                    with open(args.out, "w") as f:
                        json.dump(dict(header, records=records), f, indent=1)
    print(report(records))
    if args.host_profile:
        with open(args.host_profile, "w") as f:
            for hq, hv, tokens, n in shapes:
                for impl in impls:
                    f.write(host_profile(impl, hq, hv, tokens, n, args.mode, device))
    return 0


def _versions():
    from importlib import metadata

    versions = {"torch": torch.__version__}
    for dist in ("flashgdn", "tilelang", "flash-qla"):
        try:
            versions[dist] = metadata.version(dist)
        except Exception:
            pass
    return versions


if __name__ == "__main__":
    sys.exit(main())
