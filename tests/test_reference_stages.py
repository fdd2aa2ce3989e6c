"""Each stage of the chunked reference on its own, against its defining equation (DESIGN.md §2)."""
import pytest
import torch

from flashgdn.reference import chunked as ch
from flashgdn.reference.layout import chunk_table
from flashgdn.reference.recurrent import recurrent_gated_delta_rule
from helpers import make_inputs

F64 = torch.float64
SEQLENS = (70, 0, 129, 64, 5)


@pytest.fixture(scope="module")
def inp():
    return make_inputs(seqlens=SEQLENS, pad=80, Hqk=2, Hv=4, K=16, V=8, dtype=F64, gate="mixed")


@pytest.fixture(scope="module")
def table(inp):
    return chunk_table(inp["cu_seqlens"], 1, inp["q"].shape[1])


def chunk_slices(table):
    """(chunk index, sequence id, token slice in the packed row) for every chunk."""
    for c in range(table.NC):
        s = int(table.chunk_start[c])
        yield c, int(table.chunk_seq[c]), slice(s, s + int(table.chunk_len[c]))


@pytest.fixture(scope="module")
def stages(inp):
    cu = inp["cu_seqlens"]
    k, v, beta = inp["k"], inp["v"], inp["beta"]
    gcum = ch.chunk_local_cumsum(inp["g"], cu)
    A = ch.kkt_inverse(k, beta, cu)
    Ag = ch.gated_inverse(A, gcum, beta, cu)
    X, M, b = ch.state_pass(k, v, gcum, A, beta, cu)
    h, final = ch.chunk_states(k, v, gcum, A, beta, inp["initial_state"], cu)
    Vn = ch.new_values(k, v, gcum, Ag, h, cu)
    o = ch.chunk_outputs(inp["q"], k, gcum, Vn, h, cu_seqlens=cu)
    return dict(gcum=gcum, A=A, Ag=Ag, X=X, M=M, b=b, h=h, final=final, Vn=Vn, o=o)


def test_chunk_local_cumsum(inp, table, stages):
    g, gcum = inp["g"][0], stages["gcum"][0]
    for _, _, sl in chunk_slices(table):
        torch.testing.assert_close(gcum[sl], g[sl].cumsum(0))
    assert (gcum[int(inp["cu_seqlens"][-1]) :] == 0).all()


def test_kkt_inverse_is_the_inverse(inp, table, stages):
    k, beta, A = inp["k"][0], inp["beta"][0], stages["A"][0]
    group = A.shape[1] // k.shape[1]
    for _, _, sl in chunk_slices(table):
        L = sl.stop - sl.start
        for h in range(A.shape[1]):
            kk = k[sl, h // group]
            lower = torch.tril(beta[sl, h, None] * (kk @ kk.T), -1)
            a = A[sl, h, :L]
            torch.testing.assert_close(a @ (torch.eye(L, dtype=F64) + lower), torch.eye(L, dtype=F64))
            assert (A[sl, h, L:] == 0).all()  # columns past the chunk's length
            assert (torch.triu(a, 1) == 0).all()


def test_gated_inverse_identity(inp, table, stages):
    """Ag = (I + StrictLower(diag(beta)(Gam ⊙ K K^T)))^{-1} diag(beta): the gated inverse, built directly."""
    k, beta, gcum, Ag = inp["k"][0], inp["beta"][0], stages["gcum"][0], stages["Ag"][0]
    group = Ag.shape[1] // k.shape[1]
    for _, _, sl in chunk_slices(table):
        L = sl.stop - sl.start
        for h in range(Ag.shape[1]):
            gc = gcum[sl, h]
            gam = torch.tril(torch.exp(torch.tril(gc[:, None] - gc[None, :])))
            kk = k[sl, h // group]
            lower = torch.tril(beta[sl, h, None] * (gam * (kk @ kk.T)), -1)
            want = torch.linalg.inv(torch.eye(L, dtype=F64) + lower) @ torch.diag(beta[sl, h])
            torch.testing.assert_close(Ag[sl, h, :L], want)
            assert (Ag[sl, h, L:] == 0).all()


def test_state_pass_is_the_chunk_transition(inp, table, stages):
    """M S + b equals the Vn form of the update, S' = exp(g~_C) S + K^T diag(exp(g~_C - g~)) Vn, for any S;
    and X = -diag(beta) A^T K."""
    k, v, beta = inp["k"][0], inp["v"][0], inp["beta"][0]
    gcum, A, Ag, X, M, b = (stages[n] for n in ("gcum", "A", "Ag", "X", "M", "b"))
    group = A.shape[2] // k.shape[1]
    gen = torch.Generator().manual_seed(3)
    for c, _, sl in chunk_slices(table):
        L = sl.stop - sl.start
        for h in range(A.shape[2]):
            kk, vv, gc = k[sl, h // group], v[sl, h], gcum[0, sl, h]
            torch.testing.assert_close(X[0, sl, h], -beta[sl, h, None] * (A[0, sl, h, :L].T @ kk))
            S = torch.randn(kk.shape[1], vv.shape[1], generator=gen, dtype=F64)
            vn = Ag[0, sl, h, :L] @ (vv - gc.exp()[:, None] * (kk @ S))
            want = gc[-1].exp() * S + kk.T @ ((gc[-1] - gc).exp()[:, None] * vn)
            torch.testing.assert_close(M[c, h] @ S + b[c, h], want)


def test_chunk_states_are_recurrence_states(inp, table, stages):
    """h at chunk c of sequence n is the recurrence's state after the first 64c tokens of n."""
    cu = inp["cu_seqlens"].tolist()
    h, final = stages["h"], stages["final"]
    for c, n, sl in chunk_slices(table):
        ins = {name: inp[name][:, cu[n] : sl.start] for name in ("q", "k", "v", "g", "beta")}
        _, want = recurrent_gated_delta_rule(**ins, initial_state=inp["initial_state"][n : n + 1], output_final_state=True)
        torch.testing.assert_close(h[c], want[0])
    _, want = recurrent_gated_delta_rule(
        **{n: inp[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens")}, output_final_state=True
    )
    torch.testing.assert_close(final, want)
    torch.testing.assert_close(final[1], inp["initial_state"][1])  # the empty sequence keeps its state


def test_stages_compose_to_the_operator(inp, stages):
    o, _ = ch.chunk_gated_delta_rule_reference(**inp)
    torch.testing.assert_close(stages["o"], o, rtol=0, atol=1e-12)
    o_ref, _ = recurrent_gated_delta_rule(**inp)
    torch.testing.assert_close(stages["o"], o_ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("cuts", [(1,), (1, 2), (2, 3), (1, 2, 3, 4)])
def test_splicing_segments_reproduces_states(cuts):
    """Split one long sequence's chunks into segments, compose each segment's (M, b) independently, then
    splice S_{i+1} = M_i S_i + b_i from the initial state: the segment-boundary and final states are exact."""
    inp = make_inputs(seqlens=(300,), Hqk=1, Hv=2, K=16, V=8, dtype=F64, gate="mixed")
    k, v, beta = inp["k"], inp["v"], inp["beta"]
    gcum = ch.chunk_local_cumsum(inp["g"], inp["cu_seqlens"])
    A = ch.kkt_inverse(k, beta, inp["cu_seqlens"])
    _, M, b = ch.state_pass(k, v, gcum, A, beta, inp["cu_seqlens"])
    h, final = ch.chunk_states(k, v, gcum, A, beta, inp["initial_state"], inp["cu_seqlens"])
    bounds = [0, *cuts, M.shape[0]]
    S = inp["initial_state"][0]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        torch.testing.assert_close(S, h[lo])
        Ms, bs = ch.compose_transitions(M[lo:hi], b[lo:hi])
        S = Ms @ S + bs
    torch.testing.assert_close(S, final[0])
