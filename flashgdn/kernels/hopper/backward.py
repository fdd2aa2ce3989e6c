"""Host side of the Hopper backward (in progress): the stages that exist, run in order.

Pipeline, mirroring the forward (``forward.py``) and following ``reference/chunked_backward.py``:
  0. ``chunk_plan`` and 1'. ``kkt_inverse``, the forward's stage 0 and 1 again: slots, g~ and Ag
  1. ``state_grad_walk``   per (sequence, value head), chunks last to first: the state gradient at the end of
                           every chunk and at every sequence's start (d initial state)
  2. per-chunk gradients (dq, dk, dv, dg, dbeta) from those: not written yet; until then the backend's backward
     is the PyTorch chunked backward.

Like the forward, everything here is device-side work with shapes known on the host: no synchronisation.
"""
from typing import Optional, Tuple

import torch

from .common import CHUNK, tl_dtype
from .forward import _output, chunk_plan


def hopper_state_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: Optional[torch.Tensor],
    scale: float,
    cu_seqlens: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state gradients by the walk kernel. q, k (normalised as the forward used them), do: contiguous
    bf16/fp16 ``[B, T, H, D]``; g, beta ``[B, T, Hv]``; dht ``[N, Hv, K, V]`` float32 K-major, or None.

    Returns ``(ds_end, dh0, bounds)``: ``ds_end [S, Hv, V, K]`` float32, the gradient at the end of every chunk
    slot, V-major (slot s holds chunk ``bounds[s]``; idle slots are not written); ``dh0 [N, Hv, K, V]`` float32,
    K-major, the gradient at every sequence's start; ``bounds`` the chunk plan (``forward.chunk_plan``)."""
    from .kkt_inverse import build_kkt_inverse
    from .state_grad_walk import build_state_grad_walk

    B, T, Hqk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    dev = q.device
    if cu_seqlens is None:
        N = B
        cu = torch.arange(0, (B + 1) * T, T, device=dev, dtype=torch.int32)
    else:
        N = cu_seqlens.shape[0] - 1
        cu = cu_seqlens.to(torch.int32)
    TT = B * T
    io = tl_dtype(q.dtype)
    qf, kf = q.reshape(1, TT, Hqk, K), k.reshape(1, TT, Hqk, K)
    dof = do.reshape(1, TT, Hv, V).contiguous()
    gf = g.reshape(1, TT, Hv).to(torch.float32).contiguous()
    bf = beta.reshape(1, TT, Hv).to(torch.float32).contiguous()

    bounds, first_slot = chunk_plan(cu, TT, N)
    S = bounds.shape[0]
    gcum = _output((Hv, S * CHUNK), torch.float32, dev)
    Ag = _output((S, Hv, CHUNK, CHUNK), q.dtype, dev)
    build_kkt_inverse(Hqk, Hv, K, io, io)(kf, gf, bf, bounds, gcum, Ag)

    has_dht = dht is not None
    dht_in = dht.to(torch.float32).contiguous() if has_dht else torch.empty((1, Hv, K, V), device=dev)
    ds_end = _output((S, Hv, V, K), torch.float32, dev)
    dh0 = _output((N, Hv, K, V), torch.float32, dev)
    build_state_grad_walk(Hqk, Hv, K, V, io, has_dht)(qf, kf, dof, gcum, Ag, cu, first_slot, dht_in, float(scale),
                                                      ds_end, dh0)
    return ds_end, dh0, bounds
