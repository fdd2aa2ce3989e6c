"""The Hopper backward's stages against their float64 counterparts (GPU).

Stage 1, the state-gradient walk (``kernels/hopper/state_grad_walk.py``), against
``reference.chunked_backward.chunk_state_gradients_reference``: the gradient at the end of every chunk and at
every sequence's start, on the dh0 bar of DESIGN.md §3 (8e-3 relative RMS), for partial chunks, strong decay and
g = 0 heads, GVA, dense input, with and without a final-state gradient. Outputs are poisoned with NaN first, so
an unwritten element fails."""
import pytest
import torch

from helpers import make_inputs, rel_rms

pytestmark = pytest.mark.gpu

DS_BAR = 8e-3


@pytest.fixture(autouse=True)
def poisoned(monkeypatch, cuda):
    from flashgdn.kernels.hopper import forward

    monkeypatch.setattr(forward, "POISON_OUTPUTS", True)


@pytest.mark.parametrize("opts", [
    dict(seqlens=[64], Hqk=2, Hv=4),
    dict(seqlens=[1000, 3, 130], Hqk=2, Hv=4),
    dict(seqlens=[700, 64, 5], Hqk=2, Hv=8, gate="strong", zero_gate_heads=(1, 6)),
    dict(seqlens=[300, 77, 1024], Hqk=1, Hv=8),
    dict(seqlens=[512, 512], dense=True, Hqk=2, Hv=2),
    dict(seqlens=[4096], Hqk=2, Hv=4, gate="mixed"),
])
@pytest.mark.parametrize("with_dht", [True, False])
def test_state_grad_walk_matches_the_reference(opts, with_dht, cuda):
    from flashgdn.kernels.hopper.backward import hopper_state_gradients
    from flashgdn.reference.chunked_backward import chunk_state_gradients_reference
    from flashgdn.reference.layout import chunk_table

    inp = make_inputs(K=128, V=128, dtype=torch.bfloat16, device=cuda, **opts)
    q, k, g, beta = inp["q"], inp["k"], inp["g"], inp["beta"]
    cu = inp.get("cu_seqlens")
    gen = torch.Generator(device=cuda).manual_seed(3)
    do = torch.randn(inp["v"].shape, generator=gen, device=cuda).to(torch.bfloat16)
    table = chunk_table(cu.cpu() if cu is not None else None, *q.shape[:2])
    dht = torch.randn((table.N, do.shape[2], 128, 128), generator=gen, device=cuda) if with_dht else None
    scale = 128 ** -0.5

    ds_end, dh0, _ = hopper_state_gradients(q, k, g, beta, do, dht, scale, cu)
    want_end, want_start = chunk_state_gradients_reference(q, k, g, beta, do, dht, scale=scale, cu_seqlens=cu,
                                                           compute_dtype=torch.float64)
    NC = table.NC
    got_end = ds_end[:NC].transpose(-1, -2)  # slots of real chunks come first, in the reference's order
    assert torch.isfinite(got_end).all() and torch.isfinite(dh0).all()
    assert rel_rms(got_end, want_end) < DS_BAR
    assert rel_rms(dh0, want_start) < DS_BAR


def test_state_grad_walk_is_deterministic(cuda):
    from flashgdn.kernels.hopper.backward import hopper_state_gradients

    inp = make_inputs(Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, seqlens=[700, 64, 9])
    do = torch.randn(inp["v"].shape, device=cuda).to(torch.bfloat16)
    dht = torch.randn((3, 4, 128, 128), device=cuda)
    args = (inp["q"], inp["k"], inp["g"], inp["beta"], do, dht, 0.1, inp["cu_seqlens"])
    a, b = hopper_state_gradients(*args), hopper_state_gradients(*args)
    NC = 11 + 1 + 1
    assert torch.equal(a[0][:NC], b[0][:NC]) and torch.equal(a[1], b[1])


STATE_BAR = 5e-3  # the forward's bar on states


@pytest.mark.parametrize("opts", [
    dict(seqlens=[1000, 3, 130], Hqk=2, Hv=4),
    dict(seqlens=[700, 64, 5], Hqk=2, Hv=8, gate="strong", zero_gate_heads=(1, 6)),
    dict(seqlens=[512, 512], dense=True, Hqk=1, Hv=2),
])
@pytest.mark.parametrize("with_h0", [True, False])
def test_chunk_states_recompute_matches_the_reference(opts, with_h0, cuda):
    """Stage 1a: the forward state at the start of every chunk, by the rs loop's state-only variant."""
    from flashgdn.kernels.hopper.backward import hopper_chunk_states
    from flashgdn.reference.chunked import chunk_local_cumsum, chunk_states, kkt_inverse
    from flashgdn.reference.layout import chunk_table

    inp = make_inputs(K=128, V=128, dtype=torch.bfloat16, device=cuda,
                      initial_state=with_h0, **opts)
    q, k, v, g, beta, h0 = inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp.get("initial_state")
    cu = inp.get("cu_seqlens")
    states, _ = hopper_chunk_states(q, k, v, g, beta, h0, cu)
    f64 = torch.float64
    gcum = chunk_local_cumsum(g.to(f64), cu)
    A = kkt_inverse(k, beta, cu, compute_dtype=f64)
    want, _ = chunk_states(k, v, gcum, A, beta, h0, cu, compute_dtype=f64)
    NC = chunk_table(cu.cpu() if cu is not None else None, *q.shape[:2]).NC
    got = states[:NC].transpose(-1, -2)
    assert torch.isfinite(got).all()
    assert rel_rms(got, want) < STATE_BAR


DV_BAR = 8e-3  # DESIGN.md §3, dv


@pytest.mark.parametrize("opts", [
    dict(seqlens=[1000, 3, 130], Hqk=2, Hv=4),
    dict(seqlens=[700, 64, 5], Hqk=2, Hv=8, gate="strong", zero_gate_heads=(1, 6)),
    dict(seqlens=[512, 512], dense=True, Hqk=1, Hv=2),
    dict(seqlens=[300, 77], Hqk=2, Hv=4, pad=70),
])
@pytest.mark.parametrize("with_dht", [True, False])
def test_grad_v_and_dh0_match_the_reference(opts, with_dht, cuda):
    """Stages 1b and 2a: dv and dh0 against the float64 chunked backward; padded-tail rows stay zero."""
    from flashgdn.kernels.hopper.backward import hopper_grad_v
    from flashgdn.reference.chunked_backward import chunk_gated_delta_rule_backward_reference

    inp = make_inputs(K=128, V=128, dtype=torch.bfloat16, device=cuda, **opts)
    q, k, v, g, beta, h0 = inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["initial_state"]
    cu = inp.get("cu_seqlens")
    gen = torch.Generator(device=cuda).manual_seed(4)
    do = torch.randn(v.shape, generator=gen, device=cuda).to(torch.bfloat16)
    dht = torch.randn(h0.shape, generator=gen, device=cuda) if with_dht else None
    scale = 128 ** -0.5
    dv, dh0 = hopper_grad_v(q, k, g, beta, do, dht, scale, cu)
    want = chunk_gated_delta_rule_backward_reference(q, k, v, g, beta, do, dht, scale=scale, initial_state=h0,
                                                     cu_seqlens=cu, compute_dtype=torch.float64)
    assert torch.isfinite(dv).all()
    assert rel_rms(dv, want[2]) < DV_BAR
    assert rel_rms(dh0, want[5]) < DV_BAR
    if cu is not None and int(cu[-1]) < q.shape[1]:  # padded tail
        assert (dv[:, int(cu[-1]):] == 0).all()


@pytest.mark.parametrize("heads", [(2, 8), (3, 3), (2, 6)])  # head pairs, a single head per qk head
@pytest.mark.parametrize("seqlens", [[64], [1000, 3, 130], [63, 65, 200]])
def test_stage1_stores_the_ungated_inverse(heads, seqlens, cuda):
    """Stage 1c: A itself beside Ag; Ag bitwise that of the forward's build."""
    from flashgdn.kernels.hopper.backward import hopper_inverse
    from flashgdn.kernels.hopper.forward import slots_to_tokens
    from flashgdn.kernels.hopper.kkt_inverse import build_kkt_inverse
    from flashgdn.kernels.hopper.common import tl_dtype
    from flashgdn.reference.chunked import kkt_inverse

    inp = make_inputs(Hqk=heads[0], Hv=heads[1], K=128, V=128, dtype=torch.bfloat16, device=cuda, seqlens=seqlens,
                      gate="mixed")
    k, g, beta, cu = inp["k"], inp["g"], inp["beta"], inp["cu_seqlens"]
    A, Ag, bounds = hopper_inverse(k, g, beta, cu)
    T = k.shape[1]
    got = slots_to_tokens(A.permute(0, 2, 1, 3), bounds, T)  # [T, Hv, 64]
    want = kkt_inverse(k, beta, cu, compute_dtype=torch.float64)[0]
    assert torch.isfinite(got).all()
    assert rel_rms(got, want) < 2e-3  # fp32 substitution, one tf32 merge (A21); a layout slip would be O(1)
    S = bounds.shape[0]
    gcum2 = torch.empty((heads[1], S * 64), device=cuda)
    Ag2 = torch.zeros_like(Ag)
    io = tl_dtype(k.dtype)
    build_kkt_inverse(heads[0], heads[1], 128, io, io)(k, g.float().contiguous(), beta.float().contiguous(), bounds,
                                                        gcum2, Ag2)
    live = bounds[:, 1] > 0
    assert torch.equal(Ag[live], Ag2[live])
