"""``flashgdn.preload`` on the GPU: after it, fwd+bwd calls over sequence mixes that take different paths (context
parallelism splitting a long sequence or not, a long sequence beside short ones, dense input) load no kernel: TileLang's
in-memory caches and the kernel factories' caches stay as they were. The flags are the common ones (an initial state
in, the final state out, K-major states), whose builds the GPU machine's shipped cache holds; ``flags="all"`` lists
the other combinations the same way (``variants.forward_variants``)."""
import pytest
import torch

import flashgdn
from flashgdn.kernels.hopper.common import kernels_in_memory
from helpers import grads_of, make_inputs

pytestmark = pytest.mark.gpu


def _factories():
    from flashgdn.kernels.hopper import (chunk_emits, chunk_forward_rs, chunk_forward_rso, chunk_grad, chunk_plan,
                                         fused_backward, gated_scores, group_sum, kkt_inverse, segment_index, splice,
                                         state_grad_walk)

    return (chunk_emits.build_chunk_emits, chunk_emits.build_walk_covers, chunk_forward_rs.build_chunk_forward_rs,
            chunk_forward_rso.build_chunk_forward_rso, chunk_grad.build_chunk_grad, chunk_plan.build_chunk_plan,
            fused_backward.build_fused_backward, gated_scores.build_gated_scores, group_sum.build_group_sum,
            kkt_inverse.build_kkt_inverse, segment_index.build_segment_index, segment_index.build_chain_index,
            splice.build_splice, state_grad_walk.build_state_grad_walk)


def _step(cuda, Hqk, Hv, lens, dense, seed):
    # fwd+bwd of the Hopper backend with the common flags (an initial state, the final state, K-major states)
    inp = make_inputs(lens, Hqk, Hv, K=128, V=128, dtype=torch.bfloat16, device=cuda, seed=seed, dense=dense,
                      requires_grad=True)
    if not dense:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    o, _, _ = grads_of(lambda **kw: flashgdn.chunk_gated_delta_rule(**kw, backend="hopper"), inp)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()


def test_preload_leaves_nothing_to_load_in_later_steps(cuda):
    assert kernels_in_memory() is not None
    Hqk, Hv = 2, 4
    held, built = kernels_in_memory(), sum(f.cache_info().misses for f in _factories())
    n = flashgdn.preload([(Hqk, Hv)], dtype=torch.bfloat16, training=True, flags="common")
    assert n > 10
    loaded = kernels_in_memory()
    misses = [f.cache_info().misses for f in _factories()]
    # the count sees loads: where preload built kernels for the first time in this process, TileLang's memory caches
    # grew (else the checks below could not fail)
    assert sum(misses) == built or loaded > held, (held, loaded, built, sum(misses))
    cases = [
        ([16384], False),           # one long sequence: CP splits it
        ([100, 200, 64], False),    # short ones: the loop alone
        ([5000, 3000, 70], False),  # mixed lengths
        ([40000, 900], False),      # a long one beside a short one
        ([2048, 2048], True),       # dense input, B = 2
    ]
    for i, (lens, dense) in enumerate(cases):
        _step(cuda, Hqk, Hv, lens, dense, seed=i)
        assert kernels_in_memory() == loaded, f"case {i} ({lens}) loaded {kernels_in_memory() - loaded} kernels"
    assert [f.cache_info().misses for f in _factories()] == misses
