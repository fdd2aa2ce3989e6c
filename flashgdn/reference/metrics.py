"""How close is close enough: the error metric and the accuracy bars of DESIGN.md §3."""
from __future__ import annotations

import torch

# Bars on rel_rms against a float64 oracle computed from the same inputs, for bf16/fp16 q, k, v with fp32
# g, beta and state. Keys: the outputs (o, final_state) and the inputs whose gradients are checked.
BARS_16BIT = dict(o=5e-3, final_state=5e-3, q=8e-3, k=8e-3, v=8e-3, initial_state=8e-3, g=2e-2, beta=2e-2)


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``rms(x - ref) / rms(ref)`` in float64 on the CPU; ``rms(x)`` when ref is all zero."""
    x, ref = x.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    den = float(ref.pow(2).mean().sqrt())
    num = float((x - ref).pow(2).mean().sqrt())
    return num / den if den > 0 else num
