"""The context-parallel cost model (``flashgdn/cp/plan.py``) against the H200 measurements it was fitted to.

    python benchmarks/cp_model_check.py [--stages FILE.json] [--bench FILE.json]

1. Fits the model's stage constants again from a stage-timing file (``benchmarks/stage_timing.py``; default
   ``benchmarks/results/h200/stages-hopper-v0.12b.json``, whose swizzled-v columns the defaults come from) and
   prints them beside ``CostModel``'s defaults.
2. Models every row of that file without context parallelism, stage by stage and as a whole, against the
   measured times, and with it at the segment lengths the file has op columns for (``op_cp16``, ...).
3. Compares the model with flashgdn's forward times in a benchmark file (default
   ``benchmarks/results/h200/latest.json``), when there is one.
4. Prints what ``cp="auto"`` would do on the canonical and cp shape sets: the segment length it picks and the
   predicted speedup, for the shapes it splits.
CPU only: it reads files and runs the model.
"""
import argparse
import json
import math
import os
import sys
from statistics import median

import numpy as np

from flashgdn.bench.shapes import canonical_set, cp_set
from flashgdn.cp.plan import (CANDIDATE_SEGMENT_CHUNKS, CHUNK, CostModel, estimated_us, plan_segments)

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = os.path.join(HERE, "results", "h200", "stages-hopper-v0.12b.json")
BENCH = os.path.join(HERE, "results", "h200", "latest.json")


def chunks_of(seqlens):
    return [max(1, math.ceil(L / CHUNK)) for L in seqlens]


def label(hq, hv, seqlens):
    mix = f"{seqlens[0]}x{len(seqlens)}" if len(set(seqlens)) == 1 else "+".join(map(str, seqlens))
    return f"{hq}/{hv} {mix}"


def lstsq(rows, cols):
    sol, *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(cols, dtype=float), rcond=None)
    return sol


def columns(rows):
    """Which measured columns stand for the op's stages: stage 1 as the op runs it (``kkt_inverse_async``, the
    cp.async build, where the file has it), the default chunk loop (``loop_rso`` where the file has it, else the
    rs loop of the files before it), CP's transition pass (rs's state-only loop) and the op. A file with the
    swizzled-v A/B columns (``loop_rso_swv``, ``loop_rs_state_swv``, ``op_rso_swv``: stages-hopper-v0.12b.json)
    gives those, the builds that are the default since."""
    kkt = "kkt_inverse_async" if all(r.get("kkt_inverse_async") for r in rows) else "kkt_inverse"
    if all(r.get("loop_rso_swv") and r.get("loop_rs_state_swv") and r.get("op_rso_swv") for r in rows):
        return kkt, "loop_rso_swv", "loop_rs_state_swv", "op_rso_swv"
    loop = "loop_rso" if all(r.get("loop_rso") for r in rows) else "loop_rs"
    return kkt, loop, "loop_rs_state", "op"


def fit(rows, num_sms):
    """The stage constants from the measured rows (times in us)."""
    out = {}
    kkt_key, loop_key, state_key, _ = columns(rows)
    C = [sum(chunks_of(r["seqlens"])) for r in rows]
    longest = [max(chunks_of(r["seqlens"])) for r in rows]
    items = [len(r["seqlens"]) * r["h_v"] for r in rows]
    a, b = lstsq([[c * r["h_qk"], c * r["h_v"]] for c, r in zip(C, rows)], [r[kkt_key] * 1e3 for r in rows])
    out["kkt_chunk_qk_head_us"], out["kkt_chunk_head_us"] = a, b
    # the chunk plan by its total slot count (v0.22c)
    out["plan_us"], out["plan_chunk_us"] = lstsq([[1, c] for c in C], [r["chunk_bounds"] * 1e3 for r in rows])
    for key, name in ((loop_key, "forward"), (state_key, "state")):
        few = [i for i in range(len(rows)) if items[i] <= num_sms]  # one wave: the longest item decides
        item, chunk = lstsq([[1, longest[i]] for i in few], [rows[i][key] * 1e3 for i in few])
        full = [i for i in range(len(rows)) if items[i] > num_sms]  # GPU full: throughput
        busy = [(rows[i][key] * 1e3 * num_sms - items[i] * item) / (C[i] * rows[i]["h_v"]) for i in full]
        out[f"{name}_item_us"], out[f"{name}_chunk_us"] = item, chunk
        out[f"{name}_busy_chunk_us"] = sum(busy) / len(busy) if busy else float("nan")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default=STAGES)
    ap.add_argument("--bench", default=BENCH)
    ap.add_argument("--unpaired", action="store_true", help="model CP's transition pass unpaired "
                    "(FLASHGDN_HOPPER_CP_PAIRED=0; paired is the backend's default)")
    ap.add_argument("--unfused", action="store_true", help="model CP's index and splice as torch ops "
                    "(FLASHGDN_HOPPER_CP_FUSED=0; fused is the backend's default)")
    args = ap.parse_args(argv)
    model = CostModel(paired=not args.unpaired, fused=not args.unfused)  # as the backend plans by default
    with open(args.stages) as fh:
        stages = json.load(fh)
    rows = stages["rows"]

    print(f"## Fit from {os.path.relpath(args.stages)} ({stages.get('gpu')}, commit {stages.get('commit')})\n")
    print("| constant | fitted | CostModel |\n|---|---|---|")
    for name, value in fit(rows, model.num_sms).items():
        print(f"| {name} | {value:.4g} | {getattr(model, name):.4g} |")

    kkt_key, loop_key, state_key, op_key = columns(rows)
    print("\n## Without context parallelism: model / measured (ms)\n")
    print(f"| shape | plan | {kkt_key} | {loop_key} | {state_key} | {op_key} measured | op model | model / measured |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ch, hq, hv = chunks_of(r["seqlens"]), r["h_qk"], r["h_v"]
        plan = (model.plan_us + sum(ch) * model.plan_chunk_us) / 1e3
        kkt = sum(ch) * (hq * model.kkt_chunk_qk_head_us + hv * model.kkt_chunk_head_us) / 1e3
        fwd, st = model.loop_us(ch, hv) / 1e3, model.loop_us(ch, hv, state_only=True) / 1e3
        op = estimated_us(r["seqlens"], hv, None, model, hq) / 1e3
        print(f"| {label(hq, hv, r['seqlens'])} | {plan:.4f} / {r['chunk_bounds']:.4f} "
              f"| {kkt:.3f} / {r[kkt_key]:.3f} | {fwd:.3f} / {r[loop_key]:.3f} "
              f"| {st:.3f} / {r[state_key]:.3f} | {r[op_key]:.3f} | {op:.3f} | {op / r[op_key]:.2f} |")

    cps = sorted({int(k[len("op_cp"):]) for r in rows for k in r if k.startswith("op_cp") and k[5:].isdigit()})
    if op_key != "op":  # the file's CP columns timed the builds before the swizzled-v ones the fit used
        print("\n(the file's op_cp columns timed other builds than the fitted ones: for CP, the records of "
              "benchmarks/cp_choices.py, e.g. cp-choices-v0.12c.json)")
        cps = []
    if cps:
        print("\n## With context parallelism (cp=n chunks, as stage_timing.py runs it): model / measured (ms)\n")
        print("| shape | " + " | ".join(f"cp={c}: segments, model / measured" for c in cps) + " |")
        print("|---|" + "---|" * len(cps))
        for r in rows:
            cells = []
            for c in cps:
                segs = sum(max(1, math.ceil(n / c)) for n in chunks_of(r["seqlens"]))
                mod = estimated_us(r["seqlens"], r["h_v"], c, model, r["h_qk"]) / 1e3
                got = r.get(f"op_cp{c}")
                cells.append(f"{segs}: {mod:.3f} / " + ("-" if got is None else f"{got:.3f}"))
            print(f"| {label(r['h_qk'], r['h_v'], r['seqlens'])} | " + " | ".join(cells) + " |")

    if args.bench and os.path.exists(args.bench):
        with open(args.bench) as fh:
            recs = [x for x in json.load(fh)["records"]
                    if x.get("impl") == "flashgdn" and x.get("mode") == "fwd" and x.get("status") == "run"
                    and x.get("ms")]
        if recs:
            ratio = sorted((estimated_us(x["seqlens"], x["h_v"], None, model, x["h_qk"]) / 1e3 / x["ms"], x)
                           for x in recs)
            vals = [q for q, _ in ratio]
            print(f"\n## flashgdn forward in {os.path.relpath(args.bench)}: {len(vals)} shapes, model / measured "
                  f"min {vals[0]:.2f}, median {median(vals):.2f}, max {vals[-1]:.2f}")
            for q, x in ratio[:3] + ratio[-3:]:
                print(f"  {label(x['h_qk'], x['h_v'], x['seqlens'])}: {q:.2f} (measured {x['ms']:.3f} ms)")

    for name, shapes in (("canonical", canonical_set()), ("cp", cp_set())):
        split = []
        for s in shapes:
            plan = plan_segments(list(s.seqlens), s.h_v, "auto", model, qk_heads=s.h_qk)
            if plan.split:
                off = estimated_us(s.seqlens, s.h_v, None, model, s.h_qk)
                on = estimated_us(s.seqlens, s.h_v, plan.segment_chunks, model, s.h_qk)
                split.append((s, plan.segment_chunks, off, on))
        print(f"\n## cp=\"auto\" on the {name} set: {len(split)} of {len(shapes)} shapes split "
              f"(segment lengths tried: {', '.join(map(str, CANDIDATE_SEGMENT_CHUNKS))} chunks)\n")
        if split:
            print("| shape | segment (chunks) | model off (ms) | model cp (ms) | predicted speedup |")
            print("|---|---|---|---|---|")
            for s, seg, off, on in split:
                print(f"| {label(s.h_qk, s.h_v, s.seqlens)} | {seg} | {off / 1e3:.3f} | {on / 1e3:.3f} "
                      f"| {off / on:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
