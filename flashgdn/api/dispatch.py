"""Which backend runs a problem.

``"reference"`` (PyTorch, any device) is always registered. ``"hopper"`` registers itself when
``flashgdn.kernels.hopper.backend`` imports (it needs TileLang); its absence is not an error until someone asks
for it by name. ``"auto"`` takes the Hopper kernels when they are registered and available, the tensors are on a
CUDA device of compute capability 9.0 and the backend's ``check`` accepts the problem; otherwise the reference,
with one warning per process when CUDA tensors end up on the reference.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Optional

import torch

from .backend import Backend, backend_names, get_backend
from .problem import GDNProblem

HOPPER = "hopper"
REFERENCE = "reference"
KNOWN_BACKENDS = ("auto", REFERENCE, HOPPER)

_optional_loaded = False
_hopper_import_error: Optional[str] = None
_warned_cuda_fallback = False


def load_backends() -> None:
    """Register the built-in backends once: the reference always, the Hopper kernels if they import."""
    global _optional_loaded, _hopper_import_error
    if _optional_loaded:
        return
    importlib.import_module("flashgdn.reference.backend")
    try:
        importlib.import_module("flashgdn.kernels.hopper.backend")
    except ImportError as e:  # not written yet, or TileLang missing: the reference still runs
        _hopper_import_error = f"{type(e).__name__}: {e}"
    _optional_loaded = True


def known_backends() -> tuple:
    load_backends()
    return tuple(dict.fromkeys(KNOWN_BACKENDS + tuple(backend_names())))


def _is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _hopper_refusal(p: GDNProblem) -> Optional[str]:
    """Why the Hopper backend cannot run ``p``, or None when it can."""
    if HOPPER not in backend_names():
        why = _hopper_import_error or "flashgdn.kernels.hopper.backend did not register it"
        return f"the Hopper backend is not installed ({why})"
    if p.device.type != "cuda":
        return f"the Hopper backend needs CUDA tensors, these are on {p.device}"
    ok, reason = get_backend(HOPPER).available()
    if not ok:
        return f"the Hopper backend is unavailable: {reason}"
    if not _is_sm90(p.device):
        cap = torch.cuda.get_device_capability(p.device)
        return f"the Hopper backend needs a compute capability 9.0 GPU (H100/H200), {p.device} is {cap[0]}.{cap[1]}"
    return None


def _warn_cuda_fallback(reason: str) -> None:
    global _warned_cuda_fallback
    if not _warned_cuda_fallback:
        _warned_cuda_fallback = True
        warnings.warn(
            f"flashgdn: CUDA inputs run on the PyTorch reference backend (slow) because {reason}",
            RuntimeWarning,
            stacklevel=3,
        )


def select_backend(p: GDNProblem, name: str = "auto") -> Backend:
    """The backend that will run ``p`` for ``backend=name``; raises when a named backend cannot run it."""
    load_backends()
    if name == "auto":
        reason = _hopper_refusal(p)
        if reason is None:
            hopper = get_backend(HOPPER)
            try:
                hopper.check(p)
                return hopper
            except NotImplementedError as e:
                reason = f"the Hopper backend does not support this problem: {e}"
        if p.device.type == "cuda":
            _warn_cuda_fallback(reason)
        return get_backend(REFERENCE)
    if name == HOPPER:
        reason = _hopper_refusal(p)
        if reason is not None:
            raise RuntimeError(f"backend='hopper' cannot run: {reason}. backend='reference' runs anywhere.")
    if name not in backend_names():
        raise ValueError(f"backend must be one of {known_backends()}, got {name!r}")
    chosen = get_backend(name)
    chosen.check(p)
    return chosen
