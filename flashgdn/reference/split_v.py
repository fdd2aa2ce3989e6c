"""The backward's per-chunk gradients with V split over the CTAs of a cluster, written out: the PyTorch counterpart of
the plan in docs/hopper-notes.md, "The split of V over a cluster of two, counted" (no kernel yet).

CTA r of ``parts`` owns V's columns ``Vr`` (its share of S, dS', V, dO and of every tile made from them) and, for the
outputs that are K wide (dq, dk), K's columns ``Kr``. Per chunk it makes from its own columns:

    KS_r = K S_r     W_r = V_r - diag(gamma) KS_r     Vn_r = Ag W_r     K dS'_r
    dVn_r = P^T dO_r + diag(d) K dS'_r     dW_r = Ag^T dVn_r = dV_r                       (V-local: no exchange)
    dS_r = M^T dS'_r + E^T dO_r                                                        (the walk: V-local too)

and partial sums over its V columns of what sums over V:

    dAg = dVn W^T,  dP = dO Vn^T                       [C, C]   every CTA needs the sum
    dO S^T,  -diag(gamma) dW S^T + diag(d) Vn dS'^T    [C, K]   CTA p needs the sum of columns Kp
    <dW_i, KS_i>, <(K dS')_i, Vn_i>, <dS', S>          rows     the CTA that makes dg (rank 0) needs the sums

What crosses is ``exchange``'s list. Every sum is taken in rank order, so that a kernel doing the same is
deterministic. The rest runs on the sums. dQK, dA, dL and dKK are made by every CTA (each needs them for its K
columns). dbeta and dg are made by rank 0. That needs one more partial from each CTA: scale <q_i, (dO S^T)_i> over
its K columns, a row dot with q that can only be taken after dq's state term is summed.

``tests/test_split_v.py`` checks the result against ``chunked_backward.chunk_gradient_tiles`` (float64) and the
exchange's sizes.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .chunked import _lower
from .chunked_backward import chunk_terms, gate_gradient, inverse_gradients


def _in_order(parts: List[torch.Tensor]) -> torch.Tensor:
    """The sum of the CTAs' partials in rank order (what a deterministic kernel adds)."""
    total = parts[0]
    for x in parts[1:]:
        total = total + x
    return total


def split_v_chunk_gradients(qc, kc, vc, bc, gc, A, Ag, h, dS_end, doc, scale: float,
                            parts: int = 2) -> Tuple[Tuple[torch.Tensor, ...], Dict[str, int]]:
    """``chunk_gradient_tiles``' gradients (chunk layout, dq and dk per value head) made as ``parts`` CTAs would make
    them, and the bytes one CTA sends the others in float32 a chunk and value head, by what it sends
    (``{"dAg": ..., "dP": ..., "dq": ..., "dk": ..., "dg rows": ...}``; "dg rows" is what each CTA but rank 0
    sends)."""
    C, K = kc.shape[-2], kc.shape[-1]
    V = vc.shape[-1]
    if V % parts or K % parts:
        raise ValueError(f"parts={parts} must divide K={K} and V={V}")
    dev = qc.device
    Vs = [slice(r * V // parts, (r + 1) * V // parts) for r in range(parts)]
    Ks = [slice(r * K // parts, (r + 1) * K // parts) for r in range(parts)]

    # made by every CTA from the tiles they all load (Q, K, g~, beta, A, Ag)
    qv, kv, Gam, qkt, P, gam, dec = chunk_terms(qc, kc, gc, vc.shape[1], scale)
    lower = _lower(C, dev)

    # each CTA on its V columns
    local = []
    for Vr in Vs:
        h_r, dS_r, do_r = h[..., Vr], dS_end[..., Vr], doc[..., Vr]
        KS = kv @ h_r
        W = vc[..., Vr] - gam[..., None] * KS
        Vn = Ag @ W
        KdS = kv @ dS_r
        dVn = P.transpose(-1, -2) @ do_r + dec[..., None] * KdS
        dW = Ag.transpose(-1, -2) @ dVn
        local.append(dict(
            dv=dW,
            dAg=dVn @ W.transpose(-1, -2), dP=do_r @ Vn.transpose(-1, -2),
            dqS=do_r @ h_r.transpose(-1, -2),
            dkS=-gam[..., None] * (dW @ h_r.transpose(-1, -2)) + dec[..., None] * (Vn @ dS_r.transpose(-1, -2)),
            dWKS=(dW * KS).sum(-1), ddec=(KdS * Vn).sum(-1), dgam_C=(dS_r * h_r).sum((-1, -2))))

    # the exchange: dAg and dP to everyone, dq's and dk's state terms by K columns, dg's rows to rank 0
    dAg = _in_order([x["dAg"] for x in local]) * lower
    dP = _in_order([x["dP"] for x in local]) * lower
    dqS = [_in_order([x["dqS"][..., Kp] for x in local]) for Kp in Ks]
    dkS = [_in_order([x["dkS"][..., Kp] for x in local]) for Kp in Ks]

    # every CTA: the gate side's products on the sums, then its K columns of dq and dk
    dQK = scale * Gam * dP
    dKK, dbeta = inverse_gradients(dAg, Gam, A, bc, kv @ kv.transpose(-1, -2))  # dbeta: rank 0's
    dq = torch.cat([dQK @ kv[..., Kp] + scale * gam[..., None] * dqS[p] for p, Kp in enumerate(Ks)], -1)
    dk = torch.cat([dQK.transpose(-1, -2) @ qv[..., Kp] + dkS[p] + (dKK + dKK.transpose(-1, -2)) @ kv[..., Kp]
                    for p, Kp in enumerate(Ks)], -1)
    dv = torch.cat([x["dv"] for x in local], -1)

    # rank 0: dg, with every CTA's row partials (its q row dot over its own K columns among them)
    q_rows = [scale * (qv[..., Kp] * dqS[p]).sum(-1) for p, Kp in enumerate(Ks)]
    dgam = _in_order(q_rows) - _in_order([x["dWKS"] for x in local])
    dg = gate_gradient(gc, Gam, qkt, dP, dAg, A, bc, scale, dgam, _in_order([x["ddec"] for x in local]),
                       _in_order([x["dgam_C"] for x in local]))

    others = parts - 1
    sent = {"dAg": 4 * C * C * others, "dP": 4 * C * C * others, "dq": 4 * C * (K // parts) * others,
            "dk": 4 * C * (K // parts) * others, "dg rows": 4 * (3 * C + 1)}
    return (dq, dk, dv, dg, dbeta), sent
