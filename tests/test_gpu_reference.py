"""The reference backend on CUDA against the float64 oracle, with bf16 inputs and the bars of DESIGN.md §3.

Forward: the float64 token recurrence. Gradients (and the 64K-token forward, where a token loop is slow): the
chunked reference in float64, which the CPU suite checks against the recurrence to ~1e-10.
"""
import pytest
import torch

from flashgdn import chunk_gated_delta_rule
from flashgdn.reference.recurrent import recurrent_gated_delta_rule
from helpers import BARS_16BIT, chunked64, copy_inputs, grads_of, make_inputs, oracle, rel_rms

pytestmark = pytest.mark.gpu

def ref_op(**kw):
    return chunk_gated_delta_rule(**kw, backend="reference")


def check(errs):
    bad = {n: e for n, e in errs.items() if not e <= BARS_16BIT[n]}
    assert not bad, "rel RMS above the bar: " + ", ".join(f"{n} {e:.2e} > {BARS_16BIT[n]:.0e}" for n, e in bad.items())


CASES = [
    ("varlen_gva2", dict(seqlens=(1000, 63, 0, 2048, 130), pad=100, Hqk=4, Hv=8)),
    ("gva8_v_first", dict(seqlens=(700, 1), Hqk=1, Hv=8, state_v_first=True)),
    ("strong_and_zero_decay", dict(seqlens=(1500, 65), Hqk=2, Hv=4, gate="mixed", zero_gate_heads=(1,))),
    ("l2norm_unnormalised", dict(seqlens=(640, 127), Hqk=2, Hv=2, normalize_qk=False, use_qk_l2norm_in_kernel=True)),
    ("dense_no_h0", dict(seqlens=(512, 512), dense=True, Hqk=2, Hv=4, initial_state=False)),
    ("short_many", dict(seqlens=tuple(range(1, 200, 7)), Hqk=2, Hv=4)),
]


@pytest.mark.parametrize("kw", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_forward_and_gradients_bf16(cuda, kw):
    inp = make_inputs(K=128, V=128, dtype=torch.bfloat16, device=cuda, requires_grad=True, **kw)
    o, ht, grads = grads_of(ref_op, inp)
    assert o.is_cuda and o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    o_ref, ht_ref = oracle(inp)
    _, _, g_ref = grads_of(ref_op, copy_inputs(inp, dtype=torch.float64, requires_grad=True))
    errs = {"o": rel_rms(o, o_ref), "final_state": rel_rms(ht, ht_ref)}
    errs.update({n: rel_rms(grads[n], g_ref[n]) for n in grads})
    check(errs)
    if kw.get("pad"):
        end = int(inp["cu_seqlens"][-1])
        assert (o[:, end:] == 0).all()
        assert all((grads[n][:, end:] == 0).all() for n in ("q", "k", "v", "g", "beta"))


def test_long_sequence_64k_forward(cuda):
    inp = make_inputs(seqlens=(65536,), Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda)
    with torch.no_grad():
        o, ht = ref_op(**inp, output_final_state=True)
    o_ref, ht_ref = chunked64(inp)
    check({"o": rel_rms(o, o_ref), "final_state": rel_rms(ht, ht_ref)})


def test_host_copy_of_offsets_gives_the_same_result(cuda):
    inp = make_inputs(seqlens=(300, 0, 77), pad=70, K=64, V=64, dtype=torch.bfloat16, device=cuda)
    cu = inp["cu_seqlens"].to(torch.int32)
    with torch.no_grad():
        o1, h1 = ref_op(**{**inp, "cu_seqlens": cu}, output_final_state=True)
        o2, h2 = ref_op(**{**inp, "cu_seqlens": cu}, cu_seqlens_cpu=cu.cpu(), output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


def test_float64_on_cuda_matches_the_recurrence(cuda):
    inp = make_inputs(seqlens=(200, 65), Hqk=1, Hv=2, K=32, V=16, dtype=torch.float64, device=cuda, gate="mixed")
    o, ht = ref_op(**inp, output_final_state=True)
    o_ref, ht_ref = recurrent_gated_delta_rule(**inp, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=0, atol=1e-10)
