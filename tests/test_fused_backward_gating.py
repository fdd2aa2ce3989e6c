"""The fused backward's ``ag_from_a`` gating (CPU): which pieces of the tile the producer's threads take
(``fused_backward.lower_block_piece``, ``lower_block_taken``), and that gating A's tile piece by piece with the kernel's expression gives
stage 1's Ag (``reference.chunked.gated_inverse``'s values) within the rounding of the io dtype."""
import math

import torch

from flashgdn.kernels.hopper.fused_backward import (GATING_THREADS, LOWER_BLOCK_STEPS, lower_block_piece,
                                                    lower_block_taken)

C = 64


def _pieces():
    """(step, thread, block row, block column) of every piece a producer thread gates"""
    return [(step, t, *lower_block_piece(step, t)) for step in range(LOWER_BLOCK_STEPS) for t in range(GATING_THREADS)
            if lower_block_taken(step, t)]


def test_the_pieces_cover_the_blocks_on_or_below_the_diagonal_once():
    rows = [(rb * 8 + t % 8, cb) for _, t, rb, cb in _pieces()]
    assert len(set(rows)) == len(rows) == 36 * 8  # every (row, block column) once
    assert set(rows) == {(r, cb) for r in range(C) for cb in range(8) if cb <= r // 8}
    # the last step takes what is left (blocks 32-35: the first warp's), the ones before a block per 8 threads
    assert [sum(lower_block_taken(s, t) for t in range(GATING_THREADS)) for s in range(LOWER_BLOCK_STEPS)] == [
        128, 128, 32]
    # eight threads a block, on one block column: its eight rows' pieces, which the 128-byte swizzle puts on eight
    # different bank groups (piece cb of row r at chunk cb ^ (r % 8))
    for step in range(LOWER_BLOCK_STEPS):
        for first in range(0, GATING_THREADS, 8):
            if not lower_block_taken(step, first):
                continue
            block = {lower_block_piece(step, t) for t in range(first, first + 8)}
            assert len(block) == 1
            (rb, cb), = block
            assert sorted(cb ^ (r % 8) for r in range(rb * 8, rb * 8 + 8)) == list(range(8))


def _gate_like_the_kernel(a, gcum, beta, dtype):
    """What the producer's threads do to A's tile (``a`` in the io dtype): each piece of each step, the kernel's
    expression in float32, rounded to the io dtype; the rest of the tile untouched."""
    out = a.clone()
    for _, t, rb, cb in _pieces():
        i = rb * 8 + t % 8
        for j in range(cb * 8, cb * 8 + 8):
            factor = torch.exp2(torch.clamp(gcum[i] - gcum[j], max=0.0) * math.log2(math.e))
            out[i, j] = (out[i, j].float() * beta[j] * factor).to(dtype)
    return out


def test_gating_a_piece_by_piece_gives_stage1s_ag():
    from flashgdn.reference.chunked import gated_inverse

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    # a chunk's inverse: unit lower triangular; strong and mild decay, a sequence's end at row 50 (beta and g zero
    # past it, as stage 1 loads them)
    a = (torch.eye(C) + torch.randn(C, C, generator=gen).tril(-1) * 0.3).to(dtype)
    g = -torch.rand(C, generator=gen) * torch.tensor([3.0] * 32 + [0.05] * 32)
    beta = torch.rand(C, generator=gen)
    g[50:], beta[50:] = 0.0, 0.0
    gcum = g.cumsum(0)
    got = _gate_like_the_kernel(a, gcum, beta, dtype)
    want = gated_inverse(a.float()[None, :, None], gcum[None, :, None], beta[None, :, None])[0, :, 0]  # [B, T, H, C]
    assert torch.equal(got.triu(1), torch.zeros(C, C, dtype=dtype))  # A is zero above the diagonal, and stays so
    assert torch.equal(got.diagonal().float(), beta.to(dtype).float())  # a unit diagonal times beta
    # the same product of the same A, float32's exp2 against the reference's exp: one rounding of the io dtype apart
    err = (got.float() - want.float()).abs()
    assert (err <= want.float().abs() * 2 ** -8 + 1e-30).all(), err.max()
    assert (got.float()[:, 50:] == 0).all() and (want[:, 50:] == 0).all()  # columns past the sequence's end
