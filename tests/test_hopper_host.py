"""Host-side planning of the Hopper forward, on the CPU: the device-built chunk bounds agree with the reference
chunk table for any sequence mix (no GPU and no TileLang needed)."""
import random

import pytest
import torch

from flashgdn.kernels.hopper.forward import chunk_bounds
from flashgdn.reference.layout import chunk_table


def _expected(seqlens):
    cu = torch.tensor([0] + list(seqlens)).cumsum(0)
    t = chunk_table(cu, 1, int(cu[-1]))
    return [(int(s), int(n)) for s, n in zip(t.chunk_start, t.chunk_len)]


MIXES = [[1], [63], [64], [65], [128], [0, 5], [5, 0, 0, 64, 0], [1000, 1, 2, 3], [64] * 7, [0]]
rnd = random.Random(3)
MIXES += [[rnd.choice([0, 1, 63, 64, 65, rnd.randint(1, 500)]) for _ in range(rnd.randint(1, 40))] for _ in range(20)]


@pytest.mark.parametrize("seqlens", MIXES)
@pytest.mark.parametrize("pad", [0, 70])
def test_chunk_bounds_match_the_reference_table(seqlens, pad):
    cu = torch.tensor([0] + list(seqlens), dtype=torch.int32).cumsum(0).to(torch.int32)
    T = int(cu[-1]) + pad
    bounds = chunk_bounds(cu, T, len(seqlens))
    assert bounds.dtype == torch.int32 and bounds.shape[1] == 2
    real = [(int(s), int(n)) for s, n in bounds.tolist() if n > 0]
    assert real == _expected(seqlens), "real chunks, in order, with their first token and length"
    idle = bounds[bounds[:, 1] == 0]
    assert (idle[:, 0] == 0).all(), "idle slots point at token 0 and have length 0"
    assert bounds.shape[0] >= len(real)


@pytest.mark.parametrize("seqlens", MIXES)
def test_first_slot_is_each_sequences_first_chunk(seqlens):
    from flashgdn.kernels.hopper.forward import chunk_plan

    cu = torch.tensor([0] + list(seqlens), dtype=torch.int32).cumsum(0).to(torch.int32)
    bounds, first = chunk_plan(cu, int(cu[-1]) + 3, len(seqlens))
    assert first.dtype == torch.int32 and first.shape == (len(seqlens),)
    chunks_before = 0
    for n, length in enumerate(seqlens):
        assert int(first[n]) == chunks_before
        for c in range((length + 63) // 64):
            start, rows = bounds[first[n] + c].tolist()
            assert (start, rows) == (int(cu[n]) + 64 * c, min(64, length - 64 * c))
        chunks_before += (length + 63) // 64


@pytest.mark.parametrize("seqlens", [[1], [130, 64, 5], [0, 70, 0, 3]])
def test_slots_to_tokens_inverts_the_slot_layout(seqlens):
    from flashgdn.kernels.hopper.forward import chunk_plan, slots_to_tokens

    cu = torch.tensor([0] + list(seqlens), dtype=torch.int32).cumsum(0).to(torch.int32)
    T = int(cu[-1]) + 5
    bounds, _ = chunk_plan(cu, T, len(seqlens))
    per_slot = bounds[:, :1].long() + torch.arange(64)[None, :]  # token id of row r of each slot
    tokens = slots_to_tokens(per_slot.unsqueeze(-1), bounds, T).squeeze(-1)
    n = int(cu[-1])
    assert torch.equal(tokens[:n], torch.arange(n))
    assert (tokens[n:] == 0).all()


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_cp_forward_object_offers_its_hooks_and_dies_with_its_last_reference(paired, fused):
    """The Hopper CP forward offers the drivers' hooks it has and None for the others, and holds no reference to
    itself: the stage-1 tensors it keeps go when the pass that made it ends, not at the garbage collector's next
    run (an instance attribute holding a bound method kept them past the backward's memory peak)."""
    import gc
    import weakref

    from flashgdn.kernels.hopper.backend import _HopperSegmentsForward

    forward = _HopperSegmentsForward(paired=paired, fused=fused)
    for name, offered in (("transition_pairs", paired), ("segment_index", fused), ("splice", fused),
                          ("splice_reverse", fused)):
        assert (getattr(forward, name, None) is not None) == offered, name
    ref = weakref.ref(forward)
    gc.disable()
    try:
        del forward
        assert ref() is None
    finally:
        gc.enable()


def test_more_launch_rows_than_the_grid_takes_are_clear_errors():
    """The Hopper kernels launch one row of CTAs per sequence or CP segment on the grid's y (at most 65535): one
    more is a ValueError naming the argument (cu_seqlens, or cp for the segments), the limit itself passes."""
    from flashgdn.cp.plan import split_sequences
    from flashgdn.kernels.hopper.backend import MAX_SEQUENCES, check_launch_rows

    assert MAX_SEQUENCES == 65535
    check_launch_rows(MAX_SEQUENCES)
    with pytest.raises(ValueError, match=r"^cu_seqlens: .*at most 65535 sequences .*got 65536"):
        check_launch_rows(MAX_SEQUENCES + 1)
    check_launch_rows(1, None)
    check_launch_rows(1, split_sequences([64 * MAX_SEQUENCES], 1))  # one sequence in 65535 one-chunk segments
    with pytest.raises(ValueError, match=r"^cp: the context-parallel plan has 65536 segments"):
        check_launch_rows(1, split_sequences([64 * (MAX_SEQUENCES + 1)], 1))


@pytest.mark.parametrize("setting,lengths,items,Hv,want", [
    # measured on the H200 (backward.py's switch; stages-hopper-v0.15d-bwd.json, backward/mix-fused-v0.15d-*.json):
    # faster fused, or faster with the two kernels
    ("auto", [4096] * 8, 8, 32, True), ("auto", [4096] * 8, 8, 64, True),
    ("auto", [1024] * 8, 8, 8, True),  # 64 CTAs of 16 chunks: 0.282 ms against 0.296 (v0.15c: 1.01x)
    ("auto", [6400] + [64] * 7, 8, 32, False),  # one item holds 100 of the 107 chunks: 1.398 ms either way
    ("auto", [949, 465, 545, 137, 799, 3437, 468, 1392], 8, 32, True),  # one of 132 chunks in 54: 0.91x
    ("auto", [32768], 1, 32, False), ("auto", [32768], 1, 8, False),  # one long walk: 6.96 and 5.35 ms, 6.96 and 3.14
    ("auto", [8192], 1, 32, False),  # 32/32: 1.755 and 1.334 ms
    # the model's alone, to be checked on the GPU: 2/8 32768 on segments of 16 chunks, 16/32 32768 on four segments
    ("auto", [1024] * 32, 32, 8, True), ("auto", [8192] * 4, 4, 32, True),
    # the count alone when the host has no lengths, and the forced settings
    ("auto", None, 5, 32, True), ("auto", None, 4, 32, False), ("auto", [], 0, 32, False),
    (True, [64], 1, 1, True), (False, [4096] * 8, 8, 64, False)])
def test_fused_backward_is_taken_where_it_is_faster(setting, lengths, items, Hv, want, monkeypatch):
    """``backward.fused_backward_wanted``: "auto" takes the fused kernel where the cost model finds it faster (its
    CTAs, items x value heads, near the SM count, 132 here, and no item so much longer than the rest that its walk
    sets the time); True / False force
    it."""
    from types import SimpleNamespace

    from flashgdn.kernels.hopper import backward

    monkeypatch.setattr(backward, "FUSED_BACKWARD", setting)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backward.fused_backward_wanted(lengths, items, Hv, torch.device("cuda")) is want


@pytest.mark.parametrize("seqlens", [[1], [130, 64, 5], [0, 70, 0, 3], [0], [64] * 9])
def test_chunk_plan_from_host_offsets_has_one_slot_per_chunk(seqlens):
    """With the host copy of the offsets the plan has exactly as many slots as chunks (at least one), the same
    real chunks in the same slots as the plan from the bound; without it, the bound ceil((T + 63 N) / 64)."""
    from flashgdn.kernels.hopper.forward import chunk_plan, num_chunk_slots

    cu = torch.tensor([0] + list(seqlens), dtype=torch.int32).cumsum(0).to(torch.int32)
    T, N = int(cu[-1]) + 70, len(seqlens)
    chunks = sum((n + 63) // 64 for n in seqlens)
    assert num_chunk_slots(T, N, cu) == num_chunk_slots(T, N, cu.tolist()) == max(1, chunks)
    assert num_chunk_slots(T, N) == (T + 63 * N + 63) // 64
    exact, first = chunk_plan(cu, T, N, cu_cpu=cu.clone())
    loose, loose_first = chunk_plan(cu, T, N)
    assert exact.shape == (max(1, chunks), 2)
    assert torch.equal(exact[:chunks], loose[:chunks]) and torch.equal(first, loose_first)
    assert (loose[chunks:] == 0).all() and (exact[chunks:] == 0).all()
