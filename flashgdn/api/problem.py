"""The validated description of one ``chunk_gated_delta_rule`` call, handed to every backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class GDNProblem:
    """Inputs after validation, with the sizes every backend needs.

    Tensors keep the caller's layout conventions (token-major, FLA style):
    q, k ``[B, T, Hqk, K]``; v ``[B, T, Hv, V]``; g, beta ``[B, T, Hv]``;
    initial_state ``[N, Hv, K, V]`` (or ``[N, Hv, V, K]`` when ``state_v_first``).
    They are contiguous. ``cu_seqlens`` is ``None`` for dense input (then N == B),
    otherwise int32/int64 ``[N + 1]`` on the inputs' device, with B == 1.
    ``cu_seqlens_cpu`` is a host copy of it when the caller gave one (or when validation
    had to read the values anyway); backends use it to plan without a host sync.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float
    initial_state: Optional[torch.Tensor]
    output_final_state: bool
    cu_seqlens: Optional[torch.Tensor]
    cu_seqlens_cpu: Optional[torch.Tensor]
    use_qk_l2norm_in_kernel: bool
    state_v_first: bool
    # derived sizes
    B: int
    T: int
    Hqk: int
    Hv: int
    K: int
    V: int
    N: int
    #: context parallelism: "auto", "off" or a segment length in chunks (flashgdn.cp)
    cp: object = "auto"

    @property
    def group(self) -> int:
        """Value heads per qk head (GVA ratio)."""
        return self.Hv // self.Hqk

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def state_shape(self) -> tuple:
        if self.state_v_first:
            return (self.N, self.Hv, self.V, self.K)
        return (self.N, self.Hv, self.K, self.V)

    def requires_grad(self) -> bool:
        ts = [self.q, self.k, self.v, self.g, self.beta]
        if self.initial_state is not None:
            ts.append(self.initial_state)
        return torch.is_grad_enabled() and any(t.requires_grad for t in ts)
