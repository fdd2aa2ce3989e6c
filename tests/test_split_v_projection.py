"""benchmarks/split_v_projection.py: the cost model with the fused backward split over V, and the projection made
from it (CPU: the model only)."""
import dataclasses

from helpers import load_benchmark

from flashgdn.cp import plan as cp_plan

sv = load_benchmark("split_v_projection")


def _split(model, f):
    return sv.SplitModel(**{x.name: getattr(model, x.name) for x in dataclasses.fields(model)}, step_factor=f)


def test_the_split_runs_twice_the_ctas_at_f_times_the_step():
    model = cp_plan.CostModel()
    chunks = [64] * 16
    fused = sv.SplitModel(step_factor=0.5).backward_gradients_us(chunks, 8)[0]
    # 256 CTAs (128 today) of half the step each on 132 SMs: two waves, each CTA its item cost and 64 half steps
    assert fused == 2 * (model.fused_item_us + 64 * 0.5 * model.fused_chunk_us)
    # and it is the fused kernel or nothing (the two-kernel path is not split)
    assert sv.SplitModel(step_factor=0.5).backward_gradients_us(chunks, 8)[1] == float("inf")


def test_the_projection_takes_the_split_only_where_the_model_gains():
    model = cp_plan.CostModel()
    seqlens, heads = (8192,), 8
    today, seg = sv.backward_us(seqlens, heads, model)
    # a split no faster than today's step never wins: the plan of today is kept
    assert sv.backward_us(seqlens, heads, model, _split(model, 1.0)) == (today, seg)
    # a cheaper step wins here (few CTAs), and cheaper still gains more
    us = [sv.backward_us(seqlens, heads, model, _split(model, f))[0] for f in (0.75, 0.55, 0.4)]
    assert today > us[0] > us[1] > us[2]


def test_the_report_subtracts_the_models_saving_from_the_measured_time():
    records = [dict(set="cp", mode="fwdbwd", status="run", h_qk=2, h_v=8, seqlens=[8192], impl=impl, ms=ms)
               for impl, ms in (("flashgdn", 0.4), ("flashqla", 0.36))]
    (row,) = sv.projection(records, [1.0, 0.4])
    assert row["split"][0][3] == 0.4  # no saving at f = 1
    f, us, _, ms = row["split"][1]
    assert ms == 0.4 - (row["today_us"] - us) / 1000.0 and ms < 0.4
    text = sv.report([row], [1.0, 0.4], ["r.json"])
    assert "| cp | 1 | 0.900x |" in text
