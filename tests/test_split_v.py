"""flashgdn/reference/split_v.py: the per-chunk gradients made as the CTAs of a V split would make them equal the
written-out backward's (float64), and what crosses between them is what the plan counts (CPU)."""
import pytest
import torch

from flashgdn.reference.chunked_backward import chunk_gradient_tiles
from flashgdn.reference.split_v import split_v_chunk_gradients
from helpers import rel_rms


def _chunk_tensors(NC, Hqk, Hv, C, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    qc, kc = randn(NC, Hqk, C, K) / K ** 0.5, randn(NC, Hqk, C, K) / K ** 0.5
    vc, doc = randn(NC, Hv, C, V), randn(NC, Hv, C, V)
    bc = torch.rand(NC, Hv, C, generator=gen, dtype=torch.float64)
    gc = -(torch.rand(NC, Hv, C, generator=gen, dtype=torch.float64) * 0.2).cumsum(-1)
    A = torch.eye(C, dtype=torch.float64) + randn(NC, Hv, C, C).tril(-1) * 0.1
    Ag = randn(NC, Hv, C, C).tril() * 0.1
    h, dS_end = randn(NC, Hv, K, V), randn(NC, Hv, K, V)
    return qc, kc, vc, bc, gc, A, Ag, h, dS_end, doc


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("heads", [(1, 2), (2, 2)])
def test_the_split_gives_the_backwards_gradients(parts, heads):
    args = _chunk_tensors(3, *heads, C=16, K=16, V=8)
    want = chunk_gradient_tiles(*args, scale=0.3)
    got, _ = split_v_chunk_gradients(*args, scale=0.3, parts=parts)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert a.shape == b.shape, name
        assert rel_rms(a, b) < 1e-13, name


def test_what_crosses_a_pair_at_the_operators_shape():
    # C = 64, K = V = 128: 64 KB of float32 partials from each CTA a chunk, and dg's rows from rank 1 to rank 0
    args = _chunk_tensors(1, 1, 1, C=64, K=128, V=128, seed=1)
    _, sent = split_v_chunk_gradients(*args, scale=0.1)
    assert sent == {"dAg": 16384, "dP": 16384, "dq": 16384, "dk": 16384, "dg rows": 772}


def test_parts_must_divide_both_head_dims():
    args = _chunk_tensors(1, 1, 1, C=16, K=16, V=8)
    with pytest.raises(ValueError, match="parts=3 must divide K=16 and V=8"):
        split_v_chunk_gradients(*args, scale=0.3, parts=3)
