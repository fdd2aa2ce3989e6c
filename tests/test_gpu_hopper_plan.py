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
