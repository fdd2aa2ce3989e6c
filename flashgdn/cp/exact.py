"""Exact context parallelism around any forward: segment transitions, splice, forward from true start states.

``cp_forward(forward, ...)`` takes a forward with the operator's semantics on packed sequences
(``forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, cu_seqlens_cpu,
need_output=True) -> (o, final)``, state ``[N, Hv, K, V]``; with ``need_output=False`` it may skip o) and runs
it on the segments of a ``SegmentPlan`` (``plan.py``):

1. ``b``: the forward over the segments from a zero state, or from the sequence's initial state for its first
   segment (whose end state is then the true one);
2. ``M``: the segments with zero values from the identity state, whose end state is the segment's transition
   ``M`` (the recurrence is affine in S: ``S_end = M S_start + b``). With ``V = K`` steps 1 and 2 are one pass
   over twice the value heads (``_transitions_one_pass``); otherwise two;
3. ``splice_segments``: ``S_{i+1} = M_i S_i + b_i``, sequentially over each sequence's segments and in
   parallel over sequences and heads;
4. the forward over all segments, each from its true start state; a sequence's final state is its last
   segment's.

Nothing is truncated or approximated (unlike a cut-off on the summed decay), so the result equals the forward
without segments up to rounding for any gate, including g = 0 and unnormalised keys. Steps 1 and 2 need no
output (the Hopper backend runs its state-only kernel there), and they also run the last segment of each
sequence, needlessly: segments are passed as packed sequences, which cannot skip one.

PyTorch counterpart of the transitions: ``flashgdn.reference.chunked.state_pass`` / ``compose_transitions``.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .plan import SegmentPlan

Forward = Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]


def splice_segments(M: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """Start states of every segment, ``[num_segments, Hv, K, V]``.

    ``h0[n]`` is sequence n's initial state; ``b[s]`` is segment s's end state from a zero start, except for
    first segments, where it is the end state from ``h0``; ``M[s]`` is segment s's transition. Entries of
    last segments are not read. Sequential over the segments of a sequence, batched over sequences and heads.
    """
    S = plan.num_segments
    dev = h0.device
    first = plan.first.to(dev)
    count = plan.count.to(dev)
    starts = h0.new_zeros((S,) + tuple(h0.shape[1:]))
    starts[first] = h0
    state = b[first]  # end of each first segment = start of the second
    for i in range(1, int(plan.count.max())):
        live = count > i
        if i >= 2:
            prev = (first + i - 1).clamp(max=S - 1)
            step = torch.matmul(M[prev], state) + b[prev]
            state = torch.where(live[:, None, None, None], step, state)
        starts[(first + i)[live]] = state[live]
    return starts


def _transitions_two_passes(forward, q, k, v, g, beta, scale, h0, seg_cu, plan, first):
    """Steps 1 and 2 as two passes: b from zero (first segments from h0), M from the identity with v = 0."""
    S, (Hv, K, V) = plan.num_segments, h0.shape[1:]
    b_start = h0.new_zeros((S, Hv, K, V))
    b_start[first] = h0
    _, b = forward(q, k, v, g, beta, scale, b_start, seg_cu, True, plan.seg_cu, need_output=False)
    eye = torch.eye(K, dtype=h0.dtype, device=h0.device).expand(S, Hv, K, K).contiguous()
    zeros = torch.zeros((1, v.shape[1], Hv, K), dtype=v.dtype, device=v.device)
    _, M = forward(q, k, zeros, g, beta, scale, eye, seg_cu, True, plan.seg_cu, need_output=False)
    return b, M


def _transitions_one_pass(forward, q, k, v, g, beta, scale, h0, seg_cu, plan, first):
    """Steps 1 and 2 in one pass of twice the value heads (when V = K): value head 2h carries head h's b pass
    and head 2h + 1 its M pass (v = 0, identity start). Interleaving keeps both on qk head h // group, since
    (2h or 2h + 1) // (2 group) = h // group; one launch with twice the CTAs instead of two."""
    S, (Hv, K, V) = plan.num_segments, h0.shape[1:]

    def twice(x):  # [..., Hv, ...] -> [..., 2 Hv, ...], each head repeated
        return x.repeat_interleave(2, dim=2)

    v2 = torch.stack([v, torch.zeros_like(v)], dim=3).flatten(2, 3)
    start = h0.new_zeros((S, Hv, 2, K, V))
    start[first, :, 0] = h0
    start[:, :, 1] = torch.eye(K, dtype=h0.dtype, device=h0.device)
    _, end = forward(q, k, v2, twice(g), twice(beta), scale, start.flatten(1, 2), seg_cu, True, plan.seg_cu,
                     need_output=False)
    end = end.unflatten(1, (Hv, 2))
    return end[:, :, 0], end[:, :, 1]


def cp_forward(
    forward: Forward,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    plan: SegmentPlan,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The operator on packed sequences ``[1, T, ...]`` (dense input reshaped by the caller) with the plan's
    segments; K-major states. Returns ``(o, final_state or None)`` as the forward without segments would."""
    dev = q.device
    Hv, K, V = v.shape[2], k.shape[3], v.shape[3]
    N = plan.first.numel()
    S = plan.num_segments
    seg_cu = plan.seg_cu.to(dev)
    first = plan.first.to(dev)
    count = plan.count.to(dev)
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    h0 = (initial_state.to(sdt) if initial_state is not None
          else torch.zeros((N, Hv, K, V), dtype=sdt, device=dev))

    if plan.split:
        if K == V:
            b, M = _transitions_one_pass(forward, q, k, v, g, beta, scale, h0, seg_cu, plan, first)
        else:
            b, M = _transitions_two_passes(forward, q, k, v, g, beta, scale, h0, seg_cu, plan, first)
        # 3. splice: segment i + 1 of a sequence starts at M_i S_i + b_i
        starts = splice_segments(M.to(sdt), b.to(sdt), h0, plan)
    else:
        starts = h0
    # 4. every segment from its true start state
    o, seg_final = forward(q, k, v, g, beta, scale, starts, seg_cu, output_final_state, plan.seg_cu)
    final = None
    if output_final_state:
        final = seg_final[first + count - 1]
    return o, final


def cp_problem_forward(forward: Forward, p, plan: SegmentPlan, q: torch.Tensor, k: torch.Tensor):
    """``cp_forward`` for a ``GDNProblem``: dense input packed, the state layout converted both ways.
    ``q``/``k`` are the (possibly L2-normalised) queries and keys to use instead of ``p.q``/``p.k``."""
    B, T = p.B, p.T

    def packed(x):
        return x.reshape((1, B * T) + tuple(x.shape[2:]))

    h0 = p.initial_state
    if h0 is not None and p.state_v_first:
        h0 = h0.transpose(-1, -2)
    o, final = cp_forward(forward, packed(q), packed(k), packed(p.v), packed(p.g), packed(p.beta), p.scale, h0,
                          p.output_final_state, plan)
    o = o.reshape(B, T, p.Hv, p.V)
    if final is not None and p.state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return o, final
