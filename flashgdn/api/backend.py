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
    and is differentiable with respect to q, k, v, g, beta and initial_state.
    """

    name: str = "?"

    def available(self) -> Tuple[bool, str]:
        raise NotImplementedError

    def check(self, p: GDNProblem) -> None:
        return None

    def __call__(self, p: GDNProblem) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError


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
