"""The PyTorch reference as a backend: runs on any device and dtype; its backward is torch autograd."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..api.backend import Backend, register_backend
from ..api.problem import GDNProblem
from .chunked import chunk_gated_delta_rule_reference


class ReferenceBackend(Backend):
    name = "reference"

    def available(self) -> Tuple[bool, str]:
        return True, "PyTorch, any device"

    def __call__(self, p: GDNProblem) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        # computes in float32 (float64 for float64 inputs); the final state stays in that dtype
        o, final = chunk_gated_delta_rule_reference(
            p.q,
            p.k,
            p.v,
            p.g,
            p.beta,
            scale=p.scale,
            initial_state=p.initial_state,
            output_final_state=p.output_final_state,
            cu_seqlens=p.cu_seqlens,
            cu_seqlens_cpu=p.cu_seqlens_cpu,
            use_qk_l2norm_in_kernel=p.use_qk_l2norm_in_kernel,
            state_v_first=p.state_v_first,
        )
        return o.to(p.dtype), final


register_backend(ReferenceBackend.name, ReferenceBackend)
