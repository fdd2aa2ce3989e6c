"""Checks every argument of ``chunk_gated_delta_rule`` before anything is computed.

Errors name the argument and what was expected: ``TypeError`` for a wrong kind or dtype, ``ValueError`` for a
wrong shape, value or device. Non-contiguous tensors are accepted and made contiguous.
A CUDA ``cu_seqlens`` is only read (a host sync) when no ``cu_seqlens_cpu`` copy is given.
"""
from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional

import torch

from .problem import GDNProblem

IO_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _ndim(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")


def _flag(name: str, x) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return x


def _check_offsets(name: str, cu: torch.Tensor, T: int) -> None:
    """Values of a host copy of cu_seqlens: 0 first, non-decreasing, last <= T."""
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
    if int(cu[-1]) > T:
        raise ValueError(f"{name}[-1] = {int(cu[-1])} exceeds the token count T = {T}")


def _offsets_tensor(name: str, cu) -> torch.Tensor:
    _tensor(name, cu)
    if cu.dim() != 1:
        raise ValueError(f"{name} must be 1-D [N + 1], got shape {tuple(cu.shape)}")
    if cu.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {cu.dtype}")
    if cu.numel() < 2:
        raise ValueError(f"{name} must have at least 2 entries (N + 1 offsets, N >= 1), got {cu.numel()}")
    return cu


def validate(
    q,
    k,
    v,
    g,
    beta,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_v_first: bool = False,
    backend: str = "auto",
    known_backends: Iterable[str] = ("auto", "reference", "hopper"),
    check_values: bool = True,
    cp="auto",
) -> GDNProblem:
    """Validate the arguments of ``chunk_gated_delta_rule`` and return the problem they describe.

    ``check_values=False`` (the ``torch.compile`` path) skips everything that reads the values of
    ``cu_seqlens``; shapes, dtypes, devices and flags are still checked.
    """
    known = tuple(known_backends)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {known}, got {type(backend).__name__}")
    if backend not in known:
        raise ValueError(f"backend must be one of {known}, got {backend!r}")
    from ..cp.plan import parse_cp

    cp = parse_cp(cp)
    output_final_state = _flag("output_final_state", output_final_state)
    use_qk_l2norm_in_kernel = _flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    state_v_first = _flag("state_v_first", state_v_first)

    # shapes
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _tensor(name, x)
    _ndim("q", q, 4, "[B, T, Hqk, K]")
    _ndim("k", k, 4, "[B, T, Hqk, K]")
    _ndim("v", v, 4, "[B, T, Hv, V]")
    _ndim("g", g, 3, "[B, T, Hv]")
    _ndim("beta", beta, 3, "[B, T, Hv]")
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have q's shape [B, T, Hqk, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must be [B, T, Hv, V] with q's B, T = {B}, {T}, got shape {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, Hv):
            raise ValueError(f"{name} must be [B, T, Hv] = {(B, T, Hv)} (Hv from v), got {tuple(x.shape)}")
    if B < 1:
        raise ValueError(f"q must have a batch size B >= 1, got shape {tuple(q.shape)}")
    if Hqk < 1 or Hv < 1:
        raise ValueError(f"q and v need at least one head, got Hqk = {Hqk}, Hv = {Hv}")
    if K < 1 or V < 1:
        raise ValueError(f"head dims must be positive, got K = {K} (q, k) and V = {V} (v)")
    if Hv % Hqk != 0:
        raise ValueError(f"the value heads of v (Hv = {Hv}) must be a multiple of the q/k heads (Hqk = {Hqk})")

    # dtypes
    if q.dtype not in IO_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    for name, x in (("g", g), ("beta", beta)):
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating dtype, got {x.dtype}")

    # one device
    device = q.device
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                    ("cu_seqlens", cu_seqlens)):
        if x is not None and isinstance(x, torch.Tensor) and x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}: all inputs must be on one device")

    # sequences
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu was given without cu_seqlens: pass both (the host copy of cu_seqlens)")
        N = B
    else:
        _offsets_tensor("cu_seqlens", cu_seqlens)
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size B must be 1 (sequences packed along T), got B = {B}")
        N = cu_seqlens.numel() - 1
        if cu_seqlens_cpu is not None:
            _offsets_tensor("cu_seqlens_cpu", cu_seqlens_cpu)
            if cu_seqlens_cpu.device.type != "cpu":
                raise ValueError(f"cu_seqlens_cpu must be on the CPU, got {cu_seqlens_cpu.device}")
            if cu_seqlens_cpu.numel() != cu_seqlens.numel():
                raise ValueError(
                    f"cu_seqlens_cpu must have cu_seqlens's length {cu_seqlens.numel()}, got {cu_seqlens_cpu.numel()}"
                )
            if (check_values and cu_seqlens.device.type == "cpu"
                    and not torch.equal(cu_seqlens.long(), cu_seqlens_cpu.long())):
                raise ValueError("cu_seqlens_cpu must hold the same values as cu_seqlens")
        elif check_values:
            # the values must be known on the host: reading a CUDA tensor here is the one host sync
            cu_seqlens_cpu = cu_seqlens.detach().cpu()
        if check_values:
            _check_offsets("cu_seqlens_cpu" if cu_seqlens.device.type != "cpu" else "cu_seqlens", cu_seqlens_cpu, T)

    # state
    state_shape = (N, Hv, V, K) if state_v_first else (N, Hv, K, V)
    layout = "[N, Hv, V, K] (state_v_first=True)" if state_v_first else "[N, Hv, K, V]"
    if initial_state is not None:
        _tensor("initial_state", initial_state)
        if not initial_state.dtype.is_floating_point:
            raise TypeError(f"initial_state must be a floating dtype, got {initial_state.dtype}")
        if tuple(initial_state.shape) != state_shape:
            raise ValueError(f"initial_state must be {layout} = {state_shape}, got {tuple(initial_state.shape)}")

    # scale
    if scale is None:
        scale = K ** -0.5
    else:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
        scale = float(scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be finite and > 0, got {scale}")

    return GDNProblem(
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        g=g.contiguous(),
        beta=beta.contiguous(),
        scale=scale,
        initial_state=None if initial_state is None else initial_state.contiguous(),
        output_final_state=output_final_state,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.contiguous(),
        cu_seqlens_cpu=cu_seqlens_cpu,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        state_v_first=state_v_first,
        B=B,
        T=T,
        Hqk=Hqk,
        Hv=Hv,
        K=K,
        V=V,
        N=N,
        cp=cp,
    )
