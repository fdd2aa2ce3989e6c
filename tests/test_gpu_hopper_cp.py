"""Exact context parallelism with the Hopper kernels (GPU): equal to the run without segments up to rounding
(relative RMS <= 1e-3 on o and the final state), for strong decay, g = 0 heads and unnormalised keys."""
import pytest
import torch

from flashgdn import chunk_gated_delta_rule
from helpers import make_inputs, rel_rms

pytestmark = pytest.mark.gpu

CP_BAR = 1e-3


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000], gate="strong", zero_gate_heads=(1,)),
    dict(seqlens=[4096, 4096], dense=True, normalize_qk=False),
    dict(seqlens=[3000, 1], state_v_first=True, initial_state=False),
])
@pytest.mark.parametrize("segment_chunks", [4, 16])
def test_hopper_cp_equals_no_cp(opts, segment_chunks, cuda):
    inp = make_inputs(Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, **opts)
    if inp.get("cu_seqlens") is not None:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    with torch.no_grad():
        o0, h0 = chunk_gated_delta_rule(**inp, output_final_state=True, backend="hopper", cp="off")
        o1, h1 = chunk_gated_delta_rule(**inp, output_final_state=True, backend="hopper", cp=segment_chunks)
    assert rel_rms(o1.float(), o0.float()) < CP_BAR
    assert rel_rms(h1, h0) < CP_BAR
