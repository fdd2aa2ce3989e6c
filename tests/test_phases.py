"""The phased forward's host side (``flashgdn/kernels/hopper/phases.py``): its window plan, the timeline model that
chooses the windows, and the window build of the chunk plan in torch against the whole plan (CPU)."""
import random

import pytest
import torch

from flashgdn.kernels.hopper import phases
from flashgdn.kernels.hopper.forward import chunk_plan_torch

CHUNK = 64


def chunks_of(seqlens):
    return [(n + CHUNK - 1) // CHUNK for n in seqlens]


@pytest.mark.parametrize("Hqk,Hv,seqlens", [(16, 32, [28672, 4096]), (32, 32, [4096, 28672]), (16, 64, [16384]),
                                            (16, 16, [8192] * 4), (16, 48, [28672, 4096])])
def test_windows_where_the_loop_leaves_sms_idle(Hqk, Hv, seqlens):
    chunks = chunks_of(seqlens)
    model = phases.PhaseModel()
    bounds = phases.plan_windows(chunks, Hqk, Hv, model)
    assert bounds is not None
    assert bounds[0] == 0 and bounds[-1] == max(chunks) and len(bounds) >= 3
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    assert len(bounds) - 1 <= model.max_windows
    unphased = phases.timeline_us(chunks, [0, max(chunks)], Hqk, Hv, model)
    assert phases.timeline_us(chunks, bounds, Hqk, Hv, model) <= unphased * (1 - model.min_gain)


@pytest.mark.parametrize("Hqk,Hv,seqlens", [(16, 32, [4096] * 8), (32, 32, [1024] * 8), (2, 8, [64] * 20),
                                            (16, 64, [2048] * 3), (2, 8, [32768]), (16, 64, [100])])
def test_no_windows_where_they_do_not_pay(Hqk, Hv, seqlens):
    # the GPU full of loop CTAs (no SM for stage 1 beside it), stage 1 too small a part of the op, or too few chunks
    assert phases.plan_windows(chunks_of(seqlens), Hqk, Hv) is None


def test_window_chunks_and_the_timeline_of_one_window():
    assert phases.window_chunks([10, 3, 0, 7], 2, 8) == [6, 1, 0, 5]
    model = phases.PhaseModel()
    one = phases.timeline_us([100], [0, 100], 4, 16, model)
    kkt = model.kkt_launch_us + model.kkt_sm_us(100, 4, 16) / model.num_sms
    assert one == pytest.approx(kkt + model.launch_us + 100 * model.loop_chunk_us)


def test_the_timeline_waits_for_a_stage_1_that_is_late():
    # a second window far larger than the first: the loop waits for its stage 1 on the few free SMs
    model = phases.PhaseModel(num_sms=16)
    fast = phases.timeline_us([200], [0, 100, 200], 16, 8, model)
    slow = phases.timeline_us([200], [0, 2, 200], 16, 8, model)
    assert slow > fast


@pytest.mark.parametrize("seed", range(5))
def test_window_plan_is_the_whole_plan_cut_to_the_window(seed):
    rng = random.Random(seed)
    lens = [rng.choice([0, 1, 63, 64, 65, 200, 700, 1500]) for _ in range(rng.randint(1, 6))]
    cu = torch.tensor([0] + lens).cumsum(0)
    chunks = chunks_of(lens)
    whole, first = chunk_plan_torch(cu, int(cu[-1]), len(lens), cu)
    longest = max(chunks + [1])
    lo = rng.randint(0, longest - 1)
    hi = rng.randint(lo + 1, longest)
    want = [whole[int(first[n]) + c].tolist() for n in range(len(lens)) for c in range(lo, min(hi, chunks[n]))]
    slots = max(1, len(want)) + 2  # two idle slots past the window's chunks
    bounds, wfirst = phases.window_plan_torch(cu, lo, hi, slots)
    assert bounds[:len(want)].tolist() == want
    assert (bounds[len(want):] == 0).all()
    counts = phases.window_chunks(chunks, lo, hi)
    assert wfirst.tolist() == [sum(counts[:n]) for n in range(len(lens))]


def test_sequence_chunks_from_host_offsets():
    assert phases.sequence_chunks(torch.tensor([0, 1, 65, 65, 193])) == [1, 1, 0, 2]
