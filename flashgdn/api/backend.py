"""What a backend is, and the registry that ``backend=`` names."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from .problem import GDNProblem


class Backend:
    """A way to compute the operator.

    ``available()`` says whether it can run in this process at all (libraries, device), with the reason
    when not. ``check(p)`` raises ``NotImplementedError`` naming a backend that can run ``p`` when this one
    cannot (a head dim it lacks, a dtype, a device). ``__call__(p)`` returns ``(o, final_state or None)``
    and is differentiable with respect to q, k, v, g, beta and initial_state. ``backward(...)`` gives the
    gradients of that forward without autograd (what the ``torch.compile`` form of the op calls).
    """

    name: str = "?"

    def available(self) -> Tuple[bool, str]:
        raise NotImplementedError

    def check(self, p: GDNProblem) -> None:
        return None

    def __call__(self, p: GDNProblem) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError

    def backward(self, p: GDNProblem, q: torch.Tensor, k: torch.Tensor, do: torch.Tensor,
                 dht: Optional[torch.Tensor]) -> tuple:
        """``(dq, dk, dv, dg, dbeta, dh0 or None)`` of this backend's forward of ``p``, for output gradient ``do``
        and final-state gradient ``dht`` (None: 0); ``q``, ``k`` as the forward used them (normalised when it
        normalised; the L2 norm's backward is the caller's). Any floating dtype; the caller casts to the inputs'
        dtypes. The default is the written-out backward of the chunked form in PyTorch
        (``flashgdn.reference.chunked_backward``; float32, float64 for float64 inputs)."""
        from ..reference.chunked_backward import chunk_gated_delta_rule_backward_reference

        return chunk_gated_delta_rule_backward_reference(
            q, k, p.v, p.g, p.beta, do, dht, scale=p.scale, initial_state=p.initial_state,
            cu_seqlens=p.cu_seqlens, cu_seqlens_cpu=p.cu_seqlens_cpu, state_v_first=p.state_v_first)


_REGISTRY: Dict[str, Callable[[], Backend]] = {}
_INSTANCES: Dict[str, Backend] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    _REGISTRY[name] = factory


def backend_names() -> list:
    return list(_REGISTRY)


def get_backend(name: str) -> Backend:
    if name not in _INSTANCES:
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]
