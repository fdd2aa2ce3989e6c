"""benchmarks/plan_timing.py: one small run on the GPU (the plan kernel against chunk_plan_torch, exit status)."""
import json

import pytest

from helpers import load_benchmark

plan_timing = load_benchmark("plan_timing")


@pytest.mark.gpu
def test_plan_timing_runs_and_checks_the_kernel(cuda, tmp_path):
    out = tmp_path / "plan.json"
    assert plan_timing.main(["--seqlens", "4096+100,64x1500", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["slots"] for r in rows] == [66, 1500]
    assert all(r["same"] == {"parallel": True} and r["us"]["parallel"] > 0 for r in rows)
