"""The written-out backward of the chunked form against torch autograd through it (float64, CPU)."""
import pytest
import torch

from flashgdn.reference.chunked import chunk_gated_delta_rule_reference
from flashgdn.reference.chunked_backward import chunk_gated_delta_rule_backward_reference
from helpers import make_inputs, rel_rms

CASES = [
    dict(seqlens=[200]),
    dict(seqlens=[1, 63, 64, 65, 130], gate="strong", zero_gate_heads=(1,)),
    dict(seqlens=[300, 77], gate="mixed", normalize_qk=False, pad=70),
    dict(seqlens=[128, 128], dense=True, state_v_first=True),
    dict(seqlens=[90, 40], initial_state=False),
]


@pytest.mark.parametrize("with_dht", [True, False])
@pytest.mark.parametrize("heads", [(2, 2), (1, 4)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_backward_matches_autograd(case, heads, with_dht):
    inp = make_inputs(Hqk=heads[0], Hv=heads[1], K=16, V=8, dtype=torch.float64, **CASES[case])
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if inp.get(n) is not None]
    xs = {n: inp[n].detach().clone().requires_grad_(True) for n in names}
    cu = inp.get("cu_seqlens")
    svf = inp.get("state_v_first", False)
    o, ht = chunk_gated_delta_rule_reference(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], scale=0.3,
                                             initial_state=xs.get("initial_state"), output_final_state=True,
                                             cu_seqlens=cu, state_v_first=svf)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=ht.dtype) if with_dht else None
    outs, grads = [o], [do]
    if with_dht:
        outs.append(ht)
        grads.append(dht)
    want = torch.autograd.grad(outs, [xs[n] for n in names], grads)
    got = chunk_gated_delta_rule_backward_reference(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], do, dht, scale=0.3,
        initial_state=inp.get("initial_state"), cu_seqlens=cu, state_v_first=svf)
    got = dict(zip(("q", "k", "v", "g", "beta", "initial_state"), got))
    for n, w in zip(names, want):
        assert rel_rms(got[n], w) < 1e-10, n


@pytest.mark.parametrize("case", [0, 1, 2, 3])
def test_state_gradients_alone_match_autograd(case):
    """Step 1 alone (the Hopper kernel ``state_grad_walk``'s counterpart): its state gradient at each sequence's
    start is d(initial state) by autograd, and it does not depend on v or on the initial state."""
    from flashgdn.reference.chunked_backward import chunk_state_gradients_reference

    inp = make_inputs(Hqk=1, Hv=2, K=16, V=8, dtype=torch.float64, **{**CASES[case], "state_v_first": False})
    h0 = inp["initial_state"].detach().clone().requires_grad_(True)
    cu = inp.get("cu_seqlens")
    o, ht = chunk_gated_delta_rule_reference(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=0.3,
                                             initial_state=h0, output_final_state=True, cu_seqlens=cu)
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    (want,) = torch.autograd.grad([o, ht], [h0], [do, dht])
    dS_end, dS_start = chunk_state_gradients_reference(inp["q"], inp["k"], inp["g"], inp["beta"], do, dht,
                                                       scale=0.3, cu_seqlens=cu)
    assert rel_rms(dS_start, want) < 1e-10
    # the last chunk of every sequence ends with the final state's gradient
    from flashgdn.reference.layout import chunk_table

    table = chunk_table(cu, *inp["q"].shape[:2])
    last = (table.seq_first_chunk + table.seq_num_chunks - 1)[table.seq_num_chunks > 0]
    assert torch.equal(dS_end[last], dht[table.seq_num_chunks > 0])


def test_the_backward_kernels_transposed_formulas():
    """The per-chunk algebra of ``state_grad_walk`` (dS^T from dS'^T: X^T = (dS'^T K^T) diag(d) + dO^T P,
    Y^T = X^T Ag, dS^T = gamma_C dS'^T - (Y^T diag(gamma)) K + dO^T Qg) and dV as ``chunk_grad`` forms it
    (dV = Ag^T (diag(d) K dS' + P^T dO)), in float64 on zero-padded 64-row chunks with a flat g~ past the end,
    as the kernels see them, against the reference backward."""
    from flashgdn.reference.chunked import chunk_local_cumsum, gated_inverse, kkt_inverse
    from flashgdn.reference.chunked_backward import chunk_state_gradients_reference

    C, K, V, scale = 64, 16, 8, 0.3
    inp = make_inputs(Hqk=1, Hv=2, K=K, V=V, dtype=torch.float64, seqlens=[200, 70], gate="mixed")
    q, k, v, g, beta, h0, cu = (inp[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(h0.shape, generator=gen, dtype=torch.float64)
    want_end, want_start = chunk_state_gradients_reference(q, k, g, beta, do, dht, scale=scale, cu_seqlens=cu)
    want_dv = chunk_gated_delta_rule_backward_reference(q, k, v, g, beta, do, dht, scale=scale, initial_state=h0,
                                                        cu_seqlens=cu)[2]
    gc = chunk_local_cumsum(g, cu)
    Ag = gated_inverse(kkt_inverse(k, beta, cu), gc, beta, cu)
    lower = torch.ones(C, C, dtype=torch.float64).tril()
    dv = torch.zeros_like(v)
    chunk0 = 0
    for n in range(len(cu) - 1):
        bos, eos = int(cu[n]), int(cu[n + 1])
        n_chunks = (eos - bos + C - 1) // C
        for h in range(2):
            dST = dht[n, h].T.clone()
            for c in reversed(range(n_chunks)):
                t0 = bos + c * C
                rows = min(C, eos - t0)

                def tile(x, width):
                    out = torch.zeros(C, width, dtype=torch.float64)
                    out[:rows] = x[:rows]
                    return out

                Q, Kc = tile(q[0, t0:, 0], K), tile(k[0, t0:, 0], K)
                dO, Agc = tile(do[0, t0:, h], V), tile(Ag[0, t0:, h], C)
                G = torch.cat([gc[0, t0:t0 + rows, h], gc[0, t0 + rows - 1, h].expand(C - rows)])
                gam, dec = G.exp(), (G[-1] - G).exp()
                P = scale * (Q @ Kc.T) * (G[:, None] - G[None, :]).clamp(max=0).exp() * lower
                assert torch.allclose(dST.T, want_end[chunk0 + c, h], atol=1e-12)
                dV = Agc.T @ ((Kc @ dST.T) * dec[:, None] + P.T @ dO)
                dv[0, t0:t0 + rows, h] = dV[:rows]
                XT = (dST @ Kc.T) * dec[None, :] + dO.T @ P
                YT = XT @ Agc
                dST = G[-1].exp() * dST - (YT * gam[None, :]) @ Kc + dO.T @ (scale * gam[:, None] * Q)
            assert torch.allclose(dST.T, want_start[n, h], atol=1e-12)
        chunk0 += n_chunks
    assert rel_rms(dv, want_dv) < 1e-12

