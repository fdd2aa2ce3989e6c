"""The PyTorch reference as a backend: runs on any device and dtype; its backward is torch autograd."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..api.backend import Backend, register_backend
from ..api.problem import GDNProblem
from .chunked import chunk_gated_delta_rule_reference
from .recurrent import l2norm_qk


class ReferenceBackend(Backend):
    name = "reference"

    def available(self) -> Tuple[bool, str]:
        return True, "PyTorch, any device"

    def __call__(self, p: GDNProblem) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        from ..cp import cp_problem_forward, plan_for_problem

        # cp="auto" stays off here (segments only pay on a GPU); a segment length runs exact CP (for tests)
        plan = plan_for_problem(p, auto=False)
        if plan is not None:
            q, k = l2norm_qk(p.q, p.k) if p.use_qk_l2norm_in_kernel else (p.q, p.k)
            o, final = cp_problem_forward(_reference_forward, p, plan, q, k)
            return o.to(p.dtype), final
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


def _reference_forward(q, k, v, g, beta, scale, h0, cu, output_final_state, cu_cpu, need_output=True):
    return chunk_gated_delta_rule_reference(q, k, v, g, beta, scale=scale, initial_state=h0,
                                            output_final_state=output_final_state, cu_seqlens=cu,
                                            cu_seqlens_cpu=cu_cpu)


register_backend(ReferenceBackend.name, ReferenceBackend)
