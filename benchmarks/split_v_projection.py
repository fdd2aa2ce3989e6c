"""What the split of V over a cluster of two (docs/hopper-notes.md "The split of V over a cluster of two, counted")
could take off a training step, by the context-parallel cost model, before any of it is built.

    python benchmarks/split_v_projection.py --records benchmarks/results/h100/v0.37/cp-set-part1.json \
        benchmarks/results/h100/v0.37/cp-set-part2.json benchmarks/results/h100/v0.37/bwd-set.json \
        --step-factors 0.55,0.65,0.75,0.85 --out benchmarks/results/cpu/split-v-projection.md

The split runs the fused backward on twice the CTAs (a pair per item and value head), each chunk step taking
``f`` times today's (``--step-factors``: the chain's products are half, the gate side's are not, and the exchange
adds what ``dsmem_exchange.py`` measures). For each shape of the given benchmark records the backward's plan is made
as the backend makes it today (``plan_backward`` with the backend's cost model) and again with the split offered as
a further choice for every segment length (the planner's and two longer ones) and for none, and the best estimate
taken. The model's saving (its
estimate today less the best with the split, in microseconds of the H200's constants) is taken off the measured
fwd+bwd time of that shape; the report gives that projected time against FlashQLA's in the same records. It is an
upper bound of what the split can give under the model: the model's other stages are as they run today, and the
exchange is only in ``f``.
"""
import argparse
import dataclasses
import datetime
import json
import math
import sys

from flashgdn.cp import plan as cp_plan
from flashgdn.kernels.hopper.backend import cp_cost_model


#: segment lengths beyond the planner's candidates, offered to the split only: with twice the CTAs a sequence needs
#: half the segments to fill the SMs
LONGER_SEGMENT_CHUNKS = (512, 1024)


@dataclasses.dataclass(frozen=True)
class SplitModel(cp_plan.CostModel):
    """The cost model with the fused kernel split over V: twice the CTAs, each chunk step ``step_factor`` times
    today's (its per-item cost as today's)."""

    step_factor: float = 1.0

    def backward_gradients_us(self, item_chunks, heads):
        fused = self.makespan_us(item_chunks, 2 * heads, self.fused_item_us, self.step_factor * self.fused_chunk_us,
                                 self.step_factor * self.fused_busy_chunk_us, self.fused_longest_first)
        return fused, math.inf


def backward_us(seqlens, heads, model, split_model=None):
    """The backward's estimate (us) of the plan ``plan_backward`` makes with ``model`` and, with ``split_model``,
    the best of that and the split on every candidate segment length (and none)."""
    longest = max(-(-int(L) // cp_plan.CHUNK) for L in seqlens)
    chosen = cp_plan.plan_backward(seqlens, heads, "auto", model)
    seg = None if chosen.plan is None else chosen.plan.segment_chunks
    today = cp_plan.backward_estimated_us(seqlens, heads, seg, model)[0]
    if split_model is None:
        return today, seg
    best = (today, seg)
    for c in [None, *cp_plan.CANDIDATE_SEGMENT_CHUNKS, *LONGER_SEGMENT_CHUNKS]:
        if c is not None and c >= longest:
            continue
        us = cp_plan.backward_estimated_us(seqlens, heads, c, split_model)[0]
        best = min(best, (us, c), key=lambda x: x[0])
    return best


def projection(records, factors):
    by_shape = {}
    for r in records:
        if r.get("mode") != "fwdbwd" or r.get("status") != "run":
            continue
        key = (r["set"], r["h_qk"], r["h_v"], tuple(r["seqlens"]))
        by_shape.setdefault(key, {})[r["impl"]] = r["ms"]
    model = cp_cost_model(None)
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    rows = []
    for key, ms in sorted(by_shape.items()):
        if "flashgdn" not in ms or "flashqla" not in ms:
            continue
        _, hqk, hv, seqlens = key
        today, seg = backward_us(seqlens, hv, model)
        row = dict(shape=key, ms=ms["flashgdn"], fq_ms=ms["flashqla"], today_us=today, today_seg=seg, split=[])
        for f in factors:
            us, s = backward_us(seqlens, hv, model, SplitModel(**fields, step_factor=f))
            row["split"].append((f, us, s, ms["flashgdn"] - (today - us) / 1000.0))
        rows.append(row)
    return rows


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def report(rows, factors, sources):
    out = ["# The split of V over a cluster of two, projected by the cost model (not measured)", "",
           "Command: `python benchmarks/split_v_projection.py " + " ".join(sys.argv[1:]) + "` (CPU, "
           + datetime.date.today().isoformat() + ", the model of `flashgdn/cp/plan.py` as the Hopper backend sets it)",
           "",
           "Records: " + ", ".join(f"`{s}`" for s in sources) + ". x FQ is FlashQLA's fwd+bwd time over flashgdn's "
           "(above 1: flashgdn faster); `seg` the backward's segment length in chunks (- none).", ""]
    by_set = {}
    for r in rows:
        by_set.setdefault(r["shape"][0], []).append(r)
    out.append("| set | shapes | x FQ today | " + " | ".join(f"x FQ, f = {f}" for f in factors) +
               " | " + " | ".join(f"shapes the split takes, f = {f}" for f in factors) + " |")
    out.append("|---|---|---|" + "---|" * (2 * len(factors)))
    for name, rs in sorted(by_set.items()):
        cells = [name, str(len(rs)), f"{geomean([r['fq_ms'] / r['ms'] for r in rs]):.3f}x"]
        cells += [f"{geomean([r['fq_ms'] / r['split'][i][3] for r in rs]):.3f}x" for i in range(len(factors))]
        cells += [str(sum(r["split"][i][1] < r["today_us"] for r in rs)) for i in range(len(factors))]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Per shape (model us: the backward's stages the plan changes, H200 constants):", "",
            "| set | Hqk/Hv | seqlens | ms | x FQ | model today (seg) | " +
            " | ".join(f"f = {f}: model (seg), x FQ" for f in factors) + " |",
            "|---|---|---|---|---|---|" + "---|" * len(factors)]
    for r in rows:
        s, hqk, hv, seqlens = r["shape"]
        mix = ",".join(str(x) for x in seqlens) if len(seqlens) <= 3 else f"{len(seqlens)} seqs, {sum(seqlens)} tok"
        cells = [s, f"{hqk}/{hv}", mix, f"{r['ms']:.3f}", f"{r['fq_ms'] / r['ms']:.3f}x",
                 f"{r['today_us']:.0f} ({r['today_seg'] or '-'})"]
        cells += [f"{us:.0f} ({seg or '-'}), {r['fq_ms'] / ms:.3f}x" for _, us, seg, ms in r["split"]]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", nargs="+", required=True, help="benchmark result files (flashgdn and flashqla fwdbwd)")
    ap.add_argument("--step-factors", default="0.55,0.65,0.75,0.85")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    factors = [float(x) for x in args.step_factors.split(",")]
    records = []
    for path in args.records:
        with open(path) as f:
            records += json.load(f)["records"]
    text = report(projection(records, factors), factors, args.records)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
