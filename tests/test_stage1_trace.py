"""``benchmarks/stage1_trace.py`` (CPU): stage 1's trace read as per-phase cycles over CTAs, and the trace build's
refusal of the options it does not stamp."""
import pytest
import torch

from helpers import load_benchmark

st = load_benchmark("stage1_trace")


def test_phases_are_differences_of_consecutive_stamps_over_ctas():
    from flashgdn.kernels.hopper.kkt_inverse import TRACE_POINTS, TRACE_POINTS_OF

    assert len(TRACE_POINTS_OF) == TRACE_POINTS
    # 10 slots x 2 qk heads: CTA i stamps point p at 1000 i + 10 p (p + 1); slot 9 idle (its start only)
    tr = torch.zeros((10, 2, TRACE_POINTS), dtype=torch.int64)
    for s in range(10):
        for h in range(2):
            i = 2 * s + h
            for p in range(TRACE_POINTS if s < 9 else 1):
                tr[s, h, p] = 1000 * (i + 1) + 10 * p * (p + 1) + (i % 3)
    phases, ctas = st.phase_cycles(tr, TRACE_POINTS_OF)
    assert ctas == 18
    assert len(phases) == TRACE_POINTS
    for p in range(1, TRACE_POINTS):  # point p - 1 -> p: 10 p (p + 1) - 10 (p - 1) p = 20 p cycles in every CTA
        assert phases[p - 1]["median"] == phases[p - 1]["p10"] == phases[p - 1]["p90"] == 20 * p
        assert phases[p - 1]["phase"] == f"{TRACE_POINTS_OF[p - 1]} -> {TRACE_POINTS_OF[p]}"
    last = TRACE_POINTS - 1
    assert phases[-1] == {"phase": "whole CTA", "median": 10 * last * (last + 1),
                          "p10": 10 * last * (last + 1), "p90": 10 * last * (last + 1)}


def test_a_trace_with_no_complete_cta_has_no_phases():
    from flashgdn.kernels.hopper.kkt_inverse import TRACE_POINTS, TRACE_POINTS_OF

    tr = torch.zeros((3, 1, TRACE_POINTS), dtype=torch.int64)
    tr[:, :, 0] = 5
    phases, ctas = st.phase_cycles(tr, TRACE_POINTS_OF)
    assert ctas == 0 and all(set(ph) == {"phase"} for ph in phases)


@pytest.mark.parametrize("options", [dict(diag16=False, mma32=False), dict(diag16=True, mma32=False),
                                     dict(diag16=True, mma32=True, async_loads=False),
                                     dict(diag16=True, mma32=True, store_inverse=True),
                                     dict(diag16=True, mma32=True, chunk_bounds=True)])
def test_the_trace_build_is_only_the_default_builds(options):
    from flashgdn.kernels.hopper.kkt_inverse import build_kkt_inverse

    with pytest.raises(ValueError, match="trace stamps the default build"):
        build_kkt_inverse(2, 4, 128, "bfloat16", "bfloat16", trace=True, **{"async_loads": True, **options})
