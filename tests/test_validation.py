"""Every validation rule: bad input raises before any compute, with a message naming the argument."""
import math

import pytest
import torch

from flashgdn import chunk_gated_delta_rule
from flashgdn.api.validate import validate
from helpers import assert_same_computation

B, T, HQK, HV, K, V = 1, 100, 2, 4, 8, 6


def base(**over):
    """Valid varlen inputs (3 sequences); ``over`` replaces entries."""
    kw = dict(
        q=torch.randn(B, T, HQK, K),
        k=torch.randn(B, T, HQK, K),
        v=torch.randn(B, T, HV, V),
        g=-torch.rand(B, T, HV),
        beta=torch.rand(B, T, HV),
        initial_state=torch.randn(3, HV, K, V),
        cu_seqlens=torch.tensor([0, 10, 50, 90]),
    )
    kw.update(over)
    return kw


def dense(**over):
    kw = base(cu_seqlens=None, initial_state=torch.randn(B, HV, K, V))
    kw.update(over)
    return kw


META = torch.device("meta")

# (id, arguments, exception, message pattern)
RULES = [
    ("q_not_tensor", base(q=[[1.0]]), TypeError, r"q must be a torch\.Tensor"),
    ("k_not_tensor", base(k=None), TypeError, r"k must be a torch\.Tensor"),
    ("q_ndim", base(q=torch.randn(T, HQK, K)), ValueError, r"q must be 4-D \[B, T, Hqk, K\]"),
    ("k_ndim", base(k=torch.randn(B, T, HQK * K)), ValueError, r"k must be 4-D"),
    ("v_ndim", base(v=torch.randn(B, T, HV)), ValueError, r"v must be 4-D \[B, T, Hv, V\]"),
    ("g_ndim", base(g=torch.randn(B, T)), ValueError, r"g must be 3-D \[B, T, Hv\]"),
    ("beta_ndim", base(beta=torch.rand(B, T, HV, 1)), ValueError, r"beta must be 3-D"),
    ("k_shape", base(k=torch.randn(B, T, HQK, K + 1)), ValueError, r"k must have q's shape"),
    ("v_T", base(v=torch.randn(B, T + 1, HV, V)), ValueError, r"v must be \[B, T, Hv, V\] with q's B, T"),
    ("g_heads", base(g=torch.randn(B, T, HV + 1)), ValueError, r"g must be \[B, T, Hv\]"),
    ("beta_T", base(beta=torch.rand(B, T - 1, HV)), ValueError, r"beta must be \[B, T, Hv\]"),
    ("gva_ratio", base(v=torch.randn(B, T, 3, V), g=-torch.rand(B, T, 3), beta=torch.rand(B, T, 3)),
     ValueError, r"Hv = 3\) must be a multiple of the q/k heads \(Hqk = 2"),
    ("head_dim_zero", dense(q=torch.randn(B, T, HQK, 0), k=torch.randn(B, T, HQK, 0)),
     ValueError, r"head dims must be positive"),
    ("no_heads", dense(v=torch.randn(B, T, 0, V), g=torch.randn(B, T, 0), beta=torch.randn(B, T, 0)),
     ValueError, r"at least one head"),
    ("empty_batch", dense(q=torch.randn(0, T, HQK, K), k=torch.randn(0, T, HQK, K), v=torch.randn(0, T, HV, V),
                          g=torch.randn(0, T, HV), beta=torch.randn(0, T, HV), initial_state=None),
     ValueError, r"batch size B >= 1"),
    ("q_dtype", base(q=torch.randint(0, 3, (B, T, HQK, K))), TypeError, r"q must be float16, bfloat16, float32"),
    ("k_dtype", base(k=torch.randn(B, T, HQK, K, dtype=torch.float64)), TypeError, r"k must have q's dtype"),
    ("v_dtype", base(v=torch.randn(B, T, HV, V).half()), TypeError, r"v must have q's dtype"),
    ("g_dtype", base(g=torch.zeros(B, T, HV, dtype=torch.int32)), TypeError, r"g must be a floating dtype"),
    ("beta_dtype", base(beta=torch.ones(B, T, HV, dtype=torch.bool)), TypeError, r"beta must be a floating"),
    ("device_k", base(k=torch.randn(B, T, HQK, K, device=META)), ValueError, r"k is on meta but q is on cpu"),
    ("device_state", base(initial_state=torch.randn(3, HV, K, V, device=META)), ValueError,
     r"initial_state is on meta"),
    ("device_cu", base(cu_seqlens=torch.tensor([0, 10], device=META)), ValueError, r"cu_seqlens is on meta"),
    ("cu_not_tensor", base(cu_seqlens=[0, 10, 50]), TypeError, r"cu_seqlens must be a torch\.Tensor"),
    ("cu_ndim", base(cu_seqlens=torch.tensor([[0, 10]])), ValueError, r"cu_seqlens must be 1-D"),
    ("cu_dtype", base(cu_seqlens=torch.tensor([0.0, 10.0])), TypeError, r"cu_seqlens must be int32 or int64"),
    ("cu_short", base(cu_seqlens=torch.tensor([0])), ValueError, r"cu_seqlens must have at least 2 entries"),
    ("cu_start", base(cu_seqlens=torch.tensor([1, 10, 50, 90])), ValueError, r"cu_seqlens must start at 0"),
    ("cu_decreasing", base(cu_seqlens=torch.tensor([0, 50, 10, 90])), ValueError, r"non-decreasing"),
    ("cu_past_T", base(cu_seqlens=torch.tensor([0, 10, 50, 101])), ValueError, r"exceeds the token count T = 100"),
    ("cu_batch", base(**{n: torch.cat([base()[n]] * 2) for n in ("q", "k", "v", "g", "beta")}),
     ValueError, r"batch size B must be 1"),
    ("cpu_copy_alone", dense(cu_seqlens_cpu=torch.tensor([0, 100])), ValueError, r"cu_seqlens_cpu was given without"),
    ("cpu_copy_device", base(cu_seqlens_cpu=torch.tensor([0, 10, 50, 90], device=META)), ValueError,
     r"cu_seqlens_cpu must be on the CPU"),
    ("cpu_copy_length", base(cu_seqlens_cpu=torch.tensor([0, 10, 90])), ValueError,
     r"cu_seqlens_cpu must have cu_seqlens's length 4"),
    ("cpu_copy_values", base(cu_seqlens_cpu=torch.tensor([0, 10, 60, 90])), ValueError, r"same values"),
    ("cpu_copy_dtype", base(cu_seqlens_cpu=torch.tensor([0.0, 10, 50, 90])), TypeError,
     r"cu_seqlens_cpu must be int32 or int64"),
    ("state_N", base(initial_state=torch.randn(2, HV, K, V)), ValueError,
     r"initial_state must be \[N, Hv, K, V\] = \(3, 4, 8, 6\)"),
    ("state_layout", base(initial_state=torch.randn(3, HV, K, V), state_v_first=True), ValueError,
     r"initial_state must be \[N, Hv, V, K\] \(state_v_first=True\) = \(3, 4, 6, 8\)"),
    ("state_dtype", base(initial_state=torch.zeros(3, HV, K, V, dtype=torch.int64)), TypeError,
     r"initial_state must be a floating dtype"),
    ("state_not_tensor", base(initial_state=0.0), TypeError, r"initial_state must be a torch\.Tensor"),
    ("scale_zero", base(scale=0.0), ValueError, r"scale must be finite and > 0"),
    ("scale_negative", base(scale=-1), ValueError, r"scale must be finite and > 0"),
    ("scale_inf", base(scale=math.inf), ValueError, r"scale must be finite"),
    ("scale_nan", base(scale=math.nan), ValueError, r"scale must be finite"),
    ("scale_type", base(scale="0.1"), TypeError, r"scale must be a real number"),
    ("scale_tensor", base(scale=torch.tensor(0.1)), TypeError, r"scale must be a real number"),
    ("backend_unknown", base(backend="triton"), ValueError, r"backend must be one of .*'reference'.*got 'triton'"),
    ("backend_type", base(backend=None), TypeError, r"backend must be a str"),
    ("flag_final", base(output_final_state=1), TypeError, r"output_final_state must be a bool"),
    ("flag_l2", base(use_qk_l2norm_in_kernel="yes"), TypeError, r"use_qk_l2norm_in_kernel must be a bool"),
    ("flag_layout", base(state_v_first=None), TypeError, r"state_v_first must be a bool"),
]


@pytest.mark.parametrize("kw,exc,pattern", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        chunk_gated_delta_rule(**kw)


def test_valid_inputs_describe_the_problem():
    p = validate(**base(cu_seqlens=torch.tensor([0, 10, 50, 90], dtype=torch.int32)))
    assert (p.B, p.T, p.Hqk, p.Hv, p.K, p.V, p.N, p.group) == (B, T, HQK, HV, K, V, 3, 2)
    assert p.scale == K ** -0.5 and p.varlen
    assert p.cu_seqlens_cpu.tolist() == [0, 10, 50, 90]  # read once, kept for the backends
    assert p.state_shape == (3, HV, K, V)
    d = validate(**dense(scale=2))
    assert d.N == B and not d.varlen and d.cu_seqlens_cpu is None and d.scale == 2.0


def test_device_offsets_are_not_read_when_a_host_copy_is_given():
    """A device cu_seqlens is never read when cu_seqlens_cpu is there (reading would sync the host); the host
    copy's values are the ones checked. Meta tensors have no values: any read would raise."""
    kw = {n: x.to(META) if isinstance(x, torch.Tensor) else x for n, x in base().items()}
    host = torch.tensor([0, 10, 50, 90])
    p = validate(**kw, cu_seqlens_cpu=host)
    assert p.cu_seqlens_cpu is host and p.cu_seqlens.device.type == "meta"
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu\[-1\] = 120 exceeds the token count"):
        validate(**kw, cu_seqlens_cpu=torch.tensor([0, 10, 50, 120]))


def test_non_contiguous_inputs_are_accepted():
    kw = base()
    q = torch.randn(B, T, K, HQK).transpose(2, 3)
    h0 = torch.randn(3, HV, V, K).transpose(2, 3)
    assert not q.is_contiguous() and not h0.is_contiguous()
    p = validate(**{**kw, "q": q, "initial_state": h0})
    assert p.q.is_contiguous() and p.initial_state.is_contiguous()
    o1, h1 = chunk_gated_delta_rule(**{**kw, "q": q, "initial_state": h0}, output_final_state=True)
    o2, h2 = chunk_gated_delta_rule(**{**kw, "q": q.contiguous(), "initial_state": h0.contiguous()},
                                    output_final_state=True)
    assert_same_computation(o1, o2)
    assert_same_computation(h1, h2)


def test_sequences_of_length_zero_and_mixed_side_dtypes_are_valid():
    kw = base(cu_seqlens=torch.tensor([0, 0, 90, 90]), g=-torch.rand(B, T, HV, dtype=torch.float64),
              beta=torch.rand(B, T, HV).bfloat16())
    o, h = chunk_gated_delta_rule(**kw, output_final_state=True)
    assert o.dtype == torch.float32 and h.shape == (3, HV, K, V)
