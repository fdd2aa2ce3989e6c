"""``flashgdn.preload`` on the GPU: after it, fwd+bwd calls over sequence mixes that take different paths (context
parallelism splitting a long sequence or not, a long sequence beside short ones, dense input) load no kernel: TileLang's
in-memory caches and the kernel factories' caches stay as they were. The flags are the common ones (an initial state
in, the final state out, K-major states), whose builds the GPU machine's shipped cache holds; ``flags="all"`` lists
the other combinations the same way (``variants.forward_variants``)."""
import pytest
import torch

import flashgdn
from flashgdn.kernels.hopper.common import kernels_in_memory

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


def _step(cuda, Hqk, Hv, lens, h0, final, v_first, dense=False, seed=0):
    gen = torch.Generator(device=cuda).manual_seed(seed)
    T, N = sum(lens), len(lens)
    B, TT = (N, lens[0]) if dense else (1, T)
    K = V = 128

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=cuda, dtype=torch.float32).to(dtype)

    q, k = (torch.nn.functional.normalize(rnd(B, TT, Hqk, K).float(), dim=-1).bfloat16().requires_grad_()
            for _ in range(2))
    v = rnd(B, TT, Hv, V).requires_grad_()
    g = (torch.nn.functional.logsigmoid(rnd(B, TT, Hv, dtype=torch.float32)) / 16).requires_grad_()
    beta = torch.sigmoid(rnd(B, TT, Hv, dtype=torch.float32)).requires_grad_()
    state = (Hv, V, K) if v_first else (Hv, K, V)
    s0 = rnd(N, *state, dtype=torch.float32).requires_grad_() if h0 else None
    cu = cu_cpu = None
    if not dense:
        cu_cpu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        cu = cu_cpu.to(cuda)
    o, ht = flashgdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=final,
                                            cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, state_v_first=v_first,
                                            backend="hopper")
    loss = o.float().square().sum() + (ht.float().square().sum() if final else 0)
    loss.backward()
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
        ([16384], True, True, False, False),           # one long sequence: CP splits it
        ([100, 200, 64], True, True, False, False),    # short ones: the loop alone
        ([5000, 3000, 70], True, True, False, False),  # mixed lengths
        ([40000, 900], True, True, False, False),      # a long one beside a short one
        ([2048, 2048], True, True, False, True),       # dense input, B = 2
    ]
    for i, (lens, h0, final, v_first, dense) in enumerate(cases):
        _step(cuda, Hqk, Hv, lens, h0, final, v_first, dense, seed=i)
        assert kernels_in_memory() == loaded, f"case {i} ({lens}) loaded {kernels_in_memory() - loaded} kernels"
    assert [f.cache_info().misses for f in _factories()] == misses
