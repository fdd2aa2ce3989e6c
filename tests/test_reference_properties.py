"""Properties of the reference backend through the public op: varlen, GVA, layouts, L2 norm, padding, edge
lengths, strong decay, low precision against the float64 oracle, random shapes."""
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashgdn import chunk_gated_delta_rule
from flashgdn.reference.recurrent import l2norm, recurrent_gated_delta_rule
from helpers import BARS_16BIT, copy_inputs, grads_of, leaves, make_inputs, oracle, rel_rms

F64 = torch.float64


def ref_op(**kw):
    return chunk_gated_delta_rule(**kw, backend="reference")


def assert_grads_close(a, b, atol=1e-11):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=atol, msg=lambda m: f"d{n}: {m}")


def test_varlen_equals_per_sequence_calls():
    seqlens = (70, 0, 130, 1, 64)
    inp = make_inputs(seqlens=seqlens, pad=10, dtype=F64, requires_grad=True)
    o, h, grads = grads_of(ref_op, inp)
    cu = inp["cu_seqlens"].tolist()
    for n in range(len(seqlens)):
        one = {name: inp[name][:, cu[n] : cu[n + 1]].detach() for name in ("q", "k", "v", "g", "beta")}
        one["initial_state"] = inp["initial_state"][n : n + 1].detach()
        o1, h1 = ref_op(**one, output_final_state=True)
        torch.testing.assert_close(o[:, cu[n] : cu[n + 1]], o1, rtol=0, atol=1e-12)
        torch.testing.assert_close(h[n : n + 1], h1, rtol=0, atol=1e-12)
    # dense batch of equal lengths equals its packed form, gradients included
    dense = make_inputs(seqlens=(100, 100, 100), dense=True, dtype=F64, requires_grad=True)
    packed = copy_inputs(dense, requires_grad=True)
    for name in ("q", "k", "v", "g", "beta"):
        packed[name] = packed[name].detach().reshape(1, 300, *packed[name].shape[2:]).requires_grad_()
    packed["cu_seqlens"] = torch.tensor([0, 100, 200, 300])
    od, hd, gd = grads_of(ref_op, dense)
    op_, hp, gp = grads_of(ref_op, packed)
    torch.testing.assert_close(od.reshape(1, 300, *od.shape[2:]), op_, rtol=0, atol=1e-12)
    torch.testing.assert_close(hd, hp, rtol=0, atol=1e-12)
    for name in gd:
        torch.testing.assert_close(gd[name].reshape(gp[name].shape), gp[name], rtol=0, atol=1e-11)


@pytest.mark.parametrize("Hqk,Hv", [(1, 2), (2, 8), (1, 8)])
def test_gva_equals_repeated_qk(Hqk, Hv):
    inp = make_inputs(seqlens=(90, 40), Hqk=Hqk, Hv=Hv, K=16, V=8, dtype=F64, requires_grad=True)
    o, h, grads = grads_of(ref_op, inp)
    group = Hv // Hqk
    rep = copy_inputs(inp, requires_grad=True)
    rep["q"] = rep["q"].detach().repeat_interleave(group, 2).requires_grad_()
    rep["k"] = rep["k"].detach().repeat_interleave(group, 2).requires_grad_()
    o2, h2, g2 = grads_of(ref_op, rep)
    torch.testing.assert_close(o, o2, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, h2, rtol=0, atol=1e-12)
    # a shared q/k head's gradient is the sum over the value heads that read it
    for name in ("q", "k"):
        g2[name] = g2[name].unflatten(2, (Hqk, group)).sum(3)
    assert_grads_close(grads, g2)


def test_state_layouts_agree():
    kf = make_inputs(seqlens=(100, 29), state_v_first=False, dtype=F64, K=16, V=8, requires_grad=True)
    vf = copy_inputs(kf, requires_grad=True)
    vf["initial_state"] = kf["initial_state"].detach().transpose(-1, -2).contiguous().requires_grad_()
    vf["state_v_first"] = True
    gen = torch.Generator().manual_seed(0)
    do = torch.randn(kf["v"].shape, generator=gen, dtype=F64)
    dht = torch.randn(kf["initial_state"].shape, generator=gen, dtype=F64)  # [N, Hv, K, V]

    def run(inp, v_first):
        o, h = ref_op(**inp, output_final_state=True)
        hk = h.transpose(-1, -2) if v_first else h
        xs = leaves(inp)
        gs = torch.autograd.grad((o * do).sum() + (hk * dht).sum(), list(xs.values()))
        return o, hk, h, dict(zip(xs, gs))

    o1, h1, raw1, g1 = run(kf, False)
    o2, h2, raw2, g2 = run(vf, True)
    assert raw1.shape == (2, 4, 16, 8) and raw2.shape == (2, 4, 8, 16)
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-12)
    torch.testing.assert_close(h1, h2, rtol=0, atol=1e-12)
    g2["initial_state"] = g2["initial_state"].transpose(-1, -2)
    assert_grads_close(g1, g2)


def test_l2norm_in_kernel_equals_prenormalised():
    inp = make_inputs(seqlens=(100, 29), normalize_qk=False, dtype=F64, requires_grad=True)
    o1, h1, g1 = grads_of(ref_op, {**inp, "use_qk_l2norm_in_kernel": True})
    pre = copy_inputs(inp, requires_grad=True)
    qn, kn = l2norm(pre["q"]), l2norm(pre["k"])
    o2, h2 = ref_op(**{**pre, "q": qn, "k": kn}, output_final_state=True)
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-12)
    torch.testing.assert_close(h1, h2, rtol=0, atol=1e-12)
    _, _, g2 = grads_of(lambda **kw: ref_op(**{**kw, "q": l2norm(kw["q"]), "k": l2norm(kw["k"])}), pre)
    assert_grads_close(g1, g2)


def test_padded_tail_gets_zero_output_and_gradients():
    inp = make_inputs(seqlens=(50, 80), pad=150, dtype=torch.float32, requires_grad=True)
    o, _, grads = grads_of(ref_op, inp)
    end = int(inp["cu_seqlens"][-1])
    assert (o[:, end:] == 0).all()
    for name in ("q", "k", "v", "g", "beta"):
        assert (grads[name][:, end:] == 0).all(), name
        assert grads[name][:, :end].abs().sum() > 0, name


@pytest.mark.parametrize("seqlens", [(1,), (5,), (63,), (64,), (65,), (200,)])
def test_short_and_odd_lengths(seqlens):
    inp = make_inputs(seqlens=seqlens, dense=True, dtype=torch.float32)
    o, h = ref_op(**inp, output_final_state=True)
    o_ref, h_ref = oracle(inp)
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(h, h_ref) < 1e-5


def test_zero_length_sequences_keep_their_state():
    inp = make_inputs(seqlens=(0, 20, 0), dtype=F64, requires_grad=True)
    o, h = ref_op(**inp, output_final_state=True)
    torch.testing.assert_close(h[[0, 2]], inp["initial_state"][[0, 2]])
    dht = torch.randn_like(h)
    (dh0,) = torch.autograd.grad((o.sum() + (h * dht).sum()), [inp["initial_state"]])
    torch.testing.assert_close(dh0[[0, 2]], dht[[0, 2]])  # an empty sequence passes its state through
    # all sequences empty: no chunk at all
    empty = make_inputs(seqlens=(0, 0), pad=3, dtype=F64)
    o, h = ref_op(**empty, output_final_state=True)
    assert (o == 0).all() and torch.equal(h, empty["initial_state"])


@pytest.mark.parametrize("gate", ["strong", "mixed"])
def test_strong_decay_and_no_decay_stay_finite(gate):
    inp = make_inputs(seqlens=(300, 77), Hv=4, gate=gate, zero_gate_heads=(1,), requires_grad=True)
    assert float(inp["g"].detach().min()) < -20  # the test reaches per-token decays past e^-20
    o, h, grads = grads_of(ref_op, inp)
    for t in [o, h, *grads.values()]:
        assert torch.isfinite(t).all()
    o_ref, h_ref = oracle(inp)
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(h, h_ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_near_oracle(dtype):
    inp = make_inputs(seqlens=(300, 100, 37), Hqk=2, Hv=4, K=64, V=64, dtype=dtype, gate="mixed",
                      zero_gate_heads=(3,), requires_grad=True)
    o, h, grads = grads_of(ref_op, inp)
    assert o.dtype == dtype and h.dtype == torch.float32
    for n, gr in grads.items():
        assert gr.dtype == inp[n].dtype, n
    o_ref, h_ref = oracle(inp)
    # gradient oracle: the chunked form in float64 (equal to the recurrence's to ~1e-10, test_reference_chunked)
    _, _, g_ref = grads_of(ref_op, copy_inputs(inp, dtype=F64, requires_grad=True))
    errs = {"o": rel_rms(o, o_ref), "final_state": rel_rms(h, h_ref)}
    errs.update({n: rel_rms(grads[n], g_ref[n]) for n in grads})
    for n, e in errs.items():
        assert e <= BARS_16BIT[n], f"{n}: rel RMS {e:.2e} > {BARS_16BIT[n]:.0e}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(0, 150), min_size=1, max_size=4),
    pad=st.integers(0, 70),
    Hqk=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    K=st.sampled_from([4, 8, 16]),
    V=st.sampled_from([4, 12]),
    v_first=st.booleans(),
    l2=st.booleans(),
    h0=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_recurrence(lens, pad, Hqk, group, K, V, v_first, l2, h0, seed):
    inp = make_inputs(seqlens=tuple(lens), pad=pad, Hqk=Hqk, Hv=Hqk * group, K=K, V=V, dtype=F64, seed=seed,
                      normalize_qk=not l2, use_qk_l2norm_in_kernel=l2, initial_state=h0, state_v_first=v_first,
                      gate="mixed")
    o, h = ref_op(**inp, output_final_state=True)
    o_ref, h_ref = recurrent_gated_delta_rule(**inp, output_final_state=True)
    assert o.shape == o_ref.shape and h.shape == h_ref.shape
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-10)


@pytest.mark.slow
def test_cpu_speed_4k_tokens_8_heads():
    """The reference is meant for real sizes on a CPU: 4K tokens, 8 heads, K = V = 128, fwd+bwd in seconds."""
    inp = make_inputs(seqlens=(1000, 3096), Hqk=8, Hv=8, K=128, V=128, dtype=torch.bfloat16, requires_grad=True)
    start = time.perf_counter()
    _, _, grads = grads_of(ref_op, inp)
    elapsed = time.perf_counter() - start
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert elapsed < 30, f"fwd+bwd took {elapsed:.1f} s"
