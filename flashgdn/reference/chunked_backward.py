"""The backward of the chunked form, written out (no autograd): the PyTorch counterpart of the Hopper backward.

Per chunk, with S the state at its start and the forward of ``chunked.py``
(g~ the chunk-local cumsum, gamma_i = exp(g~_i), gamma_C = exp(g~_last), d_i = exp(g~_last - g~_i),
Gam_ij = exp(g~_i - g~_j) for i >= j):

    A  = (I + L)^{-1},  L = StrictLower(diag(beta) K K^T)        Ag = Gam ⊙ A ⊙ (1 beta^T)
    W  = V - diag(gamma) K S        Vn = Ag W        P = scale Gam ⊙ Q K^T (lower, diagonal included)
    O  = scale diag(gamma) Q S + P Vn
    S' = gamma_C S + K^T diag(d) Vn = M S + b

the gradients, given dO of the chunk and dS' (the state gradient at its end):

1. state gradients, one reverse walk per sequence (the only sequential part):
       dS = M^T dS' + E^T dO,    E = scale diag(gamma) Q - P Ag diag(gamma) K
   from dS' = d(final state) at the last chunk; dS at the first chunk's start is d(initial state);
2. per chunk, all chunks at once:
       dVn = P^T dO + diag(d) K dS'        dW = Ag^T dVn = dV        dAg = dVn W^T        dP = dO Vn^T
       dQ  = scale (Gam ⊙ dP) K + scale diag(gamma) dO S^T
       dK  = scale (Gam ⊙ dP)^T Q - diag(gamma) dW S^T + diag(d) Vn dS'^T + (dKK + dKK^T) K
       dA  = dAg ⊙ Gam ⊙ (1 beta^T)    dL = -A^T dA A^T (strictly lower)    dKK = diag(beta) dL
       dbeta_j = sum_i dAg_ij Gam_ij A_ij  +  sum_k dL_jk (K K^T)_jk
   and the gates through g~: d(gamma_i) = scale <dO_i, (Q S)_i> - <dW_i, (K S)_i>, d(d_i) = <(K dS')_i, Vn_i>,
   d(gamma_C) = <dS', S>, dGam = scale (Q K^T) ⊙ dP + dAg ⊙ A ⊙ (1 beta^T); then
       dg~_i = gamma_i d(gamma_i) - d_i d(d_i) + sum_j (Gam ⊙ dGam)_ij - sum_j (Gam ⊙ dGam)_ji  (+ the g~_last terms)
       dg = reverse cumsum of dg~ within the chunk.

q and k gradients are summed over the value heads of each qk head (GVA). ``tests/test_reference_backward.py``
checks every gradient against torch autograd through ``chunked.py`` (float64).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .chunked import (
    _chunk_states_chunks,
    _chunks,
    _decay_matrix,
    _dtype,
    _gated_inverse_chunks,
    _initial_state_kv,
    _inverse_chunks,
    _lower,
    _new_values_chunks,
    _per_value_head,
    _state_pass_chunks,
    _tokens,
)
from .layout import ChunkTable, chunk_table


def _sum_groups(x: torch.Tensor, Hqk: int) -> torch.Tensor:
    """Sum a value-head tensor ``[NC, Hv, ...]`` over the value heads of each qk head."""
    NC, Hv = x.shape[:2]
    return x.reshape(NC, Hqk, Hv // Hqk, *x.shape[2:]).sum(2)


def _state_grads_walk(M: torch.Tensor, D: torch.Tensor, dht: torch.Tensor, table: ChunkTable):
    """Reverse walk ``dS_c = M_c^T dS_{c+1} + D_c`` through every sequence's chunks.

    Returns ``(dS_end [NC, ...], dh0 [N, ...])``: the state gradient at the end of every chunk, and at the start of
    every sequence. Sequences sorted by chunk count, longest first, so those running at step j are a prefix."""
    N, NC = table.N, table.NC
    dev = M.device
    counts = table.seq_num_chunks
    order = torch.argsort(counts, descending=True, stable=True)
    first = table.seq_first_chunk[order].to(dev)
    steps = int(counts.max()) if N else 0
    running = [(counts > j).sum().item() for j in range(steps)]
    dS = dht.index_select(0, order.to(dev)).clone()
    dS_end = D.new_zeros((NC,) + tuple(D.shape[1:]))
    for j in reversed(range(steps)):
        n = running[j]
        ids = first[:n] + j
        dS_end[ids] = dS[:n]
        dS[:n] = M.index_select(0, ids).transpose(-1, -2) @ dS[:n] + D.index_select(0, ids)
    dh0 = dS.index_select(0, torch.argsort(order).to(dev))
    return dS_end, dh0


def _state_gradients(qv, kv, gam, P, Ag, M, doc, dht_kv, table: ChunkTable, scale: float):
    """Step 1: ``dS = M^T dS' + E^T dO`` with ``E = scale diag(gamma) Q - P Ag diag(gamma) K``."""
    E = scale * gam[..., None] * qv - P @ (Ag @ (gam[..., None] * kv))
    return _state_grads_walk(M, E.transpose(-1, -2) @ doc, dht_kv, table)


def _chunk_gradients(qc, kc, vc, bc, gc, A, Ag, h, dS_end, doc, table: ChunkTable, scale: float, Hqk: int):
    """Step 2, every chunk at once, from the chunk tensors (head-first, ``[NC, H, C, ...]``), the start states
    ``h`` and the state gradients at the chunks' ends ``dS_end`` (``[NC, Hv, K, V]``): token-major
    ``(dq, dk, dv, dg, dbeta)``, q and k gradients summed over each qk head's value heads."""
    dq, dk, dW, dg, dbeta = chunk_gradient_tiles(qc, kc, vc, bc, gc, A, Ag, h, dS_end, doc, scale)
    return (_tokens(_sum_groups(dq, Hqk), table), _tokens(_sum_groups(dk, Hqk), table), _tokens(dW, table),
            _tokens(dg, table), _tokens(dbeta, table))


class ChunkTerms(NamedTuple):
    """What every chunk's gradients make first from q, k and g~ alone (per value head): q and k, Gam, Q K^T, P,
    gamma_i = exp(g~_i) and d_i = exp(g~_last - g~_i)."""

    qv: torch.Tensor
    kv: torch.Tensor
    Gam: torch.Tensor
    qkt: torch.Tensor
    P: torch.Tensor
    gam: torch.Tensor
    dec: torch.Tensor


def _gate_factors(gc):
    # gamma_i and d_i of every chunk
    return gc.exp(), (gc[..., -1:] - gc).exp()


def chunk_terms(qc, kc, gc, Hv: int, scale: float) -> ChunkTerms:
    """``ChunkTerms`` of the chunk tensors (head-first), for ``Hv`` value heads."""
    qv, kv = _per_value_head(qc, Hv), _per_value_head(kc, Hv)
    Gam = _decay_matrix(gc)
    qkt = qv @ kv.transpose(-1, -2)
    return ChunkTerms(qv, kv, Gam, qkt, scale * Gam * qkt, *_gate_factors(gc))


def chunk_gradient_tiles(qc, kc, vc, bc, gc, A, Ag, h, dS_end, doc, scale: float):
    """Step 2's gradients of every chunk and value head, in the chunk layout (``[NC, Hv, C, ...]``): ``(dq, dk, dv,
    dg, dbeta)``, dq and dk per value head (before the group sums), dg after its reverse cumsum in the chunk."""
    C = qc.shape[-2]
    dev = qc.device
    qv, kv, Gam, qkt, P, gam, dec = chunk_terms(qc, kc, gc, vc.shape[1], scale)
    KS = kv @ h
    W = vc - gam[..., None] * KS
    Vn = Ag @ W

    dVn = P.transpose(-1, -2) @ doc + dec[..., None] * (kv @ dS_end)
    dW = Ag.transpose(-1, -2) @ dVn
    dAg = (dVn @ W.transpose(-1, -2)) * _lower(C, dev)
    dP = (doc @ Vn.transpose(-1, -2)) * _lower(C, dev)
    dQK = scale * Gam * dP
    dq = dQK @ kv + scale * gam[..., None] * (doc @ h.transpose(-1, -2))
    dk = (dQK.transpose(-1, -2) @ qv - gam[..., None] * (dW @ h.transpose(-1, -2))
          + dec[..., None] * (Vn @ dS_end.transpose(-1, -2)))
    dKK, dbeta = inverse_gradients(dAg, Gam, A, bc, kv @ kv.transpose(-1, -2))
    dk = dk + (dKK + dKK.transpose(-1, -2)) @ kv

    # gates
    dgam = scale * (doc * (qv @ h)).sum(-1) - (dW * KS).sum(-1)
    ddec = ((kv @ dS_end) * Vn).sum(-1)
    dgam_C = (dS_end * h).sum((-1, -2))
    dg = gate_gradient(gc, Gam, qkt, dP, dAg, A, bc, scale, dgam, ddec, dgam_C)
    return dq, dk, dW, dg, dbeta


def inverse_gradients(dAg, Gam, A, bc, kkt):
    """What dAg gives through Ag = Gam ⊙ A ⊙ (1 beta^T) and A = (I + L)^{-1}: ``(dKK, dbeta)``, with
    dA = dAg ⊙ Gam ⊙ (1 beta^T), dL = -A^T dA A^T (strictly lower), dKK = diag(beta) dL, and
    dbeta_j = sum_i dAg_ij Gam_ij A_ij + sum_k dL_jk (K K^T)_jk (``kkt`` is K K^T)."""
    dA = dAg * Gam * bc[..., None, :]
    dL = -(A.transpose(-1, -2) @ dA @ A.transpose(-1, -2)) * _lower(A.shape[-1], A.device, -1)
    dbeta = (dAg * Gam * A).sum(-2) + (dL * kkt).sum(-1)
    return bc[..., :, None] * dL, dbeta


def gate_gradient(gc, Gam, qkt, dP, dAg, A, bc, scale: float, dgam, ddec, dgam_C):
    """dg of the chunk (after its reverse cumsum) from g~ (``gc``) and the gradients of what it enters: gamma_i
    (``dgam``), d_i (``ddec``), gamma_C (``dgam_C``), and Gam through P and Ag (from ``dP`` and ``dAg``)."""
    gam, dec = _gate_factors(gc)
    g_last = gc[..., -1]
    dGam = (scale * qkt * dP + dAg * A * bc[..., None, :]) * Gam
    dgc = gam * dgam - dec * ddec + dGam.sum(-1) - dGam.sum(-2)
    dgc[..., -1] += g_last.exp() * dgam_C + (dec * ddec).sum(-1)
    return dgc.flip(-1).cumsum(-1).flip(-1)


def chunk_state_gradients_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    compute_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step 1 alone, the counterpart of the Hopper kernel ``state_grad_walk``: ``(dS_end, dS_start)``, the state
    gradient at the end of every chunk ``[NC, Hv, K, V]`` (the chunk order of ``layout.chunk_table``: sequences
    in order, each one's chunks in order) and at the start of every sequence ``[N, Hv, K, V]`` (K-major; what
    ``dh0`` is when there is an initial state). Neither v nor the initial state enters it. ``dht`` is K-major."""
    dt = _dtype(compute_dtype, q, k, do)
    B, T, Hqk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    if scale is None:
        scale = K ** -0.5
    table = chunk_table(cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens, B, T)
    qc, kc, bc = (_chunks(x.to(dt), table, dt) for x in (q, k, beta))
    gc = _chunks(g, table, dt).cumsum(-1)
    doc = _chunks(do.to(dt), table, dt)
    A = _inverse_chunks(kc, bc)
    Ag = _gated_inverse_chunks(A, gc, bc)
    _, M, _ = _state_pass_chunks(kc, torch.zeros_like(doc), gc, A, bc)
    t = chunk_terms(qc, kc, gc, Hv, scale)
    dht_kv = (torch.zeros((table.N, Hv, K, V), dtype=dt, device=q.device) if dht is None else dht.to(dt))
    return _state_gradients(t.qv, t.kv, t.gam, t.P, Ag, M, doc, dht_kv, table, scale)


def chunk_gated_delta_rule_backward_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    state_v_first: bool = False,
    compute_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Gradients ``(dq, dk, dv, dg, dbeta, dh0)`` of ``chunk_gated_delta_rule_reference`` for output gradient
    ``do`` and final-state gradient ``dht`` (None: 0), in the compute dtype (float64 for float64 inputs, else
    float32). ``dh0`` is None without an initial state; its layout follows ``state_v_first``. No L2 norm: q and k
    are the normalised ones when the forward normalised them (its backward is the caller's)."""
    dt = _dtype(compute_dtype, q, k, v)
    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K ** -0.5
    table = chunk_table(cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens, B, T)
    dev = q.device

    # forward quantities, chunk-major head-first
    qc, kc, vc, bc = (_chunks(x.to(dt), table, dt) for x in (q, k, v, beta))
    gc = _chunks(g, table, dt).cumsum(-1)
    A = _inverse_chunks(kc, bc)
    Ag = _gated_inverse_chunks(A, gc, bc)
    _, M, b = _state_pass_chunks(kc, vc, gc, A, bc)
    h0 = _initial_state_kv(initial_state, table.N, Hv, K, V, state_v_first, dt, dev)
    h, _ = _chunk_states_chunks(M, b, h0, table)
    t = chunk_terms(qc, kc, gc, Hv, scale)
    doc = _chunks(do.to(dt), table, dt)
    dht_kv = (torch.zeros_like(h0) if dht is None
              else (dht.to(dt).transpose(-1, -2) if state_v_first else dht.to(dt)))

    # 1. state gradients: dS = M^T dS' + E^T dO
    dS_end, dh0 = _state_gradients(t.qv, t.kv, t.gam, t.P, Ag, M, doc, dht_kv, table, scale)
    # 2. per chunk
    dq_t, dk_t, dv_t, dg_t, dbeta_t = _chunk_gradients(qc, kc, vc, bc, gc, A, Ag, h, dS_end, doc, table, scale, Hqk)
    dh0_out = None
    if initial_state is not None:
        dh0_out = dh0.transpose(-1, -2) if state_v_first else dh0
    return dq_t, dk_t, dv_t, dg_t, dbeta_t, dh0_out


class ReferenceBackwardStages:
    """The chunked backward as the three stages of ``flashgdn.cp.backward.BackwardStages`` (packed sequences,
    K-major states; chunk-major ``[NC, Hv, K, V]`` states and state gradients between them), in
    ``compute_dtype`` (default: float64 for float64 inputs, else float32): what ``cp_backward`` runs in PyTorch,
    and the counterpart of ``flashgdn.kernels.hopper.backward.HopperBackwardStages``."""

    def __init__(self, compute_dtype: Optional[torch.dtype] = None):
        self.compute_dtype = compute_dtype

    def _chunked(self, q, k, v, g, beta, cu, cu_cpu):
        dt = _dtype(self.compute_dtype, q, k, v)
        table = chunk_table(cu_cpu if cu_cpu is not None else cu, *q.shape[:2])
        qc, kc, vc, bc = (_chunks(x.to(dt), table, dt) for x in (q, k, v, beta))
        gc = _chunks(g, table, dt).cumsum(-1)
        return dt, table, qc, kc, vc, bc, gc, _inverse_chunks(kc, bc)

    def chunk_states(self, q, k, v, g, beta, h0, cu, cu_cpu):
        dt, table, _, kc, vc, bc, gc, A = self._chunked(q, k, v, g, beta, cu, cu_cpu)
        _, M, b = _state_pass_chunks(kc, vc, gc, A, bc)
        h0 = _initial_state_kv(h0, table.N, v.shape[2], k.shape[3], v.shape[3], False, dt, q.device)
        return _chunk_states_chunks(M, b, h0, table)[0]

    def state_gradients(self, q, k, g, beta, do, dht, scale, cu, cu_cpu):
        return chunk_state_gradients_reference(q, k, g, beta, do, dht, scale=scale, cu_seqlens=cu,
                                               cu_seqlens_cpu=cu_cpu, compute_dtype=self.compute_dtype)

    def chunk_gradients(self, q, k, v, g, beta, do, states, ds_end, scale, cu, cu_cpu):
        dt, table, qc, kc, vc, bc, gc, A = self._chunked(q, k, v, g, beta, cu, cu_cpu)
        Ag = _gated_inverse_chunks(A, gc, bc)
        doc = _chunks(do.to(dt), table, dt)
        return _chunk_gradients(qc, kc, vc, bc, gc, A, Ag, states, ds_end, doc, table, scale, q.shape[2])

    def finish_gradients(self, grads):  # already final
        return grads
