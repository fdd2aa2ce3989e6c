"""Exact context parallelism for the backward: the state-gradient walk of every segment in parallel.

The backward's one sequential part is the walk of the state gradient over a sequence's chunks, last to first
(``dS = M^T dS' + E^T dO`` per chunk). It is affine in the gradient at the walk's end, so over a segment s

    dS_start(s) = M_s^T dS_end(s) + D_s

with ``M_s`` the segment's forward transition (``S_end = M_s S_start + b_s``, the forward CP's, ``exact.py``) and
``D_s`` the walk of the segment from a zero end gradient. ``cp_backward`` runs, on the segments of a
``SegmentPlan`` as packed sequences:

1. the forward's transitions and splice (``exact.py``): every segment's true start state;
2. the walk of every segment from zero: ``D_s``;
3. the reverse splice: ``dS_end(last segment) = d(final state)``, ``dS_end(s) = M_{s+1}^T dS_end(s+1) + D_{s+1}``,
   sequentially over each sequence's segments, last to first, batched over sequences and heads;
4. the backward's stages on every segment from its true states: the chunk states from the true start states,
   the walk from the true end gradients (its start gradient of a first segment is d(initial state)), the
   per-chunk gradients.

Step 2 needs only the backend's stage 1, not step 1's results, and step 4's chunk states need only step 1's: on a
CUDA device (``OVERLAP``) the walks from zero run on a second stream while step 1 and the chunk states run on the
caller's, and the two meet before the reverse splice. Few-head shapes run each of these passes on a fraction of
the SMs, so the two chains share the GPU instead of waiting for each other; the same kernels on the same inputs,
so the same bits.

With a plan that does not split (or none), only step 4 runs, on the sequences themselves. The stages are a
backend's (``BackwardStages``): ``flashgdn.reference.chunked_backward.ReferenceBackwardStages`` in PyTorch,
``flashgdn.kernels.hopper.backward.HopperBackwardStages`` on the GPU. As in the forward, nothing reads a device
value on the host: loop counts come from the host plan, index tensors are built on the device.
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Protocol, Tuple, Union

import torch

from .exact import (Forward, Gather, KnownStarts, StartsHandoff, float_states, same_segments, segment_indices,
                    segment_starts, select_segments, splice_steps)
from .plan import SegmentIndex, SegmentPlan


#: the walks from zero (step 2) on a second CUDA stream beside step 1 and the chunk states (module docstring).
#: FLASHGDN_CP_BACKWARD_OVERLAP=0: one stream, the steps in order.
OVERLAP = os.environ.get("FLASHGDN_CP_BACKWARD_OVERLAP", "1") == "1"

_SIDE_STREAMS: Dict[Tuple[torch.device, str], "torch.cuda.Stream"] = {}


def side_stream(device: torch.device, purpose: str = "walks") -> "torch.cuda.Stream":
    """A second stream of ``device`` for ``purpose`` (one per device and purpose, made on first use): work for
    different purposes beside the main stream does not queue behind each other."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    if (device, purpose) not in _SIDE_STREAMS:
        _SIDE_STREAMS[device, purpose] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device, purpose]


class BackwardStages(Protocol):
    """A backend's backward in three stages, on packed sequences ``[1, T, ...]`` given by offsets ``cu`` (on the
    device) and ``cu_cpu`` (their host copy), K-major float states ``[N, Hv, K, V]``. ``states`` and ``ds_end``
    are the backend's own per-chunk tensors, passed from one stage to the next untouched."""

    def chunk_states(self, q, k, v, g, beta, h0, cu, cu_cpu):
        """The forward's state at the start of every chunk, from start states ``h0`` (None: zero)."""

    def state_gradients(self, q, k, g, beta, do, dht, scale, cu, cu_cpu) -> Tuple[object, torch.Tensor]:
        """``(ds_end, ds_start)``: the state gradient at every chunk's end and ``[N, Hv, K, V]`` at every
        sequence's start, from end gradients ``dht`` (None: zero)."""

    def chunk_gradients(self, q, k, v, g, beta, do, states, ds_end, scale, cu, cu_cpu):
        """``(dq, dk, dv, dg, dbeta)`` token-major ``[1, T, ...]``, tokens in no sequence zero, in a form that
        ``finish_gradients`` completes (a backend may leave dq and dk per value head for it to sum)."""

    # optional: ``fuses_gradients`` (True) and ``fused_gradients(q, k, v, g, beta, do, states, dht, scale, cu, cu_cpu)
    # -> (grads, ds_start)``, the two stages above in one (``grads`` as ``chunk_gradients`` gives them);
    # ``prepare(q, k, g, beta, cu, cu_cpu)``: whatever the stages share (e.g. stage 1), made now, on the current
    # stream, so that passes on two streams can both read it (``OVERLAP``);
    # ``walk_starts(q, k, g, beta, do, scale, cu, cu_cpu) -> ds_start``: ``state_gradients``' second output from a
    # zero end gradient, without making the per-chunk gradients it does not return

    def finish_gradients(self, grads):
        """The gradients of ``chunk_gradients`` made final (dq, dk per qk head), called once the per-chunk
        ``states`` and ``ds_end`` are no longer referenced, so that what this step allocates is not live beside
        them; it may also let go of what the stages kept for each other."""


def splice_reverse(gather: Gather, end: torch.Tensor, plan: SegmentPlan, index: SegmentIndex) -> torch.Tensor:
    """The state gradient at the end of every segment, ``[num_segments, Hv, K, V]``: ``end[n]`` for sequence n's
    last segment, then ``dS_end(s) = Mt[s + 1] dS_end(s + 1) + D[s + 1]`` towards its first, with
    ``gather(src) -> (Mt[src], D[src])`` (fresh tensors, ``Mt`` the transposed transitions ``[N, Hv, K, K]``).

    The mirror of ``exact._splice``: step i of every sequence at once writes row ``last - i``; a sequence with no
    such row writes a spare row past the segments. No mask, no count read back from the device."""
    return splice_steps(gather, end, plan, index, reverse=True)


def cp_backward(
    stages: BackwardStages,
    forward: Optional[Forward],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: Optional[torch.Tensor],
    scale: float,
    initial_state: Optional[torch.Tensor],
    plan: Optional[SegmentPlan],
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    forward_starts: Union[None, Tuple[SegmentPlan, torch.Tensor],
                          Tuple[SegmentPlan, torch.Tensor, Optional[torch.Tensor]], StartsHandoff] = None,
):
    """Gradients ``(dq, dk, dv, dg, dbeta, dh0)`` of the operator on packed sequences ``[1, T, ...]`` with offsets
    ``cu_seqlens`` (on q's device; ``cu_seqlens_cpu`` their host copy), K-major states, by ``stages`` on the
    plan's segments (module docstring). ``forward`` (``exact.cp_forward``'s kind) runs the forward transitions;
    it is not called when the plan does not split. ``dht``: the final state's gradient or None; ``dh0`` is the
    initial state's gradient, float, also without an initial state (the caller drops it). ``forward_starts``: the
    forward's plan and its segments' true start states (``cp_forward(keep_starts=True)``), from which step 1's
    splice runs on short chains or not at all when one segment length divides the other
    (``exact.starts_from_known``), and, as a third entry, its transition pairs
    (``cp_forward(keep_transitions=True)``), which on the same segments take the place of step 1's transition pass;
    as a ``StartsHandoff`` they are released after step 3."""
    states = None  # step 4's chunk states, made early when the walks from zero overlap step 1
    if plan is None or not plan.split:  # step 4 alone, on the sequences themselves
        seg_cu, seg_cu_cpu = cu_seqlens, (plan.seg_cu if plan is not None else cu_seqlens_cpu)
        starts, ends, first = initial_state, dht, None
    else:
        index = segment_indices(forward, plan, cu_seqlens)
        seg_cu, seg_cu_cpu, first = index.seg_cu, plan.seg_cu, index.first
        N = cu_seqlens.shape[0] - 1
        h0 = float_states(initial_state, q, v, N)
        # 1. every segment's true start state
        known = None
        taken = forward_starts.take() if isinstance(forward_starts, StartsHandoff) else forward_starts
        if taken is not None and taken[1] is not None:
            # the forward's own segments (the same cuts of the same sequences): the same index, not built again,
            # and its transitions, where it kept them, taken as they are (no transition pass here)
            same = same_segments(taken[0], plan)
            pairs = taken[2] if same and len(taken) > 2 else None
            known = KnownStarts(taken[0], index if same else segment_indices(forward, taken[0], cu_seqlens),
                                taken[1].to(h0.dtype), None if pairs is None else pairs.to(h0.dtype))
            del pairs
        del taken  # ``known`` alone holds a handed-off starts tensor now
        walk_starts = getattr(stages, "walk_starts", None)

        def walks_from_zero():
            # 2. every segment's D (only the start gradients are kept: a name for the per-chunk ones would keep
            # them alive to the end)
            if walk_starts is not None:
                return walk_starts(q, k, g, beta, do, scale, seg_cu, seg_cu_cpu).to(h0.dtype)
            return stages.state_gradients(q, k, g, beta, do, None, scale, seg_cu, seg_cu_cpu)[1].to(h0.dtype)

        prepare = getattr(stages, "prepare", None)
        overlap = OVERLAP and q.is_cuda and prepare is not None
        if overlap:
            # on the second stream, once what they share with step 1 exists
            prepare(q, k, g, beta, seg_cu, seg_cu_cpu)
            main, side = torch.cuda.current_stream(q.device), side_stream(q.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                D = walks_from_zero()
        starts, gather, pairs = segment_starts(forward, q, k, v, g, beta, scale, h0, plan, index, for_backward=True,
                                               known=known)
        if overlap:
            # step 4's chunk states need only the starts: made while the walks from zero run
            states = stages.chunk_states(q, k, v, g, beta, starts, seg_cu, seg_cu_cpu)
            del starts
            main.wait_stream(side)
        else:
            D = walks_from_zero()
        # 3. every segment's true end gradient (by the forward's own ``splice_reverse(pairs, D, end, plan, index)``
        # when it has one)
        end = float_states(dht, q, v, N)
        own_reverse = getattr(forward, "splice_reverse", None)
        if own_reverse is not None and pairs is not None:
            ends = own_reverse(pairs, D, end, plan, index)
        else:
            ends = splice_reverse(lambda src: (gather(src)[0].transpose(-1, -2), D.index_select(0, src)), end,
                                  plan, index)
        # the transitions and the walks from zero are done with: not live beside step 4's per-chunk tensors, where
        # the backward's memory peaks (segments x Hv x K x V float32 each, the pairs twice that)
        del D, gather, pairs, known
    # 4. the stages on every segment (or sequence) from its true states
    if states is None:
        states = stages.chunk_states(q, k, v, g, beta, starts, seg_cu, seg_cu_cpu)
        del starts
    if getattr(stages, "fuses_gradients", False):  # the walk and the per-chunk gradients in one pass
        grads, ds_start = stages.fused_gradients(q, k, v, g, beta, do, states, ends, scale, seg_cu, seg_cu_cpu)
        del states, ends
    else:
        ds_end, ds_start = stages.state_gradients(q, k, g, beta, do, ends, scale, seg_cu, seg_cu_cpu)
        grads = stages.chunk_gradients(q, k, v, g, beta, do, states, ds_end, scale, seg_cu, seg_cu_cpu)
        # the per-chunk states and state gradients are the backward's largest tensors: released before the last
        # step's allocations (the sums of dq and dk over each group), not beside them
        del states, ds_end
    grads = stages.finish_gradients(grads)
    return (*grads, ds_start if first is None else select_segments(ds_start, plan.first, lambda: first))
