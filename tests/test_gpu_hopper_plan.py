"""The Hopper forward's chunk-plan kernel against its torch counterpart (GPU)."""
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

rnd = random.Random(11)
MIXES = [[1], [64], [65], [0, 5], [5, 0, 0, 64, 0], [32768], [1000, 1, 2, 3]]
MIXES += [[rnd.choice([0, 1, 63, 64, 65, rnd.randint(1, 3000)]) for _ in range(rnd.randint(1, 60))] for _ in range(10)]
MIXES += [[rnd.randint(0, 200) for _ in range(n)] for n in (1023, 1024, 1025, 2500)]  # several scan blocks


@pytest.mark.parametrize("seqlens", MIXES, ids=[f"mix{i}" for i in range(len(MIXES))])
@pytest.mark.parametrize("pad", [0, 100])
def test_chunk_plan_kernel_matches_torch(seqlens, pad, cuda):
    from flashgdn.kernels.hopper.forward import chunk_plan, chunk_plan_torch

    cu = torch.tensor([0] + list(seqlens), dtype=torch.int32).cumsum(0).to(torch.int32).to(cuda)
    T = int(cu[-1]) + pad
    bounds, first = chunk_plan(cu, T, len(seqlens))
    ref_bounds, ref_first = chunk_plan_torch(cu, T, len(seqlens))
    assert torch.equal(bounds, ref_bounds)
    assert torch.equal(first, ref_first)


@pytest.mark.parametrize("n_seqs", [65535, 65536])
def test_more_sequences_than_the_grid_allows_is_a_clear_error(n_seqs, cuda):
    """The chunk loops launch one row of CTAs per sequence on the grid's y (at most 65535): one more sequence is a
    ValueError naming cu_seqlens and the limit, raised before any kernel runs; the limit itself runs."""
    from flashgdn import chunk_gated_delta_rule

    H, D = 2, 128  # a head configuration the shipped kernel cache has
    q, k, v = (torch.randn(1, n_seqs, H, D, device=cuda, dtype=torch.bfloat16) for _ in range(3))
    g = -torch.rand(1, n_seqs, H, device=cuda)
    beta = torch.rand(1, n_seqs, H, device=cuda)
    cu = torch.arange(n_seqs + 1, device=cuda, dtype=torch.int32)  # one token each
    call = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, output_final_state=True, backend="hopper",
                use_qk_l2norm_in_kernel=True)
    if n_seqs > 65535:
        with pytest.raises(ValueError, match=r"cu_seqlens: .*at most 65535 sequences"):
            chunk_gated_delta_rule(**call)
    else:
        o, ht = chunk_gated_delta_rule(**call)
        assert torch.isfinite(o).all() and ht.shape == (n_seqs, H, D, D)
