"""The token recurrence of the gated delta rule: the oracle every other path is checked against.

One step per token, vectorised over sequences and value heads (DESIGN.md §1):

    S_t = exp(g_t) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T
    o_t = scale * S_t^T q_t

It is slow by design (a Python loop over tokens) and computes in float64 unless told otherwise.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .layout import chunk_table


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the in-kernel q/k normalisation)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2norm_qk(q: torch.Tensor, k: torch.Tensor):
    """``l2norm`` of q and k computed in float32 (float64 for float64 inputs), returned in their dtype: the
    normalisation a backend applies in front of kernels that take already-normalised q and k."""
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    return l2norm(q.to(cdt)).to(q.dtype), l2norm(k.to(cdt)).to(k.dtype)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_v_first: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated delta rule, one token at a time. Same conventions as ``flashgdn.chunk_gated_delta_rule``.

    Returns ``(o [B, T, Hv, V], final_state or None)`` in ``compute_dtype``; tokens after ``cu_seqlens[-1]``
    get ``o = 0``. Differentiable (mind the memory: autograd keeps one state per token).
    """
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    group = Hv // Hqk
    if scale is None:
        scale = K ** -0.5
    table = chunk_table(cu_seqlens, B, T)
    N, dev, dt = table.N, q.device, compute_dtype

    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)

    # step-major gather: row (t, n) is token t of sequence n, or an all-zero token past the sequence's end.
    # A zero token (g = 0, beta = 0, k = 0) leaves the state exactly as it was, so no masking is needed.
    steps = int(table.seq_len.max()) if N else 0
    t = torch.arange(steps, dtype=torch.int64)[:, None]
    flat = table.seq_batch * T + table.seq_start
    idx = torch.where(t < table.seq_len[None, :], flat[None, :] + t, torch.full_like(t, B * T)).reshape(-1)
    idx = idx.to(dev)

    def per_step(x):
        rows = x.reshape((B * T,) + tuple(x.shape[2:]))
        rows = torch.cat([rows, rows.new_zeros((1,) + tuple(rows.shape[1:]))], 0)
        return rows.index_select(0, idx).reshape((steps, N) + tuple(x.shape[2:]))

    qs, ks, vs, gs, bs = (per_step(x) for x in (q, k, v, g, beta))

    if initial_state is None:
        S = torch.zeros(N, Hv, K, V, dtype=dt, device=dev)
    else:
        S = initial_state.to(dt)
        if state_v_first:
            S = S.transpose(-1, -2)
    outs = []
    for s in range(steps):
        S = gs[s].exp()[..., None, None] * S
        u = bs[s][..., None] * (vs[s] - torch.einsum("nhkv,nhk->nhv", S, ks[s]))
        S = S + ks[s][..., :, None] * u[..., None, :]
        outs.append(scale * torch.einsum("nhkv,nhk->nhv", S, qs[s]))

    # back to token-major: token (t, n) lives in row t * N + n of the stacked outputs
    o_steps = torch.stack(outs, 0).reshape(steps * N, Hv, V) if steps else q.new_zeros(0, Hv, V)
    dest = torch.full((B * T,), steps * N, dtype=torch.int64)
    n_of = torch.repeat_interleave(torch.arange(N, dtype=torch.int64), table.seq_len)
    t_of = torch.arange(int(table.seq_len.sum()), dtype=torch.int64) - torch.repeat_interleave(
        torch.cumsum(table.seq_len, 0) - table.seq_len, table.seq_len
    )
    dest[flat[n_of] + t_of] = t_of * N + n_of
    o_steps = torch.cat([o_steps, o_steps.new_zeros(1, Hv, V)], 0)
    o = o_steps.index_select(0, dest.to(dev)).reshape(B, T, Hv, V)

    final = None
    if output_final_state:
        final = S.transpose(-1, -2) if state_v_first else S
    return o, final
