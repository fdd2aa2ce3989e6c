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
