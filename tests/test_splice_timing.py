"""benchmarks/splice_timing.py: its float64 check of the splice kernel is the operator's splice (the torch splices
of ``flashgdn.cp`` on one sequence), and its build names parse or fail clearly (CPU)."""
import pytest
import torch

from helpers import load_benchmark

st = load_benchmark("splice_timing")


@pytest.mark.parametrize("S", [1, 2, 5])
def test_the_check_is_the_operators_splice(S):
    from flashgdn.cp import split_sequences
    from flashgdn.cp.backward import splice_reverse
    from flashgdn.cp.exact import _splice
    from flashgdn.cp.plan import segment_index_tensors

    Hv, K = 2, 128
    pairs, start, D, _, _ = st.make_case(Hv, S)
    plan = split_sequences([64 * S], 1)
    index = segment_index_tensors(plan, torch.tensor([0, 64 * S]))
    b, M = pairs.double()[:, 0::2], pairs.double()[:, 1::2]
    want_fwd = _splice(lambda src: (M.index_select(0, src), b.index_select(0, src)), start.double(), plan, index)
    want_rev = splice_reverse(lambda src: (M.index_select(0, src).transpose(-1, -2), D.double().index_select(0, src)),
                              start.double(), plan, index)
    assert torch.allclose(st.torch_splice(pairs, start, D, False), want_fwd, rtol=1e-12, atol=1e-12)
    assert torch.allclose(st.torch_splice(pairs, start, D, True), want_rev, rtol=1e-12, atol=1e-12)


def test_builds_parse():
    assert st.parse_build("plain:8") == dict(BV=8, blocked=False)
    assert st.parse_build("blocked:16") == dict(BV=16, blocked=True)
    with pytest.raises(SystemExit, match="split4:8"):
        st.parse_build("split4:8")
