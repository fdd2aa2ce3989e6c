"""Benchmark shape sets, the command-line shape syntax, and --part splitting."""
from __future__ import annotations

import pytest

from flashgdn.bench import shapes as S


def test_canonical_set_is_9_heads_by_19_mixes():
    cs = S.canonical_set()
    assert len(cs) == 171
    assert len({(s.h_qk, s.h_v) for s in cs}) == 9
    assert len({s.seqlens for s in cs}) == 19
    assert all(s.set == "canonical" for s in cs)
    # every mix of the set is one of 2K..32K tokens, as in DESIGN.md section 5
    assert {s.tokens for s in cs} == {32768, 16384, 8192, 4096, 2048}
    mixes = {s.seqlens for s in cs}
    assert (28672, 4096) in mixes and (1024,) * 8 in mixes and (32768,) in mixes and (6144, 2048) in mixes


def test_bwd_set_random_lengths_are_fixed():
    bs = S.bwd_set()
    assert len(bs) == 4 * 2 * 4
    assert {(s.h_qk, s.h_v) for s in bs} == {(16, 32), (8, 16), (4, 8), (2, 4)}
    for s in bs:
        assert s.tokens in (8192, 32768)
        assert s.n_seqs in (1, 2, 4, 8)
        assert all(n > 0 for n in s.seqlens)
    # pinned: these lengths are part of the published shape set
    assert S.random_split(8192, 2, S.BWD_SEED) == (775, 7417)
    assert S.random_split(32768, 4, S.BWD_SEED) == (1047, 7059, 11918, 12744)
    assert S.bwd_set() == bs


def test_random_split_properties():
    for total in (2, 9, 8192):
        for n in (1, 2, 8):
            if n > total:
                continue
            lens = S.random_split(total, n, 7)
            assert len(lens) == n and sum(lens) == total and min(lens) >= 1


def test_quick_set_spans_heads_sequences_and_lengths():
    qs = S.quick_set()
    assert 18 <= len(qs) <= 26
    assert min(s.h_v for s in qs) <= 8 and max(s.h_v for s in qs) >= 64
    assert min(s.n_seqs for s in qs) == 1 and max(s.n_seqs for s in qs) >= 8
    assert min(s.tokens for s in qs) == 2048 and max(s.tokens for s in qs) == 32768


def test_cp_set():
    cps = S.cp_set()
    heads = {(s.h_qk, s.h_v) for s in cps}
    assert heads == {(1, 4), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16)}
    single = {s.tokens for s in cps if s.n_seqs == 1}
    assert single == {8192, 16384, 32768, 65536, 131072}
    assert any(s.n_seqs == 2 for s in cps)


def test_parse_heads():
    assert S.parse_heads("16/64") == [(16, 64)]
    assert S.parse_heads("16/64, 8/32,32") == [(16, 64), (8, 32), (32, 32)]
    for bad in ("16/24x", "3/8", "0/4", ""):
        with pytest.raises(ValueError):
            S.parse_heads(bad)


def test_parse_seqlens():
    assert S.parse_seqlens("8192x4,1000+3000") == [(8192,) * 4, (1000, 3000)]
    assert S.parse_seqlens("32K") == [(32768,)]
    assert S.parse_seqlens("1024x2+7168, 5") == [(1024, 1024, 7168), (5,)]
    for bad in ("", "0", "8192x0", "abc", "8192x"):
        with pytest.raises(ValueError):
            S.parse_seqlens(bad)


def test_seqlens_label_round_trips():
    for mix in [(32768,), (8192,) * 4, (28672, 4096), (1024, 1024, 7168), (5, 7, 7, 5)]:
        assert S.parse_seqlens(S.seqlens_label(mix)) == [mix]
    assert S.seqlens_label((8192,) * 4) == "8192x4"


def test_custom_shapes():
    cs = S.custom_shapes("16/64,8/32", "8192x4,1000+3000")
    assert len(cs) == 4 and all(s.set == "custom" for s in cs)
    assert cs[0] == S.Shape("custom", 16, 64, (8192,) * 4)


@pytest.mark.parametrize("name", ["canonical", "bwd", "quick", "cp"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 9, 12, 40])
def test_parts_cover_every_shape_exactly_once(name, n):
    shapes = S.named_set(name)
    parts = S.split_parts(shapes, n)
    assert len(parts) == n
    flat = [s for p in parts for s in p]
    assert sorted(flat, key=shapes.index) == shapes  # every shape once, none invented
    if n <= len(shapes):
        assert all(parts), "a part is empty although there are enough shapes"
    for p in parts:  # each part keeps the set's order
        assert p == sorted(p, key=shapes.index)
    assert [S.select_part(shapes, (i + 1, n)) for i in range(n)] == parts


def test_parts_keep_head_configs_together_when_possible():
    shapes = S.canonical_set()
    for n in (2, 3, 4, 5, 9):
        for p in S.split_parts(shapes, n):
            for hq, hv in {(s.h_qk, s.h_v) for s in p}:
                # a head configuration lies wholly in one part
                assert sum(1 for s in p if (s.h_qk, s.h_v) == (hq, hv)) == 19


def test_parts_are_balanced():
    shapes = S.canonical_set()
    loads = [sum(S.shape_cost(s) for s in p) for p in S.split_parts(shapes, 5)]
    assert max(loads) < 2.5 * min(loads)


def test_parse_part():
    assert S.parse_part("2/5") == (2, 5)
    for bad in ("0/3", "4/3", "x", "1/0"):
        with pytest.raises(ValueError):
            S.parse_part(bad)


def test_fills_gpu_is_sequences_times_value_heads_at_least_64():
    assert S.Shape("custom", 2, 8, (32768,)).ctas == 8
    assert not S.Shape("custom", 2, 8, (4096,) * 7).fills_gpu
    assert S.Shape("custom", 2, 8, (4096,) * 8).fills_gpu
    few = [s for s in S.canonical_set() if not s.fills_gpu]
    full = [s for s in S.canonical_set() if s.fills_gpu]
    assert len(few) + len(full) == 171 and len(few) == 82  # the split the results README reports


def test_parse_shape_takes_exactly_one_shape():
    from flashgdn.bench.shapes import parse_shape

    shape = parse_shape("16/32:4096x2")
    assert (shape.h_qk, shape.h_v, tuple(shape.seqlens)) == (16, 32, (4096, 4096))
    assert tuple(parse_shape("2/4:775+7417").seqlens) == (775, 7417)
    for bad, message in (("16/32", "expected HQK/HV:SEQLENS"), ("16/32:", "expected HQK/HV:SEQLENS"),
                         ("16/32,8/16:4096", "one head pair and one sequence mix")):
        with pytest.raises(ValueError, match=message):
            parse_shape(bad)
