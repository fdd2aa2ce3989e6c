"""Exact context parallelism on the CPU: planning, splicing, and the segment driver around the float64 reference
(equal to the forward without segments up to rounding, for any gate and unnormalised keys)."""
import pytest
import torch

from flashgdn.cp import CostModel, cp_forward, estimated_us, parse_cp, plan_segments, split_sequences
from flashgdn.reference.chunked import chunk_gated_delta_rule_reference
from helpers import make_inputs, rel_rms


def ref_forward(q, k, v, g, beta, scale, h0, cu, output_final_state, cu_cpu=None, need_output=True):
    return chunk_gated_delta_rule_reference(q, k, v, g, beta, scale=scale, initial_state=h0,
                                            output_final_state=output_final_state, cu_seqlens=cu,
                                            cu_seqlens_cpu=cu_cpu)


# ---------------------------------------------------------------------------------------------------------
# planning


def test_split_sequences_cuts_at_chunk_multiples():
    plan = split_sequences([130, 64, 0, 700], 4)
    assert plan.seg_cu.tolist() == [0, 130, 194, 194, 450, 706, 894]
    assert plan.seg_seq.tolist() == [0, 1, 2, 3, 3, 3]
    assert plan.first.tolist() == [0, 1, 2, 3] and plan.count.tolist() == [1, 1, 1, 3]
    assert plan.split
    assert not split_sequences([130, 700], None).split


@pytest.mark.parametrize("seqlens", [[32768], [16384, 16384], [28672, 4096]])
def test_auto_splits_few_long_sequences_with_few_heads(seqlens):
    plan = plan_segments(seqlens, heads=8, cp="auto", model=CostModel(num_sms=132))
    assert plan.split and plan.segment_chunks is not None
    assert estimated_us(seqlens, 8, plan.segment_chunks, CostModel()) < 0.9 * estimated_us(seqlens, 8, None, CostModel())


@pytest.mark.parametrize("seqlens,heads", [([4096] * 8, 64), ([1024] * 8, 32), ([2048], 64), ([100] * 500, 16)])
def test_auto_keeps_shapes_that_fill_the_gpu(seqlens, heads):
    assert not plan_segments(seqlens, heads=heads, cp="auto", model=CostModel(num_sms=132)).split


def test_cp_argument_is_checked():
    assert parse_cp("auto") == "auto" and parse_cp("off") == "off" and parse_cp(16) == 16 and parse_cp("8") == 8
    for bad in (0, -3, "fast", "0"):
        with pytest.raises(ValueError, match="cp must be"):
            parse_cp(bad)
    for bad in (True, 1.5, None):
        with pytest.raises(TypeError, match="cp must be"):
            parse_cp(bad)


# ---------------------------------------------------------------------------------------------------------
# exactness against the forward without segments (float64)


CASES = [
    dict(seqlens=[700], gate="normal"),
    dict(seqlens=[1000, 37, 300], gate="strong", zero_gate_heads=(1,)),
    dict(seqlens=[513, 64, 1], gate="mixed", normalize_qk=False),
    dict(seqlens=[300, 300], gate="normal", dense=True),
    dict(seqlens=[900], gate="normal", initial_state=False, zero_gate_heads=(0, 2, 3)),
]


@pytest.mark.parametrize("K,V", [(16, 16), (16, 8)])  # V = K: b and M in one pass of 2 Hv heads; else two
@pytest.mark.parametrize("segment_chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cp_forward_equals_the_forward_without_segments(case, segment_chunks, K, V):
    kw = dict(CASES[case])
    dense = kw.pop("dense", False)
    inp = make_inputs(Hqk=2, Hv=4, K=K, V=V, dtype=torch.float64, dense=dense, **kw)
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    h0 = inp["initial_state"]
    if dense:  # B sequences of length T, packed
        B, T = q.shape[:2]
        q, k, v, g, beta = (x.reshape((1, B * T) + x.shape[2:]) for x in (q, k, v, g, beta))
        cu = torch.arange(0, (B + 1) * T, T)
    else:
        cu = inp["cu_seqlens"]
    seqlens = (cu[1:] - cu[:-1]).tolist()
    scale = K ** -0.5
    o_ref, ht_ref = ref_forward(q, k, v, g, beta, scale, h0, cu, True)
    plan = split_sequences(seqlens, segment_chunks)
    o, ht = cp_forward(ref_forward, q, k, v, g, beta, scale, h0, True, plan)
    assert rel_rms(o, o_ref) < 1e-10
    assert rel_rms(ht, ht_ref) < 1e-10


def test_cp_forward_gradients_equal_those_without_segments():
    inp = make_inputs(seqlens=[400, 90], Hqk=1, Hv=2, K=8, V=8, dtype=torch.float64, gate="mixed")
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def grads(use_cp):
        xs = {n: inp[n].detach().clone().requires_grad_(True) for n in names}
        args = (xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], 8 ** -0.5)
        if use_cp:
            o, ht = cp_forward(ref_forward, *args, xs["initial_state"], True, split_sequences([400, 90], 2))
        else:
            o, ht = ref_forward(*args, xs["initial_state"], inp["cu_seqlens"], True)
        (o.square().sum() + ht.sin().sum()).backward()
        return [xs[n].grad for n in names]

    for a, b in zip(grads(True), grads(False)):
        assert rel_rms(a, b) < 1e-10


# ---------------------------------------------------------------------------------------------------------
# through the operator (reference backend: cp="auto" is off there, a segment length runs exact CP)


@pytest.mark.parametrize("opts", [
    dict(seqlens=[700, 1, 300], state_v_first=True),
    dict(seqlens=[300, 300], dense=True, use_qk_l2norm_in_kernel=True, normalize_qk=False),
    dict(seqlens=[520], gate="strong", zero_gate_heads=(0,), initial_state=False),
])
def test_operator_cp_equals_no_cp_with_gradients(opts):
    from flashgdn import chunk_gated_delta_rule

    inp = make_inputs(Hqk=1, Hv=2, K=8, V=8, dtype=torch.float64, **opts)
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if inp.get(n) is not None]

    def run(cp):
        args = dict(inp)
        for n in names:
            args[n] = inp[n].detach().clone().requires_grad_(True)
        o, ht = chunk_gated_delta_rule(**args, output_final_state=True, backend="reference", cp=cp)
        (o.square().sum() + ht.cos().sum()).backward()
        return [o.detach(), ht.detach()] + [args[n].grad for n in names]

    for a, b in zip(run(3), run("off")):
        assert rel_rms(a, b) < 1e-10


def test_operator_rejects_a_bad_cp():
    from flashgdn import chunk_gated_delta_rule

    inp = make_inputs(seqlens=[100], K=8, V=8)
    with pytest.raises(ValueError, match="cp must be"):
        chunk_gated_delta_rule(**inp, cp=0)
    with pytest.raises(TypeError, match="cp must be"):
        chunk_gated_delta_rule(**inp, cp=2.0)
