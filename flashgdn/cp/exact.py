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

Nothing here reads a device value on the host or copies a host tensor to the device: the segments' index
tensors are built on the device from ``cu_seqlens`` (``segment_index_tensors``), loop counts come from the host
plan, and the splice needs no mask (a finished sequence writes to a spare row). So the whole forward runs
without a sync and can be captured in a CUDA graph (``tests/test_cp.py`` runs the driver on meta tensors and
fails on any such op; ``tests/test_gpu_hopper_cp.py`` captures it on the GPU).

Nothing is truncated or approximated (unlike a cut-off on the summed decay), so the result equals the forward
without segments up to rounding for any gate, including g = 0 and unnormalised keys. Steps 1 and 2 need no
output (the Hopper backend runs its state-only kernel there), and they also run the last segment of each
sequence, needlessly: segments are passed as packed sequences, which cannot skip one.

PyTorch counterpart of the transitions: ``flashgdn.reference.chunked.state_pass`` / ``compose_transitions``.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from .plan import SegmentIndex, SegmentPlan, dense_cu_seqlens, segment_index_tensors

Forward = Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]
Gather = Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


#: ``select_segments`` takes evenly stepping rows the host plan knows without a device gather (FLASHGDN_CP_HOST_ROWS=0:
#: always the gather, for an A/B). A training step's kernels on the H200 (``backward/step-kernels-v0.16p-rows{0,1}``):
#: 2/4 8192x1 0.416 -> 0.398 ms, 16/32 8192x1 1.051 -> 1.024, 16/32 32768x1 3.596 -> 3.563.
HOST_ROWS = os.environ.get("FLASHGDN_CP_HOST_ROWS", "1") == "1"


def select_segments(x: torch.Tensor, rows: torch.Tensor, device_rows: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``x.index_select(0, device_rows())`` for rows of segments that the host plan knows (``rows``, int64 on the
    host, the same values): ``x`` itself when the rows are all of x in order, one strided copy when they step evenly
    (one sequence's last segment or first, every r-th segment of a single sequence), else the device gather. The
    same values with fewer small kernels (the index arithmetic, ``index_select``'s gather), and nothing read from
    the device."""
    n = rows.numel()
    if n and HOST_ROWS:
        a = int(rows[0])
        step = int(rows[1]) - a if n > 1 else 1
        if step >= 1 and torch.equal(rows, a + step * torch.arange(n, dtype=rows.dtype)):
            if a == 0 and step == 1 and n == x.shape[0]:
                return x
            return x[a:a + step * (n - 1) + 1:step].clone(memory_format=torch.contiguous_format)
    return x.index_select(0, device_rows())


def splice_segments(M: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, plan: SegmentPlan,
                    index: Optional[SegmentIndex] = None) -> torch.Tensor:
    """Start states of every segment, ``[num_segments, Hv, K, V]``.

    ``h0[n]`` is sequence n's initial state; ``b[s]`` is segment s's end state from a zero start, except for
    first segments, where it is the end state from ``h0``; ``M[s]`` is segment s's transition. Entries of
    last segments are not read. Sequential over the segments of a sequence, batched over sequences and heads.
    ``index``: the plan's index tensors on the states' device (``segment_index_tensors``); without it they
    are copied from the host plan, which synchronises on a GPU.
    """
    if index is None:
        index = SegmentIndex(plan.seg_cu.to(h0.device), plan.seg_seq.to(h0.device), plan.first.to(h0.device),
                             plan.count.to(h0.device))
    return _splice(lambda src: (M.index_select(0, src), b.index_select(0, src)), h0, plan, index)


def _splice(gather: Gather, h0: torch.Tensor, plan: SegmentPlan, index: SegmentIndex) -> torch.Tensor:
    """``splice_segments`` with ``gather(src) -> (M[src], b[src])`` (fresh tensors, ``[N, Hv, K, ·]``).

    Step i (i = 1, 2, ...) of every sequence n at once: ``state = M[first + i - 1] state + b[first + i - 1]``
    (just ``b[first]`` for i = 1), written to row ``first + i``."""
    return splice_steps(gather, h0, plan, index, reverse=False)


def splice_steps(gather: Gather, init: torch.Tensor, plan: SegmentPlan, index: SegmentIndex,
                 reverse: bool) -> torch.Tensor:
    """The sequential part of both splices, every sequence at once, one row per segment (``[num_segments, ...]``).

    Forward (``exact._splice``): row ``first`` is ``init``; step i writes row ``first + i`` from segment
    ``first + i - 1``'s pair, and its first step is ``b[first]`` alone (the first segment's b already holds the
    sequence's initial state). Reverse (``backward.splice_reverse``): row ``last`` is ``init``; step i writes row
    ``last - i`` as ``Mt[last - i + 1] state + D[last - i + 1]``, from ``state = init``. A sequence with no step i
    writes that step's row to a spare row of its own past the segments, dropped at the end, so no step needs a
    mask or a count read back from the device; the number of steps comes from the host plan."""
    S, N = plan.num_segments, plan.first.numel()
    first, count = index.first, index.count
    last = first + count - 1
    out = init.new_empty((S + N,) + tuple(init.shape[1:]))  # every row < S is written exactly once
    out[last if reverse else first] = init
    steps = int(plan.count.max()) - 1
    if steps <= 0:
        return out[:S]
    dev = first.device
    i = torch.arange(1, steps + 1, device=dev).unsqueeze(1)  # [steps, 1]
    row = last - i if reverse else first + i  # [steps, N]
    dst = torch.where(i < count, row, torch.arange(S, S + N, device=dev))
    # past a sequence's own segments: its first (reverse) or last one, whose result goes to the spare row
    src = torch.maximum(row + 1, first) if reverse else torch.minimum(row - 1, last)
    K, V = init.shape[-2], init.shape[-1]
    # under autograd the product may not overwrite the gathered b: its M may be a view of the same tensor
    in_place = not torch.is_grad_enabled()
    state = init if reverse else None
    for j in range(steps):
        Mj, bj = gather(src[j])
        if state is not None:
            if in_place:
                # bj in place (a view); Mj may be a transposed view (reverse), so reshape, not view
                bj.view(-1, K, V).baddbmm_(Mj.reshape(-1, K, K), state.reshape(-1, K, V))
            else:
                bj = torch.baddbmm(bj.reshape(-1, K, V), Mj.reshape(-1, K, K), state.reshape(-1, K, V)).view(bj.shape)
        state = bj
        out.index_copy_(0, dst[j], state)
    return out[:S]


def segment_indices(forward, plan: SegmentPlan, cu_seqlens: torch.Tensor) -> SegmentIndex:
    """The plan's index tensors on the device: by the forward's own ``segment_index(plan, cu_seqlens)`` when it
    has one (e.g. one kernel), else ``segment_index_tensors``."""
    own = getattr(forward, "segment_index", None)
    return own(plan, cu_seqlens) if own is not None else segment_index_tensors(plan, cu_seqlens)


def chain_index_tensors(index: SegmentIndex, known_index: SegmentIndex, m: int) -> Tuple[SegmentIndex, torch.Tensor]:
    """The chains of ``starts_from_known`` when the known plan's segments are m times ``index``'s: ``(chains, jf)``,
    where ``jf`` is each known segment's place in its sequence, and its chain is that sequence's own segments
    m jf .. m jf + m - 1 (fewer at its end): ``chains.first`` and ``chains.count`` per known segment, with
    ``index``'s ``seg_cu`` and ``seg_seq``. Arithmetic on the tensors' own device, nothing read back; given two host
    plans (``SegmentPlan``, the same fields), the host's copy of the same chains."""
    fseq = known_index.seg_seq
    jf = torch.arange(fseq.numel(), device=fseq.device) - known_index.first.index_select(0, fseq)
    chains = SegmentIndex(index.seg_cu, index.seg_seq, torch.add(index.first.index_select(0, fseq), jf, alpha=m),
                          torch.sub(index.count.index_select(0, fseq), jf, alpha=m).clamp_(max=m))
    return chains, jf


def chain_indices(forward, index: SegmentIndex, known_index: SegmentIndex, m: int) -> Tuple[SegmentIndex, torch.Tensor]:
    """``chain_index_tensors`` by the forward's own ``chain_index(index, known_index, m)`` when it has one (e.g. one
    kernel)."""
    own = getattr(forward, "chain_index", None)
    return own(index, known_index, m) if own is not None else chain_index_tensors(index, known_index, m)


def _twice(x: torch.Tensor) -> torch.Tensor:
    """``[1, T, Hv, ...] -> [1, T, 2 Hv, ...]``, each head repeated."""
    return x.unsqueeze(3).expand(x.shape[:3] + (2,) + x.shape[3:]).flatten(2, 3)


def _transitions_two_passes(forward, q, k, v, g, beta, scale, h0, plan, index):
    """Steps 1 and 2 as two passes: b from zero (first segments from h0), M from the identity with v = 0.
    Returns ``(gather, None)``: ``gather`` for the splice, no pairs tensor."""
    S, (Hv, K, V) = plan.num_segments, h0.shape[1:]
    b_start = h0.new_zeros((S, Hv, K, V))
    b_start[index.first] = h0
    _, b = forward(q, k, v, g, beta, scale, b_start, index.seg_cu, True, plan.seg_cu, need_output=False)
    eye = torch.eye(K, dtype=h0.dtype, device=h0.device).expand(S, Hv, K, K).contiguous()
    zeros = torch.zeros((1, v.shape[1], Hv, K), dtype=v.dtype, device=v.device)
    _, M = forward(q, k, zeros, g, beta, scale, eye, index.seg_cu, True, plan.seg_cu, need_output=False)
    M, b = M.to(h0.dtype), b.to(h0.dtype)
    return (lambda src: (M.index_select(0, src), b.index_select(0, src))), None


def _transitions_one_pass(forward, q, k, v, g, beta, scale, h0, plan, index, for_backward=False, m_only=False):
    """Steps 1 and 2 in one pass of twice the value heads (when V = K): value head 2h carries head h's b pass
    and head 2h + 1 its M pass (v = 0, identity start). Interleaving keeps both on qk head h // group, since
    (2h or 2h + 1) // (2 group) = h // group; one launch with twice the CTAs instead of two. A forward with a
    ``transition_pairs(q, k, v, g, beta, scale, start, seg_cu, seg_cu_cpu) -> end`` attribute runs that pass
    from the undoubled inputs itself (``start``/``end``: ``[S, 2 Hv, K, V]``). Returns ``(gather, pairs)``:
    ``gather`` for the splice (one gather of both (b, M) pairs per step) and the pairs ``[S, 2 Hv, K, V]`` (head
    2h: b of value head h, 2h + 1: its M), for a forward's own ``splice`` / ``splice_reverse``. ``m_only``: no b
    will be read (the backward's starts gathered from the forward's, ``starts_from_known``), which a forward that
    skips unread items is told (``"m_only"``)."""
    S, (Hv, K, V) = plan.num_segments, h0.shape[1:]

    def starts():  # b from h0 on a sequence's first segment, else zero; M from the identity
        start = h0.new_empty((S, Hv, 2, K, V))
        start[:, :, 0].zero_()
        start[index.first, :, 0] = h0
        start[:, :, 1] = torch.eye(K, dtype=h0.dtype, device=h0.device)
        return start

    paired = getattr(forward, "transition_pairs", None)
    if paired is not None:
        # the forward runs the pairs itself (value head h's inputs for both, v = 0 for the second), so the
        # doubled inputs below are never made. One that skips what neither splice reads (b of a last segment, M of
        # a first, and in the forward M of a last) leaves those entries as they come: splice_steps and the splice
        # kernel never read them. One that ``builds_transition_starts`` makes the start states itself from h0.
        skip = {}
        if getattr(forward, "skips_unread_transitions", False):
            skip["unread"] = (index, "m_only" if m_only else "backward" if for_backward else "forward")
        if skip and getattr(forward, "builds_transition_starts", False):
            end = paired(q, k, v, g, beta, scale, None, index.seg_cu, plan.seg_cu, h0=h0, **skip)
        else:
            end = paired(q, k, v, g, beta, scale, starts().flatten(1, 2), index.seg_cu, plan.seg_cu, **skip)
    else:
        start = starts()
        v2 = v.new_empty(v.shape[:3] + (2,) + v.shape[3:])  # [1, T, Hv, 2, V]: v, then zeros
        v2[:, :, :, 1].zero_()
        v2[:, :, :, 0] = v
        v2 = v2.flatten(2, 3)
        _, end = forward(q, k, v2, _twice(g), _twice(beta), scale, start.flatten(1, 2), index.seg_cu, True,
                         plan.seg_cu, need_output=False)
    pairs = end.to(h0.dtype)
    return pairs_gather(pairs), pairs


def pairs_gather(pairs: torch.Tensor) -> Gather:
    """The splice's ``gather(src) -> (M[src], b[src])`` over transition pairs ``[S, 2 Hv, K, V]`` (head 2h: b of
    value head h, 2h + 1: its M)."""
    end = pairs.unflatten(1, (pairs.shape[1] // 2, 2))

    def gather(src):
        pair = end.index_select(0, src)
        return pair[:, :, 1], pair[:, :, 0]

    return gather


def float_states(x: Optional[torch.Tensor], q: torch.Tensor, v: torch.Tensor, N: int) -> torch.Tensor:
    """States ``[N, Hv, K, V]`` in the drivers' float dtype (float64 for float64 inputs, else float32): ``x``
    converted, or zeros when it is None."""
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    if x is not None:
        return x.to(sdt)
    return torch.zeros((N, v.shape[2], q.shape[3], v.shape[3]), dtype=sdt, device=q.device)


class StartsHandoff:
    """The forward's plan and segment starts on their way to the backward (``cp_backward(forward_starts=...)``),
    taken once: whoever passes the handoff down keeps no reference to the starts tensor, so the backward can let it
    go once its own starts are made, before its memory peaks (segments x Hv x K x V float32, ~8 MB on 2/4 32768x1
    or 16/32 8192x1), instead of holding it to the end of the call as an autograd context or a caller's tuple
    would. ``pairs``: the forward's transition pairs as well, or None (``cp_forward(keep_transitions=True)``)."""

    def __init__(self, plan: SegmentPlan, starts: Optional[torch.Tensor], pairs: Optional[torch.Tensor] = None):
        self._value: Optional[Tuple[SegmentPlan, Optional[torch.Tensor], Optional[torch.Tensor]]] = (
            plan, starts, pairs)

    def take(self) -> Optional[Tuple[SegmentPlan, Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """``(plan, starts, pairs)`` the first time, None after."""
        value, self._value = self._value, None
        return value


class KnownStarts(NamedTuple):
    """The true start states of another plan's segments of the same sequences (the forward's, kept for the
    backward): its plan, its index tensors on the device and its starts ``[segments, Hv, K, V]``; ``pairs``, its
    transition pairs ``[segments, 2 Hv, K, V]`` with the M of every segment but a sequence's first (made for the
    backward: ``cp_forward(keep_transitions=True)``), or None."""

    plan: SegmentPlan
    index: SegmentIndex
    starts: torch.Tensor
    pairs: Optional[torch.Tensor] = None


def same_segments(plan: SegmentPlan, other: SegmentPlan) -> bool:
    """Whether two plans cut the same sequences at the same tokens (host tensors: no device read)."""
    return plan.seg_cu.shape == other.seg_cu.shape and torch.equal(plan.seg_cu, other.seg_cu)


def segment_starts(forward: Forward, q, k, v, g, beta, scale, h0: torch.Tensor, plan: SegmentPlan,
                   index: SegmentIndex, for_backward: bool = False, known: Optional[KnownStarts] = None):
    """Steps 1-3: every segment's true start state. Returns ``(starts, gather, pairs)``, the transitions'
    ``gather`` and ``pairs`` too (the backward splices with them again). The splice is the forward's own when it
    has one (``splice(pairs, h0, plan, index) -> starts``, e.g. one fused kernel) and the pairs exist.
    ``for_backward``: the backward's reverse splice will read these transitions too (M of last segments), which
    matters to a forward that ``skips_unread_transitions``. ``known``: another plan's true starts, from which the
    splice needs no chain longer than the ratio of the two segment lengths (``starts_from_known``) when one
    length divides the other; with its ``pairs`` on the same segments, those transitions are taken as they are and
    no pass runs (the forward made them with the M the reverse splice reads, ``cp_forward(keep_transitions=True)``)."""
    if known is not None and known.pairs is not None and same_segments(plan, known.plan):
        return known.starts, pairs_gather(known.pairs), known.pairs
    if k.shape[3] == v.shape[3]:
        gather, pairs = _transitions_one_pass(forward, q, k, v, g, beta, scale, h0, plan, index, for_backward,
                                              m_only=known is not None and gathers_starts(plan, known.plan))
    else:
        gather, pairs = _transitions_two_passes(forward, q, k, v, g, beta, scale, h0, plan, index)
    if known is not None:
        starts = starts_from_known(forward, gather, pairs, plan, index, known)
        if starts is not None:
            return starts, gather, pairs
    # 3. splice: segment i + 1 of a sequence starts at M_i S_i + b_i
    own = getattr(forward, "splice", None)
    if own is not None and pairs is not None:
        return own(pairs, h0, plan, index), gather, pairs
    return _splice(gather, h0, plan, index), gather, pairs


def gathers_starts(plan: SegmentPlan, known_plan: SegmentPlan) -> bool:
    """Whether ``starts_from_known`` gathers every start of ``plan`` from those of ``known_plan``, with no splice:
    both split by a length, ``plan``'s a multiple of the other's."""
    Lb, Lf = plan.segment_chunks, known_plan.segment_chunks
    return Lb is not None and Lf is not None and Lb % Lf == 0


def starts_from_known(forward: Forward, gather: Gather, pairs: Optional[torch.Tensor], plan: SegmentPlan,
                      index: SegmentIndex, known: KnownStarts) -> Optional[torch.Tensor]:
    """Every segment's true start state from ``known``, the true starts of another plan of the same sequences,
    when one segment length divides the other (both plans cut each sequence from its start, ``split_sequences``);
    None otherwise.

    - ``plan``'s length a multiple r of ``known``'s: every segment starts where a known one does (its sequence's
      known segment r x its own index), so its start is gathered, with no splice (``gathers_starts``; the
      transition pass then need not make any b: ``segment_starts`` asks a skipping forward for ``"m_only"``).
    - ``known``'s a multiple m of ``plan``'s: each known segment holds m of ``plan``'s (fewer at a sequence's end),
      and the splice runs on those chains of at most m, all at once, from the known starts, instead of on each
      sequence's whole chain. A chain's first b is its segment's end state from a zero start, so it becomes
      ``M start + b`` first, except at a sequence's start, where it already holds h0 (``_transitions_one_pass``);
      the b entries are not read again (the reverse splice reads M and D). A forward with its own
      ``splice_chains(pairs, starts, plan, chains, jf) -> starts`` (the Hopper splice kernel's ``chains`` build)
      makes that first product inside the splice, where ``jf`` (each chain's place in its sequence) is nonzero;
      the pairs are then left as they are."""
    Lb, Lf = plan.segment_chunks, known.plan.segment_chunks
    if Lb is None or Lf is None or (Lb % Lf and Lf % Lb):
        return None
    S = plan.num_segments
    dev = index.first.device
    if gathers_starts(plan, known.plan):
        r = Lb // Lf

        def rows_of(own, other, device=None):
            # each segment's row among the known ones: its sequence's first known row + r x its own index
            local = torch.arange(S, device=device) - own.first.index_select(0, own.seg_seq)
            return other.first.index_select(0, own.seg_seq) + local * r

        return select_segments(known.starts, rows_of(plan, known.plan), lambda: rows_of(index, known.index, dev))
    m = Lf // Lb
    chains, jf = chain_indices(forward, index, known.index, m)
    # the host's copy for the splice's number of steps (the same arithmetic on the host plans); seg_seq only gives
    # the number of rows
    host_chains, _ = chain_index_tensors(plan, known.plan, m)
    chain_plan = SegmentPlan(plan.seg_cu, plan.seg_seq, host_chains.first, host_chains.count, Lb)
    chained = getattr(forward, "splice_chains", None)
    if chained is not None and pairs is not None:
        # the forward's own splice makes each chain's first M start + b itself (nonzero jf: inside a sequence)
        return chained(pairs, known.starts, chain_plan, chains, jf)
    Mc, bc = gather(chains.first)
    K, V = bc.shape[-2], bc.shape[-1]
    mid = (jf > 0).view(-1, *([1] * (bc.dim() - 1)))
    # (a sequence's first M is never computed by a pass that skips unread items: where() keeps bc there)
    from_start = torch.baddbmm(bc.reshape(-1, K, V), Mc.reshape(-1, K, K), known.starts.reshape(-1, K, V))
    first_b = torch.where(mid, from_start.view(bc.shape), bc)
    if pairs is not None:
        pairs = pairs.clone() if torch.is_grad_enabled() else pairs
        Hv = pairs.shape[1] // 2
        by_head = pairs.view(S, Hv, 2, K, V)
        by_head[:, :, 0].index_copy_(0, chains.first, first_b)
        own = getattr(forward, "splice", None)
        if own is not None:
            return own(pairs, known.starts, chain_plan, chains)

        def fixed(src):
            pair = by_head.index_select(0, src)
            return pair[:, :, 1], pair[:, :, 0]
    else:
        slot = torch.full((S,), -1, dtype=torch.int64, device=dev)
        slot.index_copy_(0, chains.first, torch.arange(chains.first.numel(), device=dev))

        def fixed(src):
            M, b = gather(src)
            s = slot.index_select(0, src)
            keep = (s >= 0).view(-1, *([1] * (b.dim() - 1)))
            return M, torch.where(keep, first_b.index_select(0, s.clamp(min=0)), b)
    return _splice(fixed, known.starts, chain_plan, chains)


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
    cu_seqlens: torch.Tensor,
    keep_starts: bool = False,
    keep_transitions: bool = False,
):
    """The operator on packed sequences ``[1, T, ...]`` (dense input reshaped by the caller) with the plan's
    segments; K-major states. ``cu_seqlens`` is the sequences' offsets on q's device (the plan's lengths): the
    segments' index tensors are built from it there (``segment_index_tensors``), so nothing is copied from
    the host and nothing synchronises; the host plan gives only sizes and the host copy of the segments'
    offsets. Returns ``(o, final_state or None)`` as the forward without segments would; with ``keep_starts``,
    ``(o, final_state or None, starts)``, the segments' true start states (K-major float, ``[segments, Hv, K, V]``;
    None when the plan does not split), which a backward can start from (``KnownStarts``). ``keep_transitions``
    (with ``keep_starts``): ``(o, final_state or None, starts, pairs)``, the transition pairs too (``[segments, 2 Hv,
    K, V]``, None without a split or when V != K), made with the M of every segment but a sequence's first, as the
    backward's reverse splice reads them (``for_backward``), so that a backward on the same segments runs no
    transition pass of its own."""
    index = segment_indices(forward, plan, cu_seqlens)
    h0 = float_states(initial_state, q, v, plan.first.numel())
    starts, pairs = h0, None
    if plan.split:
        starts, _, pairs = segment_starts(forward, q, k, v, g, beta, scale, h0, plan, index,
                                          for_backward=keep_transitions)
    # 4. every segment from its true start state
    o, seg_final = forward(q, k, v, g, beta, scale, starts, index.seg_cu, output_final_state, plan.seg_cu)
    final = None
    if output_final_state:
        final = select_segments(seg_final, plan.first + plan.count - 1, lambda: index.first + index.count - 1)
    if keep_starts and keep_transitions:
        return o, final, starts if plan.split else None, pairs
    if keep_starts:
        return o, final, starts if plan.split else None
    return o, final


def cp_problem_forward(forward: Forward, p, plan: SegmentPlan, q: torch.Tensor, k: torch.Tensor,
                       keep_starts: bool = False, keep_transitions: bool = False):
    """``cp_forward`` for a ``GDNProblem``: dense input packed, the state layout converted both ways.
    ``q``/``k`` are the (possibly L2-normalised) queries and keys to use instead of ``p.q``/``p.k``.
    ``keep_starts``: also the segments' start states, as ``cp_forward`` keeps them (K-major); ``keep_transitions``:
    and the transition pairs."""
    B, T = p.B, p.T

    def packed(x):
        return x.reshape((1, B * T) + tuple(x.shape[2:]))

    h0 = p.initial_state
    if h0 is not None and p.state_v_first:
        h0 = h0.transpose(-1, -2)
    cu = p.cu_seqlens if p.cu_seqlens is not None else dense_cu_seqlens(B, T, q.device)
    o, final, *starts = cp_forward(forward, packed(q), packed(k), packed(p.v), packed(p.g), packed(p.beta), p.scale,
                                   h0, p.output_final_state, plan, cu, keep_starts=keep_starts,
                                   keep_transitions=keep_transitions)
    o = o.reshape(B, T, p.Hv, p.V)
    if final is not None and p.state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return (o, final, *starts)
