"""The chunked reference against the token recurrence, in float64: forward, final state and every gradient."""
import pytest
import torch

from flashgdn.reference.chunked import chunk_gated_delta_rule_reference
from flashgdn.reference.recurrent import recurrent_gated_delta_rule
from helpers import copy_inputs, grads_of, make_inputs

F64 = torch.float64

# (id, make_inputs arguments): the cases DESIGN.md §3 asks for, small enough for the token loop
CASES = [
    ("dense", dict(seqlens=(150, 150), dense=True)),
    ("varlen", dict(seqlens=(70, 1, 130, 64))),
    ("T1", dict(seqlens=(1,), dense=True)),
    ("T63", dict(seqlens=(63,), dense=True)),
    ("T64", dict(seqlens=(64,), dense=True)),
    ("T65", dict(seqlens=(65,), dense=True)),
    ("T127", dict(seqlens=(127,), dense=True)),
    ("gva2", dict(seqlens=(90, 40), Hqk=2, Hv=4)),
    ("gva4", dict(seqlens=(100,), Hqk=1, Hv=4)),
    ("gva8", dict(seqlens=(80,), Hqk=1, Hv=8, K=16, V=16)),
    ("v_first", dict(seqlens=(100, 29), state_v_first=True)),
    ("no_h0", dict(seqlens=(100, 29), initial_state=False)),
    ("l2norm", dict(seqlens=(100, 29), normalize_qk=False, use_qk_l2norm_in_kernel=True)),
    ("unnormalised", dict(seqlens=(100, 29), normalize_qk=False)),
    ("strong_decay", dict(seqlens=(150, 70), gate="strong")),
    ("mixed_zero_gate", dict(seqlens=(150, 70), gate="mixed", zero_gate_heads=(1, 3))),
    ("empty_seqs", dict(seqlens=(0, 70, 0, 0, 65, 0))),
    ("pad_tail", dict(seqlens=(50, 80), pad=150)),
    ("rect_heads", dict(seqlens=(100,), K=16, V=48)),
]


@pytest.mark.parametrize("kw", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_forward_matches_recurrence(kw):
    inp = make_inputs(dtype=F64, **kw)
    o_ref, h_ref = recurrent_gated_delta_rule(**inp, output_final_state=True)
    o, h = chunk_gated_delta_rule_reference(**inp, output_final_state=True)
    assert o.dtype == F64 and h.dtype == F64
    assert torch.isfinite(o).all() and torch.isfinite(h).all()
    scale = max(1.0, float(o_ref.abs().max()))
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10 * scale)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-10 * max(1.0, float(h_ref.abs().max())))


@pytest.mark.parametrize("kw", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_gradients_match_recurrence(kw):
    inp = make_inputs(dtype=F64, requires_grad=True, **kw)
    _, _, g_ref = grads_of(recurrent_gated_delta_rule, inp)
    _, _, g = grads_of(chunk_gated_delta_rule_reference, copy_inputs(inp, requires_grad=True))
    assert g.keys() == g_ref.keys()
    for name in g_ref:
        assert torch.isfinite(g[name]).all(), name
        bound = 1e-10 * max(1.0, float(g_ref[name].abs().max()))
        torch.testing.assert_close(g[name], g_ref[name], rtol=0, atol=bound, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize(
    "kw", [dict(seqlens=(65,), dense=True), dict(seqlens=(3, 0, 66), pad=2)], ids=["dense", "varlen"]
)
@pytest.mark.slow
def test_gradcheck_tiny(kw):
    inp = make_inputs(dtype=F64, Hqk=1, Hv=2, K=3, V=2, requires_grad=True, use_qk_l2norm_in_kernel=True, **kw)
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if inp[n] is not None]
    rest = {n: x for n, x in inp.items() if n not in names}

    def f(*xs):
        return chunk_gated_delta_rule_reference(**dict(zip(names, xs)), **rest, output_final_state=True)

    assert torch.autograd.gradcheck(f, tuple(inp[n] for n in names), eps=1e-6, atol=1e-6, rtol=1e-5)
