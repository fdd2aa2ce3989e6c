"""The ``"hopper"`` backend: TileLang kernels for SM90 behind ``chunk_gated_delta_rule``.

Forward: the kernels of ``forward.py``; with ``cp=<segment length>`` they run through exact context parallelism
(``flashgdn.cp``: a state pass over twice the value heads, a splice, the forward on all segments; no host sync,
capturable in a CUDA graph). Backward (``BACKWARD``): the kernels of ``backward.py``, or the written-out backward
of the chunked form in PyTorch (``flashgdn.reference.chunked_backward``, float32: exact, slow, not capturable).
The backward does not use context parallelism: it recomputes what it needs from the inputs alone. The L2 norm of
q/k is applied as differentiable PyTorch ops in front of the kernels.
"""
import os
from typing import Optional, Tuple

import torch

from ...api.backend import Backend, register_backend
from ...api.problem import GDNProblem
from ...reference.recurrent import l2norm_qk

SUPPORTED_HEAD_DIMS = (128,)

#: what cp="auto" does on this backend: "auto" (the cost model decides; the default since its predictions
#: were checked against CP timings on the H200, docs/context-parallel.md), "off" or a segment length in chunks
AUTO_CP = os.environ.get("FLASHGDN_HOPPER_CP", "auto")
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
#: the chunk loops, the walk and the splices launch one row of CTAs per sequence (or CP segment) on the grid's y,
#: which CUDA caps at 65535 blocks
MAX_SEQUENCES = 65535


def check_launch_rows(num_seqs: int, plan=None) -> None:
    """A clear error, before any kernel runs, when a call has more sequences (``num_seqs``) or context-parallel
    segments (``plan``, a ``flashgdn.cp.plan.SegmentPlan`` or None) than the kernels' grids take."""
    if num_seqs > MAX_SEQUENCES:
        raise ValueError(f"cu_seqlens: backend='hopper' takes at most {MAX_SEQUENCES} sequences per call (its "
                         f"kernels launch one row of CTAs per sequence), got {num_seqs}; split the batch into calls")
    if plan is not None and plan.num_segments > MAX_SEQUENCES:
        raise ValueError(f"cp: the context-parallel plan has {plan.num_segments} segments, more than the "
                         f"{MAX_SEQUENCES} the Hopper kernels launch per call; give longer segments "
                         "(cp=<chunks per segment>) or cp='off'")

#: the backward: "kernels" (``backward.hopper_backward``, the default since tests/test_gpu_hopper_backward.py passed
#: on the H200) or "reference" (the PyTorch chunked backward, ~14x slower). FLASHGDN_HOPPER_BACKWARD overrides.
BACKWARD = os.environ.get("FLASHGDN_HOPPER_BACKWARD", "kernels")
BACKWARDS = ("kernels", "reference")


class _HopperGDN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens, cu_seqlens_cpu,
                state_v_first, problem, plan, backward_plan):
        from .forward import hopper_forward

        if plan is not None:
            from ...cp import cp_problem_forward

            from .forward import PRECISE

            forward = _HopperSegmentsForward(paired=CP_PAIRED and not PRECISE)
            if _reuses_starts(plan, backward_plan):
                # the segments' start states, from which the backward's own splice starts (CP_REUSE_STARTS), and on
                # the backward's own segments the transitions too (CP_REUSE_TRANSITIONS)
                keep = _reuses_transitions(plan, backward_plan)
                o, ht, starts, *pairs = cp_problem_forward(forward, problem, plan, q, k, keep_starts=True,
                                                           keep_transitions=keep)
                ctx.forward_starts = (plan, starts, pairs[0] if pairs else None)
            else:
                o, ht = cp_problem_forward(forward, problem, plan, q, k)
        else:
            o, ht = hopper_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                   state_v_first, cu_seqlens_cpu=cu_seqlens_cpu)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.cu_seqlens_cpu = cu_seqlens_cpu
        ctx.scale = scale
        ctx.output_final_state = output_final_state
        ctx.state_v_first = state_v_first
        ctx.has_initial_state = initial_state is not None
        ctx.backward_plan = backward_plan
        if ht is None:
            return o
        return o, ht

    @staticmethod
    def backward(ctx, do, dht=None):
        from ...cp.exact import StartsHandoff

        q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
        if do is None:  # only the final state was used
            do = torch.zeros_like(v)
        # the forward's starts leave the context: the backward releases them once its own starts are made, before
        # its memory peaks (a second backward through a retained graph splices from nothing, as exactly)
        kept = getattr(ctx, "forward_starts", None)
        ctx.forward_starts = None
        handoff = None if kept is None else StartsHandoff(*kept)
        del kept
        grads = hopper_gradients(q, k, v, g, beta, do.contiguous(),
                                 None if (dht is None or not ctx.output_final_state) else dht.contiguous(),
                                 ctx.scale, initial_state, cu_seqlens, ctx.cu_seqlens_cpu, ctx.state_v_first,
                                 ctx.backward_plan, handoff)
        res = [None if gr is None else gr.to(x.dtype)
               for gr, x in zip(grads, (q, k, v, g, beta, initial_state))]
        return (*res, None, None, None, None, None, None, None, None)


def hopper_gradients(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first,
                     backward_plan=None, forward_starts=None):
    """The backend's backward (``BACKWARD``): ``(dq, dk, dv, dg, dbeta, dh0 or None)``, not yet cast. The kernels
    run on ``backward_plan``'s segments with its choice of the fused kernel (a ``flashgdn.cp.BackwardPlan``; None:
    no segments, the choice by ``backward.fused_backward_wanted``), from the forward's segment starts when given
    (``forward_starts``: its plan and starts, ``CP_REUSE_STARTS``); the PyTorch backward ignores both."""
    if BACKWARD not in BACKWARDS:
        raise ValueError(f"FLASHGDN_HOPPER_BACKWARD must be one of {BACKWARDS}, got {BACKWARD!r}")
    if BACKWARD == "kernels":
        from .backward import hopper_backward

        plan, fused = backward_plan if backward_plan is not None else (None, None)
        return hopper_backward(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens, state_v_first, plan,
                               cu_seqlens_cpu, fused=fused, forward_starts=forward_starts)
    from ...reference.chunked_backward import chunk_gated_delta_rule_backward_reference

    return chunk_gated_delta_rule_backward_reference(
        q, k, v, g, beta, do, dht, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first, compute_dtype=torch.float32)


#: context parallelism's transition pass on the rs loop's paired variant, with stages 0 and 1 run once and shared
#: with the forward over the segments (FLASHGDN_HOPPER_CP_PAIRED=0 turns it off). Same bits as the unpaired pass
#: (tests/test_gpu_hopper_cp.py); on the H200 16/32 32768x1 at cp=64 took 1.20 ms instead of 1.98.
CP_PAIRED = os.environ.get("FLASHGDN_HOPPER_CP_PAIRED", "1") == "1"

#: context parallelism's own small work as one kernel each instead of many small torch kernels: the segment index
#: tensors (``segment_index.py``, ~16 torch ops) and the splice and reverse splice (``splice.py``, three torch
#: kernels per step) (FLASHGDN_HOPPER_CP_FUSED=0 turns them off). On the H200 2/8 32768x1 at cp=16 took 0.64 ms
#: instead of 0.95.
CP_FUSED = os.environ.get("FLASHGDN_HOPPER_CP_FUSED", "1") == "1"

#: the paired transition pass walks no chunk for the items the splices never read (b of a sequence's last segment,
#: M of its first, in the forward M of its last: docs/context-parallel.md); FLASHGDN_HOPPER_CP_SKIP_UNREAD=0 walks
#: them all. The same bits (tests/test_gpu_hopper_cp.py); on the H200 8/32 24576+8192 at cp=128 took 0.75 ms
#: instead of 0.95, its forward and backward 5.02 instead of 5.40 (``cp-choices-v0.12b*.json``).
CP_SKIP_UNREAD = os.environ.get("FLASHGDN_HOPPER_CP_SKIP_UNREAD", "1") == "1"


#: the backward starts its own segments from the forward's segment start states, kept by the forward (a few MB:
#: segments x Hv x K x V float32), instead of splicing each sequence's whole chain again: from the forward's starts
#: a backward segment length that the forward's divides needs no splice, and one that divides the forward's only
#: chains of the ratio, each chain's first ``M start + b`` made in the splice (its ``chains`` build;
#: ``cp.exact.starts_from_known``). Under autograd only (the custom op's backward, a separate call, splices as
#: before); the backward's plan counts the shorter splice. A training step's kernels on the H200
#: (``backward/step-kernels-v0.16i-reuse{0,1}.json``): 2/4 32768x1 0.864 -> 0.813 ms, 1/4 131072x1 2.290 -> 2.230,
#: 4/8 32768x1 1.267 -> 1.263, 16/32 32768x1 3.791 -> 3.786; the cp set's fwd+bwd 1.007x. Where the starts are
#: gathered the transition pass makes no b either (``skip_unread="m_only"``): 1/4 131072x1 2.281 -> 2.161 ms
#: (``-v0.16j-reuse{0,1}.json``). FLASHGDN_HOPPER_CP_REUSE_STARTS=0|1.
CP_REUSE_STARTS = os.environ.get("FLASHGDN_HOPPER_CP_REUSE_STARTS", "1") == "1"

#: the skipping transition pass makes its start states itself from the sequences' initial states (the rs loop's
#: ``starts_from_h0``) instead of reading a [segments, 2 Hv, K, V] start tensor that four small torch kernels fill
#: (two fills, h0's scatter, the identity's copy), in the forward and again in the backward. The same bits (a GPU
#: test checks the forward and every gradient); a training step's kernels on the H200
#: (``backward/step-kernels-v0.16m-starts{0,1}.json``): 2/4 32768x1 0.815 -> 0.773 ms, 1/4 131072x1 2.149 -> 2.100,
#: 4/8 32768x1 1.260 -> 1.214, 16/32 32768x1 3.639 -> 3.573. FLASHGDN_HOPPER_CP_STARTS_IN_KERNEL=1|0.
CP_STARTS_IN_KERNEL = os.environ.get("FLASHGDN_HOPPER_CP_STARTS_IN_KERNEL", "1") == "1"

#: where the backward runs on the forward's own segments (and CP_REUSE_STARTS), the forward keeps its transition
#: pairs too, made with the M of every sequence's last segment besides (the reverse splice reads them; the forward's
#: splice does not), and the backward runs no transition pass of its own: one state-only pass over the segments
#: fewer in a training step, for one more M per split sequence in the forward's pass, and the pairs (segments x 2 Hv
#: x K x V float32, 64 KB each: 16 MB on 16/32 32768x1) kept from the forward to the backward's reverse splice.
#: The backward's plan counts it (``CostModel.reuse_transitions``). The same kernels on the same inputs, so the same
#: bits. On the H200, fwd+bwd side by side in one process (notes v0.29a, ``backward/transitions-ab-v0.29a*``): 0.94x-0.98x
#: on the bwd set's shapes whose segments agree (17 of 32), 0.967x on the cp set (54 shapes, 0.943x-1.005x), the
#: same bits on every one: the default. FLASHGDN_HOPPER_CP_REUSE_TRANSITIONS=0|1.
CP_REUSE_TRANSITIONS = os.environ.get("FLASHGDN_HOPPER_CP_REUSE_TRANSITIONS", "1") == "1"

#: when a backward follows and both the forward's plan and the backward's split, but on different lengths, the
#: forward runs on the backward's segments, so that the backward takes the forward's starts and transitions as they
#: are (CP_REUSE_STARTS, CP_REUSE_TRANSITIONS). The forward's own length is the faster forward, but on the H200 one
#: length for both (the backward's) was the faster fwd+bwd on all twelve shapes timed where the two differ: 0.87x-0.94x
#: cp="auto"'s time (``cp/cp-choices-lengths-v0.29b.json``, notes v0.29b). Since v0.29c also where the backward
#: splits and the forward's own plan does not (many short sequences: 0.936x-0.984x on the three such shapes of the
#: bwd and cp sets). Switched both ways side by side (``backward/forward-on-backward-ab-v0.29c.json``): 0.901x on the
#: 19 few-CTA shapes it moves, 0.950x on the 4 full ones. A forward with no backward after it keeps its own plan.
#: FLASHGDN_HOPPER_CP_FORWARD_ON_BACKWARD_SEGMENTS=0|1.
CP_FORWARD_ON_BACKWARD_SEGMENTS = os.environ.get("FLASHGDN_HOPPER_CP_FORWARD_ON_BACKWARD_SEGMENTS", "1") == "1"

#: the backward's chains from the forward's segment starts (their first segment and count, and each known
#: segment's place in its sequence) by one kernel (``segment_index.build_chain_index``) instead of eight small torch
#: kernels, where the forward's segments are a multiple of the backward's. The same integers (a GPU test checks
#: them); a training step's kernels on the H200 (``backward/step-kernels-v0.16q-chains{0,1}.json``): 2/4 32768x1
#: 0.744 -> 0.731 ms, 8/16 8192x1 0.656 -> 0.646. FLASHGDN_HOPPER_CP_CHAIN_INDEX=0 for the torch ops.
CP_CHAIN_INDEX = os.environ.get("FLASHGDN_HOPPER_CP_CHAIN_INDEX", "1") == "1"

#: the transition pass stores zero, without a walk, for the M of a segment whose transition is below float32's range
#: by a bound from the inputs alone (``flashgdn.cp.bounds``: the summed log decay, plus each token's log growth
#: where beta |k|^2 leaves [0, 2], below -88), made beside stage 1 on a stream of its own. Exact: what is dropped is
#: under float32's smallest normal number times the start state. Where every head decays (the benchmark's gates sum to
#: ~-3.2 a chunk: ~28 chunks) the pass makes b alone on segments of 32 chunks and more. An A/B (notes v0.34a), off:
#: the same bits, but 1.20x the cp set's forward on an H100, the bound's PyTorch ops on the critical path costing
#: more than the pass saves (notes "The five measured"). FLASHGDN_HOPPER_CP_NEGLIGIBLE_M=1 turns it on.
CP_NEGLIGIBLE_M = os.environ.get("FLASHGDN_HOPPER_CP_NEGLIGIBLE_M", "0") == "1"

#: beside CP_NEGLIGIBLE_M, the transition pass's b items leave out a segment's first chunks where a bound from the
#: inputs (``flashgdn.cp.bounds.b_start_chunks``: |beta| |k| |v| of each token carried to the segment's end by the
#: same per-token factors, plus h0's share on a sequence's first segment) puts what they owe b below e^-88, and walk
#: the rest from zero: b is then what it was up to entries below float32's smallest normal number. With the
#: benchmark's gates (~-3.2 a chunk) a b item walks ~30 chunks whatever the segment's length. The bound reads v too,
#: beside stage 1 like M's. An A/B (notes v0.35b), off: the same bits, 1.86x the cp set's forward over
#: CP_NEGLIGIBLE_M's on an H100 (notes "The five measured"). FLASHGDN_HOPPER_CP_LATE_B=1 (with
#: FLASHGDN_HOPPER_CP_NEGLIGIBLE_M=1) turns it on.
CP_LATE_B = os.environ.get("FLASHGDN_HOPPER_CP_LATE_B", "0") == "1"

#: CP_NEGLIGIBLE_M's M items dropped by the same bound made inside the kernels: stage 1 writes each chunk's term (the
#: chunk's summed decay and log growth, |k|^2 read off K K^T's diagonal: ``kkt_inverse``'s ``chunk_bounds``) and
#: each M item of the transition pass sums its segment's chunks itself (``chunk_forward_rs``'s ``chunk_bounds``).
#: No read of k and no PyTorch op between stage 1 and the pass, where CP_NEGLIGIBLE_M's bound cost more than the
#: pass saved. Exact in the same sense (both sums are rounded up before the comparison with -88). Takes precedence
#: over CP_NEGLIGIBLE_M and CP_LATE_B. The pass also flags the M it stored as zero, and the splices leave those
#: products out (``splice.py``'s ``m_zero`` builds: a flagged step is its b, or D). On by default (notes v0.36b, an
#: H100, the same bits both ways: the cp set's forward 0.862x of off, 0.732x-1.021x; fwd+bwd at 2/4, 4/8, 8/16
#: 0.949x, 0.852x-1.016x; the 1-2% where no segment is long enough for its M to vanish).
#: FLASHGDN_HOPPER_CP_NEGLIGIBLE_M_IN_KERNEL=0 turns it off.
CP_NEGLIGIBLE_M_IN_KERNEL = os.environ.get("FLASHGDN_HOPPER_CP_NEGLIGIBLE_M_IN_KERNEL", "1") == "1"

#: a forward with no backward after it (``cp="auto"``) takes the shortest segment length the cost model puts within
#: ``flashgdn.cp.plan.SHORTER_WITHIN`` (3%) of its best estimate, where the output pass in whole waves gets shorter
#: too: the model counts every M, and shorter segments leave more of them out where they decay below float32's range
#: (CP_NEGLIGIBLE_M_IN_KERNEL). On by default (notes "v0.36c measured", an H100, the same bits both ways: the five
#: shapes of the cp, canonical and bwd sets it moves 0.709x-0.753x of off, the cp set's forward 0.988x).
#: FLASHGDN_HOPPER_CP_SHORTER_TIES=0 turns it off.
CP_SHORTER_TIES = os.environ.get("FLASHGDN_HOPPER_CP_SHORTER_TIES", "1") == "1"

#: with CP_NEGLIGIBLE_M_IN_KERNEL, the forward's transition pass starts each b late as CP_LATE_B does, from a count
#: the b item makes itself out of stage 1's per-chunk terms: the chunk bounds, and what each chunk's tokens inject,
#: which stage 1 makes reading v (``kkt_inverse``'s ``chunk_injects``, ``chunk_forward_rs``'s ``chunk_late_b``;
#: ``flashgdn.cp.bounds.segment_b_starts``). The same exactness as CP_LATE_B (what is left out owes b less than
#: float32's smallest normal number) without its PyTorch pass over k and v. Only where the plan's longest segment is
#: CP_LATE_B_MIN_CHUNKS or more: stage 1's read of v (as many bytes as the rest of its traffic at Hqk = Hv / 4) costs
#: more than b's shorter walks save on shorter segments. On by default (notes v0.36h, an H200, the same bits both
#: ways: the cp set's forward at 256-chunk segments 0.885x-0.913x of off, at 128 0.925x-0.966x, at 64 1.014x-1.078x,
#: at 16 and 32 1.115x-1.209x). FLASHGDN_HOPPER_CP_LATE_B_IN_KERNEL=0 turns it off.
CP_LATE_B_IN_KERNEL = os.environ.get("FLASHGDN_HOPPER_CP_LATE_B_IN_KERNEL", "1") == "1"

#: the shortest segment length (chunks) at which CP_LATE_B_IN_KERNEL applies; FLASHGDN_HOPPER_CP_LATE_B_MIN_CHUNKS
#: sets it (0: every length, for A/Bs)
CP_LATE_B_MIN_CHUNKS = int(os.environ.get("FLASHGDN_HOPPER_CP_LATE_B_MIN_CHUNKS", "128"))


#: the backward's plan (``flashgdn.cp.plan_backward``) costs the walks from zero and the chunk states pass, which
#: ``flashgdn.cp.backward`` runs side by side on two streams (its OVERLAP), as the longer of the two instead of their
#: sum (``CostModel.walks_beside_states``). It moves the backward of 13 of the cp, bwd and canonical sets' shapes, none
#: in the cp set, each from no split to a split (single 2048-token sequences at 8/32-32/32, uneven mixes at 16/32-16/64;
#: ``tests/test_cp.py`` pins them). An A/B (notes v0.36l, "Measured on 2e10422"), off: on an H100 fwd+bwd 0.817x-1.004x
#: on seven of the eight shapes measured, but 1.043x on the bwd set's eight-sequence 16/32 mix, where the model is wrong
#: about the split itself. FLASHGDN_HOPPER_CP_WALKS_BESIDE_STATES=1 turns it on.
CP_WALKS_BESIDE_STATES = os.environ.get("FLASHGDN_HOPPER_CP_WALKS_BESIDE_STATES", "0") == "1"


def _late_b_in_kernel(seg_cu_cpu) -> bool:
    """Whether the forward's transition pass on segments ``seg_cu_cpu`` (the host's offsets, or None) starts b late
    from stage 1's terms: CP_LATE_B_IN_KERNEL, and the longest segment CP_LATE_B_MIN_CHUNKS chunks or more (known
    from the host's offsets only: without them, no)."""
    if not CP_LATE_B_IN_KERNEL:
        return False
    if CP_LATE_B_MIN_CHUNKS <= 0:
        return True
    if seg_cu_cpu is None or seg_cu_cpu.numel() < 2:
        return False
    return int((seg_cu_cpu[1:] - seg_cu_cpu[:-1]).max()) > (CP_LATE_B_MIN_CHUNKS - 1) * 64


#: with CP_SHORTER_TIES, the shortest length within ``flashgdn.cp.plan.SHORTER_WITHIN_WIDE`` (12%) of the best estimate
#: instead of 3%, where the best length's output pass leaves half the SMs idle and the shorter one is 32 chunks or more
#: (``SHORTER_WIDE_MIN_CHUNKS``): there the model overcharges a half-length segment by about that much. On by default
#: (notes v0.36g, an H100, the same bits both ways: the four shapes of the cp, canonical and bwd sets it moves
#: 0.733x-0.783x of off with the benchmark's gates, 1.02x-1.05x with them x 0.1, where no M vanishes).
#: FLASHGDN_HOPPER_CP_SHORTER_WIDE=0 turns it off.
CP_SHORTER_WIDE = os.environ.get("FLASHGDN_HOPPER_CP_SHORTER_WIDE", "1") == "1"


def _backward_splits(backward_plan) -> bool:
    """Whether a backward follows (``backward_plan`` not None) and its plan splits."""
    return backward_plan is not None and backward_plan.plan is not None and backward_plan.plan.split


def _reuses_starts(plan, backward_plan) -> bool:
    """Whether the forward keeps its segment starts for the backward: both split, and ``CP_REUSE_STARTS``."""
    return CP_REUSE_STARTS and plan is not None and plan.split and _backward_splits(backward_plan)


def _reuses_transitions(plan, backward_plan) -> bool:
    """Whether the forward keeps its transition pairs for the backward as well: it keeps its starts, the backward
    runs on the same segments, and ``CP_REUSE_TRANSITIONS``."""
    from ...cp.exact import same_segments

    return CP_REUSE_TRANSITIONS and _reuses_starts(plan, backward_plan) and same_segments(plan, backward_plan.plan)


def _training_forward_plan(plan, backward_plan):
    """The forward's segments when a backward follows (``CP_FORWARD_ON_BACKWARD_SEGMENTS``): the backward's where
    the backward splits and the forward's own plan does not split or splits on other lengths, so that the backward
    takes the forward's starts and transitions; else ``plan``."""
    from ...cp.exact import same_segments

    if not (CP_FORWARD_ON_BACKWARD_SEGMENTS and CP_REUSE_STARTS and CP_REUSE_TRANSITIONS
            and _backward_splits(backward_plan)):
        return plan
    return plan if plan is not None and same_segments(plan, backward_plan.plan) else backward_plan.plan


def cp_cost_model(device: Optional[torch.device] = None):
    """Context parallelism's cost model for the CP kernels this backend runs as its switches are set (the paired
    transition pass outside the precise mode, the fused index and splice, the skipping of unread items; a forward's
    shorter segments on the model's near-ties under CP_SHORTER_TIES, wider ones under CP_SHORTER_WIDE)."""
    from ...cp.plan import SHORTER_WITHIN, SHORTER_WITHIN_WIDE, CostModel
    from .forward import PRECISE

    from . import backward

    from ...cp.backward import OVERLAP

    paired = CP_PAIRED and not PRECISE
    return CostModel.for_device(device, paired=paired, fused=CP_FUSED, skip_unread=paired and CP_SKIP_UNREAD,
                                walks_beside_states=CP_WALKS_BESIDE_STATES and OVERLAP,
                                reuse_transitions=CP_REUSE_STARTS and CP_REUSE_TRANSITIONS,
                                fused_longest_first=backward.fused_longest_first(),
                                walk_starts_only=backward.WALK_STARTS_ONLY,
                                shorter_within=SHORTER_WITHIN if CP_SHORTER_TIES else 1.0,
                                shorter_within_wide=SHORTER_WITHIN_WIDE if CP_SHORTER_TIES and CP_SHORTER_WIDE else 1.0)


class _HopperSegmentsForward:
    """The Hopper forward on packed sequences with K-major states: the ``forward`` of ``flashgdn.cp`` (the
    state-only kernel when no output is needed). With ``paired`` it also offers ``transition_pairs``: the
    transition pass from undoubled inputs (``forward.hopper_transition_pairs``), keeping stages 0 and 1 for the
    forward over the same segments that follows. With ``fused`` (default ``CP_FUSED``) it offers
    ``segment_index``, ``chain_index`` (``CP_CHAIN_INDEX``), ``splice``, ``splice_chains`` (the backward's from the
    forward's segment starts) and ``splice_reverse``, which the CP drivers then use (``forward.hopper_segment_index``, ``forward.hopper_splice``)."""

    def __init__(self, paired: bool, fused: Optional[bool] = None, stage1_source=None,
                 skip_unread: Optional[bool] = None):
        self._stage1 = None
        self._skip_unread = CP_SKIP_UNREAD if skip_unread is None else skip_unread
        # ``stage1_source(q, k, g, beta, seg_cu, seg_cu_cpu) -> Stage1``: where the paired pass takes stages 0 and 1
        # from instead of running them (the backward's, which stores A as well and serves its own stages too)
        self._stage1_source = stage1_source
        self._paired = paired
        self._fused = CP_FUSED if fused is None else fused

    # What the CP drivers look up with ``getattr(forward, name, None)``, as properties: a bound method stored on
    # the instance would be a reference cycle, which keeps the instance and the stage-1 tensors it holds alive
    # until the garbage collector runs, past the end of the pass that needed them.
    @property
    def transition_pairs(self):
        return self._transition_pairs if self._paired else None

    @property
    def segment_index(self):
        from .forward import hopper_segment_index

        return hopper_segment_index if self._fused else None

    @property
    def chain_index(self):
        from .forward import hopper_chain_index

        return hopper_chain_index if self._fused and CP_CHAIN_INDEX else None

    @property
    def splice(self):
        return self._splice if self._fused else None

    @property
    def splice_chains(self):
        return self._splice_chains if self._fused else None

    @property
    def splice_reverse(self):
        return self._splice_reverse if self._fused else None

    def __call__(self, q, k, v, g, beta, scale, h0, cu, output_final_state, cu_cpu, need_output=True):
        from .forward import hopper_forward

        return hopper_forward(q, k, v, g, beta, scale, h0.to(torch.float32).contiguous(), output_final_state,
                              cu.to(torch.int32), False, with_output=need_output, stage1=self._stage1,
                              cu_seqlens_cpu=cu_cpu)

    @staticmethod
    def _splice(pairs, h0, plan, index):
        from .forward import hopper_splice

        return hopper_splice(pairs, h0, index.first, index.count, plan.num_segments)

    @staticmethod
    def _splice_chains(pairs, starts, plan, chains, from_known):
        from .forward import hopper_splice

        return hopper_splice(pairs, starts, chains.first, chains.count, plan.num_segments, from_known=from_known)

    @staticmethod
    def _splice_reverse(pairs, D, end, plan, index):
        from .forward import hopper_splice

        return hopper_splice(pairs, end, index.first, index.count, plan.num_segments, D=D)

    @property
    def skips_unread_transitions(self) -> bool:
        return self._paired and self._skip_unread

    @property
    def builds_transition_starts(self) -> bool:
        """Whether ``transition_pairs`` (when it skips unread items) takes the sequences' initial states ``h0=``
        and makes the start states itself (``CP_STARTS_IN_KERNEL``)."""
        return self.skips_unread_transitions and CP_STARTS_IN_KERNEL

    def _transition_pairs(self, q, k, v, g, beta, scale, start, seg_cu, seg_cu_cpu, unread=None, h0=None):
        from .forward import hopper_stage1, hopper_transition_pairs

        cu = seg_cu.to(torch.int32)
        bounds = None
        # the bound on M from stage 1's chunks (CP_NEGLIGIBLE_M_IN_KERNEL), else by PyTorch ops beside stage 1
        in_kernel = CP_NEGLIGIBLE_M_IN_KERNEL and h0 is not None and unread is not None
        if CP_NEGLIGIBLE_M and not in_kernel and h0 is not None and unread is not None:
            late = None
            if CP_LATE_B and seg_cu_cpu is not None:  # (the chunks' count from the host's offsets: no read back)
                from ...cp.bounds import chunk_count

                late = (v, h0, unread[0], chunk_count(seg_cu_cpu))
            bounds = _m_bounds_aside(k, g, beta, cu, late)
        chunk_bounds = dict(chunk_bounds=True) if in_kernel else {}
        # b's late start from stage 1's terms: the forward's own stage 1 (not the backward's shared one)
        late_in_kernel = in_kernel and self._stage1_source is None and _late_b_in_kernel(seg_cu_cpu)
        if self._stage1_source is not None:
            self._stage1 = self._stage1_source(q, k, g, beta, seg_cu, seg_cu_cpu, **chunk_bounds)
        else:
            self._stage1 = hopper_stage1(k, g, beta, cu, cu_cpu=seg_cu_cpu, **chunk_bounds,
                                         **(dict(inject_v=v) if late_in_kernel else {}))
        if in_kernel:
            late = {} if not late_in_kernel else dict(
                chunk_inject=self._stage1.chunk_inject,
                h0_log_norm=torch.linalg.vector_norm(h0.to(torch.float32), dim=(-2, -1)).log())
            return hopper_transition_pairs(q, k, v, self._stage1, start, cu, unread=unread, h0=h0,
                                           chunk_bound=self._stage1.chunk_bound, **late)
        m_bound = b_start = None
        if bounds is not None:
            m_bound, b_start, side = bounds
            if side is not None:
                torch.cuda.current_stream(k.device).wait_stream(side)
        return hopper_transition_pairs(q, k, v, self._stage1, start, cu, unread=unread, h0=h0, m_bound=m_bound,
                                       b_start=b_start)


def _m_bounds_aside(k, g, beta, cu, late=None):
    """Every segment's bound on log ||M||_2 (``flashgdn.cp.bounds.transition_log_bounds``), and with ``late = (v,
    h0, index, num_chunks)`` (``CP_LATE_B``: the values, the sequences' initial states, the segment index, the
    segments' chunk count) the chunks each b item leaves out (``b_start_chunks``), made on a stream of their own from
    this point of the current one, so beside stage 1 that follows (their reads of k and v against stage 1's
    products): ``(bounds, starts or None, stream)``; the current stream waits for ``stream`` before the pass reads
    them. Off a CUDA device (the driver's tests with the kernels stood in for): made in place, stream None."""
    from ...cp.backward import side_stream
    from ...cp.bounds import b_start_chunks, token_log_growth, transition_log_bounds

    def bounds(out=None, starts=None):
        per_token = token_log_growth(k, g, beta)  # (one read of k for both)
        m_bound = transition_log_bounds(k, g, beta, cu, out=out, per_token=per_token)
        if late is None:
            return m_bound, None
        v, h0, index, num_chunks = late
        return m_bound, b_start_chunks(k, v, g, beta, cu, num_chunks, h0=h0, seg_seq=index.seg_seq,
                                       first=index.first, out=starts, per_token=per_token)

    if not k.is_cuda:
        return (*bounds(), None)

    main, side = torch.cuda.current_stream(k.device), side_stream(k.device, "transition bounds")
    # allocated here, on the stream that reads it, and written on the side stream (whose own temporaries stay there)
    out = torch.empty((cu.shape[0] - 1, g.shape[2]), dtype=torch.float32, device=k.device)
    starts = None if late is None else torch.empty((cu.shape[0] - 1, g.shape[2]), dtype=torch.int32, device=k.device)
    side.wait_stream(main)  # the inputs, the offsets and the allocations, in the order the main stream sees them
    with torch.cuda.stream(side):
        bounds(out, starts)
    return out, starts, side


class HopperBackend(Backend):
    name = "hopper"

    def available(self) -> Tuple[bool, str]:
        try:
            import tilelang  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means the backend cannot run
            return False, f"TileLang does not import ({type(e).__name__}: {e}); pip install flashgdn[hopper]"
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device"
        return True, ""

    def check(self, p: GDNProblem) -> None:
        if p.device.type != "cuda":
            raise NotImplementedError(f"backend='hopper' needs CUDA tensors (got {p.device}); "
                                      "backend='reference' runs on any device")
        if torch.cuda.get_device_capability(p.device) != (9, 0):
            raise NotImplementedError("backend='hopper' needs an SM90 GPU (H100/H200); backend='reference' runs anywhere")
        if p.K not in SUPPORTED_HEAD_DIMS or p.V not in SUPPORTED_HEAD_DIMS:
            raise NotImplementedError(
                f"backend='hopper' supports head dims K = V in {SUPPORTED_HEAD_DIMS}, got K={p.K}, V={p.V}; "
                "backend='reference' runs any head dim")
        if p.dtype not in SUPPORTED_DTYPES:
            raise NotImplementedError(
                f"backend='hopper' takes bfloat16 or float16 q/k/v, got {p.dtype}; backend='reference' runs float32/float64")
        check_launch_rows(p.N)

    def backward(self, p: GDNProblem, q, k, do, dht) -> tuple:
        return hopper_gradients(q, k, p.v, p.g, p.beta, do, dht, p.scale, p.initial_state, p.cu_seqlens,
                                p.cu_seqlens_cpu, p.state_v_first, self._backward_plan(p))

    @staticmethod
    def _with_auto_cp(p: GDNProblem) -> GDNProblem:
        """``p`` with cp="auto" read as AUTO_CP (FLASHGDN_HOPPER_CP=auto|off|<chunks>, default auto: the cost
        model); a segment length always runs CP."""
        if p.cp != "auto":
            return p
        from dataclasses import replace

        from ...cp.plan import parse_cp

        return replace(p, cp=parse_cp(AUTO_CP))

    @staticmethod
    def _plan(p: GDNProblem, in_between: bool = False):
        """The forward's context-parallel plan of ``p`` (``_with_auto_cp``); ``in_between``: no backward follows, so
        "auto" may also cut segments between the powers of two (``flashgdn.cp.plan.IN_BETWEEN_SEGMENT_CHUNKS``)."""
        from ...cp import plan_for_problem

        return plan_for_problem(HopperBackend._with_auto_cp(p), auto=True, model=cp_cost_model(p.device),
                                in_between=in_between)

    @staticmethod
    def _backward_plan(p: GDNProblem, forward_plan=None):
        """The backward's segments and fused-kernel choice for ``p`` (``flashgdn.cp.backward_plan_for_problem``:
        its own under cp="auto", the forward's under a segment length). ``forward_plan``: the plan of the forward
        that keeps its segment starts for this backward (``CP_REUSE_STARTS``, under autograd), whose shorter
        splice the choice then counts; None where the backward starts from nothing (the custom op's)."""
        from ...cp import backward_plan_for_problem
        from .backward import FUSED_BACKWARD
        from .forward import PRECISE

        forward_chunks = None
        if CP_REUSE_STARTS and forward_plan is not None and forward_plan.split:
            forward_chunks = forward_plan.segment_chunks
        plan = backward_plan_for_problem(HopperBackend._with_auto_cp(p), auto=True, model=cp_cost_model(p.device),
                                         fused_allowed=FUSED_BACKWARD is not False and not PRECISE,
                                         forward_chunks=forward_chunks)
        # FLASHGDN_HOPPER_FUSED_BACKWARD=1 forces the kernel on whatever segments were chosen
        return plan._replace(fused=True) if FUSED_BACKWARD is True and not PRECISE else plan

    def __call__(self, p: GDNProblem) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        # in float32, then back: the kernels take normalised bf16/fp16 q and k
        q, k = l2norm_qk(p.q, p.k) if p.use_qk_l2norm_in_kernel else (p.q, p.k)
        # the backward's plan is made here, on the host, only when autograd will want it
        wants_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, p.v, p.g, p.beta, p.initial_state))
        plan = self._plan(p, in_between=not wants_grad)
        check_launch_rows(p.N, plan)
        backward_plan = self._backward_plan(p, plan) if wants_grad else None
        if backward_plan is not None:
            check_launch_rows(p.N, backward_plan.plan)
            plan = _training_forward_plan(plan, backward_plan)
        out = _HopperGDN.apply(q, k, p.v, p.g, p.beta, p.initial_state, float(p.scale), p.output_final_state,
                               p.cu_seqlens, p.cu_seqlens_cpu, p.state_v_first, p, plan, backward_plan)
        if p.output_final_state:
            return out[0], out[1]
        return out, None


register_backend("hopper", HopperBackend)
