"""benchmarks/step_kernels.py: a training step's time by kernel (the aggregation on the CPU with synthetic events;
on the GPU the tool on a small shape, whose kernels must include every stage of the Hopper forward and backward)."""
import json
from types import SimpleNamespace

import pytest
import torch

from helpers import load_benchmark

sk = load_benchmark("step_kernels")


def _ev(name, us, gpu=True):
    kind = torch.autograd.DeviceType.CUDA if gpu else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_time_total=us, device_type=kind)


def test_kernels_are_summed_per_step_and_sorted_by_time():
    # two steps: "a" twice a step (400 us a step), "b" once (450 us a step); host events are not kernels
    events = [_ev("a", 100), _ev("b", 500), _ev("a", 300), _ev("host", 9999, gpu=False), _ev("b", 400),
              _ev("a", 100), _ev("a", 300)]
    rows = sk.per_kernel(events, steps=2)
    assert [(n, c) for n, _, c in rows] == [("b", 1), ("a", 2)]
    assert [ms for _, ms, _ in rows] == pytest.approx([0.45, 0.4])


@pytest.mark.gpu
def test_a_step_on_the_gpu_names_every_stage(tmp_path, cuda):
    out = tmp_path / "step.json"
    sk.main(["--shape", "2/4:300+70", "--steps", "2", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["gpu"] and res["command"].startswith("python3 benchmarks/step_kernels.py")
    (r,) = res["results"]
    names = " ".join(k["name"] for k in r["kernels"])
    for stage in ("chunk_plan", "kkt_inverse", "chunk_forward_rs", "state_grad_walk", "chunk_grad", "group_sum"):
        assert stage in names, stage
    assert r["total_ms"] == pytest.approx(sum(k["ms"] for k in r["kernels"]))


def test_one_implementation_a_profile():
    with pytest.raises(ValueError, match="one implementation"):
        sk.step_fn("flashgdn,flashqla", 2, 4, [64], "off")
    with pytest.raises(ValueError, match="one implementation"):  # two of flashgdn's backends are two as well
        sk.step_fn("flashgdn:hopper+reference", 2, 4, [64], "off")


def test_side_by_side_sets_each_implementation_against_the_first():
    rs = [dict(heads="16/32", seqlens=[8192], mode="fwdbwd", impl="flashgdn", total_ms=1.0),
          dict(heads="16/32", seqlens=[8192], mode="fwdbwd", impl="flashqla", total_ms=0.8),
          dict(heads="2/4", seqlens=[1, 2, 3, 4, 5], mode="fwdbwd", impl="flashgdn", total_ms=0.5)]
    assert sk.side_by_side(rs) == ["16/32 8192 fwdbwd: flashgdn 1.000, flashqla 0.800 (0.80x)",
                                   "2/4 5 seqs of 15 tokens fwdbwd: flashgdn 0.500"]
