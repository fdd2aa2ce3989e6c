"""Host side of the Hopper backward (in progress): the stages that exist, run in order.

Pipeline, mirroring the forward (``forward.py``) and following ``reference/chunked_backward.py``:
  0. ``chunk_plan`` and 1'. ``kkt_inverse``, the forward's stage 0 and 1 again: slots, g~ and Ag
  1a. the forward states  the rs loop's state-only variant storing S at every chunk's start (recomputed, so
                          autograd saves no states)
  1b. ``state_grad_walk``  per (sequence, value head), chunks last to first: the state gradient at the end of
                          every chunk and at every sequence's start (d initial state)
  1c. ``kkt_inverse`` with ``store_inverse``: the ungated A as well (``hopper_inverse``), for dL = -A^T dA A^T
  2a. ``chunk_grad_dv``   per (chunk, value head): dv from the state gradient at the chunk's end
  2b. the other per-chunk gradients (dq, dk, dg, dbeta): not written yet; until they are, the backend's backward
      is the PyTorch chunked backward.

Like the forward, everything here is device-side work with shapes known on the host: no synchronisation.
"""
from typing import Optional, Tuple

import torch

from .common import tl_dtype
from .forward import _output, hopper_stage1, packed_offsets


def _plan_and_stage1(q, k, g, beta, cu_seqlens):
    """The forward's stages 0 and 1 (``forward.hopper_stage1``) on packed views:
    ``((q, k) packed, cu, N, Stage1)``."""
    B, T, Hqk, K = q.shape
    Hv = g.shape[2]
    cu, N = packed_offsets(cu_seqlens, B, T, q.device)
    TT = B * T
    qf, kf = q.reshape(1, TT, Hqk, K), k.reshape(1, TT, Hqk, K)
    return (qf, kf), cu, N, hopper_stage1(kf, g.reshape(1, TT, Hv), beta.reshape(1, TT, Hv), cu)


def hopper_chunk_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The forward's state at the start of every chunk slot, recomputed by the rs loop's state-only variant with
    ``store_chunk_states``: ``(states [S, Hv, V, K] float32 V-major, bounds)``; ``initial_state`` K-major
    ``[N, Hv, K, V]`` or None (zero). Idle slots are not written."""
    from .chunk_forward_rs import build_chunk_forward_rs

    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    (qf, kf), cu, N, st1 = _plan_and_stage1(q, k, g, beta, cu_seqlens)
    S = st1.bounds.shape[0]
    dev = q.device
    has_h0 = initial_state is not None
    h0 = initial_state.to(torch.float32).contiguous() if has_h0 else torch.empty((1, Hv, K, V), device=dev)
    states = _output((S, Hv, V, K), torch.float32, dev)
    o1 = torch.empty((1, 1, Hv, V), dtype=q.dtype, device=dev)  # not touched by a state-only pass
    kernel = build_chunk_forward_rs(Hqk, Hv, K, V, tl_dtype(q.dtype), has_h0, False, False, False, False, True)
    kernel(qf, kf, v.reshape(1, B * T, Hv, V), st1.gcum, st1.Ag, cu, st1.first_slot, h0, 1.0, o1, states)
    return states, st1.bounds


def hopper_state_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: Optional[torch.Tensor],
    scale: float,
    cu_seqlens: Optional[torch.Tensor],
    _stage1=None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state gradients by the walk kernel. q, k (normalised as the forward used them), do: contiguous
    bf16/fp16 ``[B, T, H, D]``; g, beta ``[B, T, Hv]``; dht ``[N, Hv, K, V]`` float32 K-major, or None.

    Returns ``(ds_end, dh0, bounds)``: ``ds_end [S, Hv, V, K]`` float32, the gradient at the end of every chunk
    slot, V-major (slot s holds chunk ``bounds[s]``; idle slots are not written); ``dh0 [N, Hv, K, V]`` float32,
    K-major, the gradient at every sequence's start; ``bounds`` the chunk plan (``forward.chunk_plan``)."""
    from .state_grad_walk import build_state_grad_walk

    B, T, Hqk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    dev = q.device
    (qf, kf), cu, N, st1 = _stage1 or _plan_and_stage1(q, k, g, beta, cu_seqlens)
    S = st1.bounds.shape[0]
    dof = do.reshape(1, B * T, Hv, V).contiguous()
    has_dht = dht is not None
    dht_in = dht.to(torch.float32).contiguous() if has_dht else torch.empty((1, Hv, K, V), device=dev)
    ds_end = _output((S, Hv, V, K), torch.float32, dev)
    dh0 = _output((N, Hv, K, V), torch.float32, dev)
    build_state_grad_walk(Hqk, Hv, K, V, tl_dtype(q.dtype), has_dht)(
        qf, kf, dof, st1.gcum, st1.Ag, cu, st1.first_slot, dht_in, float(scale), ds_end, dh0)
    return ds_end, dh0, st1.bounds


def hopper_grad_v(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: Optional[torch.Tensor],
    scale: float,
    cu_seqlens: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """dv and dh0 by stages 0, 1, 1b and 2a (``chunk_grad_dv``), arguments as ``hopper_state_gradients``:
    ``(dv [B, T, Hv, V] in q's dtype, dh0 [N, Hv, K, V] float32)``. Rows of a padded tail are zero."""
    from .chunk_grad_dv import build_chunk_grad_dv

    B, T, Hqk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    stage1 = _plan_and_stage1(q, k, g, beta, cu_seqlens)
    (qf, kf), _, _, st1 = stage1
    ds_end, dh0, _ = hopper_state_gradients(q, k, g, beta, do, dht, scale, cu_seqlens, _stage1=stage1)
    dv = torch.zeros((1, B * T, Hv, V), dtype=q.dtype, device=q.device)
    build_chunk_grad_dv(Hqk, Hv, K, V, tl_dtype(q.dtype))(qf, kf, do.reshape(1, B * T, Hv, V).contiguous(),
                                                           st1.gcum, st1.Ag, st1.bounds, ds_end, float(scale), dv)
    return dv.reshape(B, T, Hv, V), dh0


def hopper_inverse(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   cu_seqlens: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1 with the ungated inverse stored too (``kkt_inverse(..., store_inverse=True)``), for the per-chunk
    gradients: ``(A [S, Hv, 64, 64] float32, Ag [S, Hv, 64, 64] in k's dtype, bounds)``; k ``[B, T, Hqk, K]``
    normalised as the forward used it. Idle slots are not written."""
    B, T, Hqk, K = k.shape
    Hv = g.shape[2]
    cu, _ = packed_offsets(cu_seqlens, B, T, k.device)
    TT = B * T
    st1 = hopper_stage1(k.reshape(1, TT, Hqk, K), g.reshape(1, TT, Hv), beta.reshape(1, TT, Hv), cu,
                        store_inverse=True)
    return st1.A, st1.Ag, st1.bounds
