"""Context-parallel planning: whether to split long sequences into segments, and how long the segments are.

Exact context parallelism (DESIGN.md §4, ``docs/context-parallel.md``) runs a forward in three steps:

1. per segment, in parallel: the state pass, giving the segment's affine map ``S_end = M S_start + b`` (``b``
   from a zero state, or from the sequence's initial state for a first segment, whose end state is then exact
   at once; ``M`` from the identity with zero values);
2. splice, sequentially over the segments of each sequence: ``S_{i+1} = M_i S_i + b_i``;
3. the fused forward on all segments at once, each from its true start state.

The plan needs the sequence lengths on the host (``cu_seqlens_cpu``, or dense input); without them the
operator runs without context parallelism rather than synchronise. The host plan gives sizes only; the
index tensors the GPU uses are built there from the device ``cu_seqlens`` (``segment_index_tensors``), so a
forward with segments copies nothing from the host, reads nothing back and can be captured in a CUDA graph.

The cost model (``CostModel``, ``estimated_us``) adds up the stages of the Hopper forward with constants
fitted to stage timings on the H200: per pass the chunk-plan kernel, stage 1 (by throughput over chunks x
heads) and the chunk loop (the longest work item, or the total over the SMs once the items fill them). CP pays
its driver's small kernels, a state-only pass over twice the value heads (b and M; as the backend runs it, the
paired pass with its own fitted terms, in whole waves of its longest item), one splice step per segment after a
sequence's first, and the forward over the segments; it wins when the segments fill the SMs that the sequences
left idle. ``benchmarks/cp_model_check.py`` checks it against the measurements, ``benchmarks/cp_choices.py``
times its choices on the GPU.
"""
from __future__ import annotations

import functools
import heapq
import math
import os
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

CHUNK = 64

#: segment lengths tried by ``cp="auto"``, in chunks: from 16, the shortest the paired transition pass's constants
#: were fitted on (8-chunk segments would be an extrapolation: there the per-item cost is most of an item's time)
CANDIDATE_SEGMENT_CHUNKS = (16, 32, 64, 128, 256)

#: segment lengths between the powers of two that the forward's ``cp="auto"`` also tries when no backward follows
#: (``plan_segments(in_between=True)``): where a length between two of ``CANDIDATE_SEGMENT_CHUNKS`` lets the
#: transition pass's items fit one wave fewer. Timed on the H200 (``cp-choices-v0.16r.json``, eight few-CTA shapes at
#: 24-256 chunks): the model was 3-16% optimistic about them (4/16 12288+4096 at 40 chunks predicted 0.80x of its
#: pick at 32, measured 0.93x; 8/32 4096x1 at 24: 0.86x, 0.888x; 16/16 24576+8192 at 80: 0.84x, 0.945x; 2/8
#: 24576+8192 and 16/32 8192x1 at 48: 0.86x and 0.89x, 0.958x and 0.985x), and lost where it predicted 4-7% (4/16
#: 65536x2 at 224 chunks: 0.96x, 1.10x measured); so only the lengths measured to gain, taken only on a clear
#: predicted gain (``IN_BETWEEN_GAIN``). Under autograd the forward keeps the powers of two: the backward starts from
#: the forward's segment starts only when one segment length divides the other. FLASHGDN_CP_IN_BETWEEN=0 turns it off.
IN_BETWEEN_SEGMENT_CHUNKS = (24, 40, 48, 80)
IN_BETWEEN_GAIN = 0.9
IN_BETWEEN = os.environ.get("FLASHGDN_CP_IN_BETWEEN", "1") == "1"

#: the backward's ``cp="auto"`` (``plan_backward``) splits only when the model predicts at most this fraction of the
#: time without CP (but see ``BACKWARD_FUSED_ANY_GAIN``)
AUTO_GAIN = 0.9

#: the forward's ``cp="auto"`` (``plan_segments``) splits when the model predicts at most this fraction of the time
#: without CP where the sequences' CTAs (sequences x value heads) would leave at least half the SMs idle, and at
#: ``AUTO_GAIN``'s otherwise. Timed on the H200 (``cp-choices-v0.16q.json``, ``gain-v0.16q-*.json``): the 17
#: canonical shapes the model puts at 0.915x-0.963x ran at 0.881x-0.969x of no split at its pick (15 of them with
#: at most 66 CTAs unsplit), the one at 0.981x ran at 1.032x; and on the bwd set's 8/16 eight-sequence 8K mix (128
#: CTAs unsplit), predicted at 0.936x, the forward ran at 1.077x: where the split's CTAs share the SMs with the
#: others the model's busy rate is optimistic, on idle SMs it holds. FLASHGDN_CP_FORWARD_AUTO_GAIN sets it (0.9: as
#: the backward).
FORWARD_AUTO_GAIN = float(os.environ.get("FLASHGDN_CP_FORWARD_AUTO_GAIN", "0.97"))

#: ``CostModel.shorter_within`` under the Hopper backend's ``CP_SHORTER_TIES``: within 3% of the best estimate. Measured
#: on an H100 with the benchmark's gates (``h100/v0.36/cp-choices-quick.json``), the two cp-set shapes where a shorter
#: length is that close: 2/8 and 4/8 32768 at 32 chunks instead of 64, the forward 0.72x and 0.77x of the model's
#: pick. Only where the output pass, in whole waves, gets shorter too. Five shapes of the cp, canonical and bwd sets
#: change (``tests/test_cp.py``), all measured (``h100/v0.36/shorter-ties-*.json``: 0.71x-0.75x)
SHORTER_WITHIN = 1.03

#: ``CostModel.shorter_within_wide`` under the Hopper backend's ``CP_SHORTER_WIDE``: within 12%, where the best
#: length's output pass leaves at least half the SMs idle and the shorter length is ``SHORTER_WIDE_MIN_CHUNKS`` or
#: more. Where no transition M vanishes (the gates x 0.1, ``h100/v0.36/cp-choices-regimes-slow.json``) the model puts
#: a length half the best one's at 1.02x-1.12x of it, and the forward measured 0.93x-1.05x of it: the model overcharges
#: the shorter length by 6-11% of the longer one's time in the regime that favours long segments. Applied everywhere
#: (notes v0.36e, ``h100/v0.36/shorter-wide-ab.json``, benchmark gates) it moved eleven shapes, and gained only where
#: the half length filled SMs the longer one left idle and was long enough for M to vanish (1/4 and 2/4 65536 and
#: 61440+4096 at 32 chunks: 0.73x-0.78x); the others measured 0.996x-1.084x (16/16 8192 at 16 chunks 1.084x, where the
#: model's 1.08 was right: no M vanishes in 16 chunks). The two conditions keep those four (notes v0.36g)
SHORTER_WITHIN_WIDE = 1.12

#: the shortest length ``SHORTER_WITHIN_WIDE`` may pick: under the benchmark's gates a transition M falls below
#: float32's range after ~30 chunks (notes v0.34a), which the model does not see; in 16 chunks none does
SHORTER_WIDE_MIN_CHUNKS = 32

#: the backward splits on any predicted gain (not only ``AUTO_GAIN``'s clear one) when that puts it on the fused
#: kernel where the whole sequences would take the walk and ``chunk_grad``: the fused kernel keeps no per-chunk state
#: gradients (S x Hv x K x V in the io dtype, as large as the chunk states), so such a split also saves memory that
#: CP's own tensors (per segment, not per chunk) do not give back. The bwd set's 8/16 eight-sequence 8K mix: 568 us
#: against 611 predicted, ~66 MiB less. FLASHGDN_CP_BACKWARD_FUSED_ANY_GAIN=0|1.
BACKWARD_FUSED_ANY_GAIN = os.environ.get("FLASHGDN_CP_BACKWARD_FUSED_ANY_GAIN", "1") == "1"


class Items(NamedTuple):
    """Work items as the model sees them: how many, their chunks in all, the longest one's chunks (all the model
    needs of a list of chunk counts, so that a plan over many sequences costs no list of segments)."""

    count: int
    total: int
    longest: int

    @staticmethod
    def of(item_chunks: Union["Items", Sequence[int]]) -> "Items":
        if isinstance(item_chunks, Items):
            return item_chunks
        return Items(len(item_chunks), sum(item_chunks), max(item_chunks) if len(item_chunks) else 0)


@dataclass(frozen=True)
class CostModel:
    """Times in microseconds of the Hopper forward's stages, per unit of work; defaults from the H200.

    Source: ``benchmarks/results/h200/stages-hopper-v0.12b.json`` for stage 1, the forward loop (the rso loop, the
    default since v0.11e) and the state-only loop (CP's transition pass, rs's), both with v's tiles swizzled (their
    ``*_swv`` columns: the default since v0.12b), ``cp-choices-v0.12c.json`` for the paired transition pass and
    ``stages-hopper-v0.3.json`` for CP's other constants
    (``benchmarks/stage_timing.py``: each stage alone by CUDA-graph replay, median; K = V = 128, bf16);
    ``benchmarks/cp_model_check.py`` redoes the fits and compares the model with the measured op, with and
    without CP. Rows of those files are named ``Hqk/Hv TxN`` below.

    A chunk loop runs one CTA (one SM) per work item, a (sequence or segment) x value head walking its chunks:
    ``item + chunks x chunk`` while the items fit on the SMs, ``sum(item + chunks x busy chunk) / SMs`` once
    they fill them (the loops then share the memory bandwidth). Stage 1 (``kkt_inverse``, one CTA per chunk and
    qk head, every chunk at once) costs by throughput, per chunk and qk head (K K^T, loads) plus per chunk and
    value head (inverse, gating, Ag). Stage 0, the chunk-plan kernel, is one CTA whose threads each write their
    sequence's chunk slots in turn: a fixed time plus the longest item's chunk count.
    """

    num_sms: int = 132
    # fused forward loop (loop_rso with v swizzled, v0.12b): 2/8 32768x1 and 16/32 32768x1 (8 and 32 items of 512
    # chunks): 1.147 and 1.132 ms, 2.2 us per chunk; least squares with 32/32 8192x1 and 2/8 1024x8 (128 and 16
    # chunks) gives 7.9 us + 2.21 us per chunk. GPU full: 16/64 4096x8 (512 items x 64 chunks on 132 SMs) 0.752 ms
    # and 16/32 4096x8 (256 items) 0.382 ms give 2.93 us per chunk beside the 7.9 us per item. (v0.12a, v
    # unswizzled: 4.0 + 2.61, busy 3.09; the rs loop of v0.3: 8.8 us + 2.89 us per chunk, 3.17 when busy.)
    forward_item_us: float = 7.9
    forward_chunk_us: float = 2.21
    forward_busy_chunk_us: float = 2.93
    # state-only loop (loop_rs_state with v swizzled, CP's transition pass), the same shapes: 6.1 us + 1.08 us per
    # chunk by least squares, GPU full 1.46 us per chunk (v0.12a unswizzled: 5.9 + 1.51, busy 1.73)
    state_item_us: float = 6.1
    state_chunk_us: float = 1.08
    state_busy_chunk_us: float = 1.46
    # stage 1 (kkt_inverse with cp.async loads and the swizzled K K^T, v0.12a), least squares over the six rows:
    # 16/64 4096x8 is 0.270 ms for 512 chunks x (16 qk + 64 value heads), 16/32 4096x8 0.164 ms for 512 x (16 + 32)
    kkt_chunk_qk_head_us: float = 0.0074
    kkt_chunk_head_us: float = 0.0064
    # stage 0 (the chunk plan; its slots written by all the CTA's threads since v0.22c): 3.6-3.8 us up to 512 slots,
    # 4.8 us for 2048, 9.0 us for 8000 (``forward/plan-timing-v0.22c.json``), so by the total slot count (it was by
    # the longest sequence's, 0.023 us a chunk, when each thread wrote its own sequence's slots)
    plan_us: float = 3.6
    plan_chunk_us: float = 0.00065
    # context parallelism's own work: one small torch kernel in a CUDA graph; the driver's small kernels per
    # forward besides the splice steps (16 for the device index tensors, 8 for the transition pass's inputs, 10
    # to set up the splice, 3 for the final-state gather; tests/test_cp.py counts them); one splice step (gather
    # M and b, a batched 128 x 128 by 128 x 128 fp32 product, scatter: three kernels); the transition pass's
    # doubled inputs (v beside zeros, g and beta twice: ~0.8 KB written and read per token and value head at
    # ~4 TB/s, an estimate). launch_us and splice_step_us are calibrated on the two CP timings of 2/8 32768x1
    # in stages-hopper-v0.3.json (cp=16: 31 splice steps, 0.953 ms; cp=64: 7 steps, 0.698 ms), which the
    # counted estimates (3.0 and 12 us) left 69 and 39 us short.
    launch_us: float = 3.8
    cp_launches: int = 37
    splice_step_us: float = 13.0
    cp_token_head_us: float = 0.0002
    # the paired transition pass (``paired``; A/B in stages-hopper-v0.4-ab.json): stages 0 and 1 run once, for
    # the forward over the segments, and the doubled inputs are never made (their cp_token_head_us and 8 launches
    # go). At cp=64 the model then gives 1.25 ms for 16/32 32768x1 (1.20 measured, 1.98 unpaired), 0.55 for 2/8
    # 32768x1 (0.49) and 0.50 for 32/32 8192x1 (0.46): 4-12% pessimistic.
    paired: bool = False
    paired_launches_saved: int = 8
    # the fused segment index and splice kernels (``fused``): on 2/8 32768x1 they took 0.10 ms off cp=64 (7
    # splice steps) and 0.31 ms off cp=16 (31 steps), i.e. 8.7 us per step and 39 us of launches (~10)
    fused: bool = False
    fused_launches_saved: int = 10
    fused_splice_step_us: float = 4.3
    # the paired transition pass as its own loop: one item per segment and b-or-M head, each item_us + chunks x
    # chunk_us on one SM, run in whole waves of the longest item (``pairs_us``). Fitted by least squares on the 24
    # timings of the op with CP (skipping the unread items, paired and fused as the backend runs it, v swizzled:
    # cp-choices-v0.12c.json), the other constants as above: 22.5 us + 1.16 us per chunk puts the model at
    # 0.91x-1.06x of 23 of them and 0.81x on 8/24 4096x1 at 16 chunks, and at 0.95x-1.0x of the six without CP.
    # The paired and fused driver's own small kernels are inside these constants. (v0.12a, v unswizzled, every
    # item walked: 19 us + 1.70 us, fitted on 30 timings of cp-choices-v0.12a.json and stages-hopper-v0.12a.json.)
    pair_item_us: float = 22.5
    pair_chunk_us: float = 1.16
    # the paired pass without the items no splice reads (``skip_unread``, FLASHGDN_HOPPER_CP_SKIP_UNREAD): only b of
    # segments that are not a sequence's last and M of those that are neither its first nor its last run, all whole
    # segments; the skipped CTAs (a state load and store each) are not counted (the default since v0.12b).
    skip_unread: bool = False
    # the forward keeps its transition pairs for a backward on the same segments, made with the M of every
    # sequence's last segment besides (FLASHGDN_HOPPER_CP_REUSE_TRANSITIONS): that backward runs no transition pass
    reuse_transitions: bool = False
    # The backward (``plan_backward``), from the H200 on 2026-12-01 (v0.15d kernels;
    # ``backward/step-kernels-v0.15d-cp.json`` for the stages inside CP backwards, ``stages-hopper-v0.15d-bwd.json`` for the fused kernel alone). Each pass is
    # one CTA per item and value head: item_us + chunks x chunk_us on one SM, busy_chunk_us per chunk once the SMs
    # are shared by more CTAs than they hold. The fused kernel (walk and per-chunk gradients in one): 2/8 1024x8
    # (16 chunks) 0.212 ms, 32/32 8192x1 (128) 1.456, 16/32 32768x1 (512) 5.706 give 34 us + 11.1 us a chunk; on a
    # full GPU 16/32 4096x8 (two waves of 64) 1.514 and 16/64 4096x8 (four) 3.039 give 11.3. The walk alone:
    # 3 us + 3.15 us a chunk (2/4 8192 on 16-chunk segments 52.5 us, 4/8 32768 on 64-chunk segments 0.203 ms,
    # 16/32 32768 on 128-chunk ones 0.413), 3.5 on a full GPU (v0.14b). The forward's states stored at every
    # chunk (the rs state-only pass with stores): 2 us + 1.85 us a chunk (31.4 us at 16 chunks, 0.12 ms at 64),
    # 2.66 on a full GPU (16/32 4096x8, 0.34 ms). ``chunk_grad`` spreads every chunk and value head over the
    # SMs: 21 us of one SM each (4/8 32768x1 0.668 ms for 4096, 16/32 32768x1 2.61 ms for 16384). A splice step
    # grows with the value heads (the fused splice kernel's 128 x 128 fp32 products): forward 2.2 us + 0.17 us a
    # head (2/4: 2.5 us a step, 16/32: 7.5). The reverse (M^T and D) was 3.6 + 0.38 (4.4 and 15.4) in its plain
    # build; its register-blocked build (``forward.SPLICE_BLOCKED``) takes 0.67, 0.57, 0.53 and 0.54 of the plain
    # build's time a step alone at 4, 8, 16 and 32 heads (``cp/splice-timing-v0.16c.json``), ~0.9 us under the
    # step in the pipeline: 2.4 + 0.2 a head. The backward's CP driver (index tensors, end gradients) adds ~15 us of
    # small kernels.
    fused_item_us: float = 34.0
    fused_chunk_us: float = 11.1
    fused_busy_chunk_us: float = 11.3
    walk_item_us: float = 3.0
    walk_chunk_us: float = 3.15
    walk_busy_chunk_us: float = 3.5
    states_item_us: float = 2.0
    states_chunk_us: float = 1.85
    states_busy_chunk_us: float = 2.66
    chunk_grad_us: float = 21.0
    splice_step_fixed_us: float = 2.2
    splice_step_head_us: float = 0.17
    reverse_splice_step_fixed_us: float = 2.4
    reverse_splice_step_head_us: float = 0.2
    backward_cp_driver_us: float = 15.0
    # the fused kernel's rows of CTAs longest first (``backward.FUSED_LONGEST_FIRST``): its makespan in that order
    fused_longest_first: bool = False
    # CP's walks from zero by the walk's ``starts_only`` build (``backward.WALK_STARTS_ONLY``), which stores no
    # per-chunk gradient. Estimated, not measured alone (fwd+bwd with it measured 0.975x, as these constants put it),
    # from the states pass against the same rs loop without its stores
    # (1.85 against 1.08 us a chunk on one SM, 2.66 against 1.46 on a full GPU). The walk's chunk is taken 0.55 us
    # shorter (~70% of the stores' share there: the walk's store sits at a chunk's start, before the wait for its
    # inputs) and its busy chunk 0.8 us (its 32 KB a chunk and value head of HBM writes gone)
    walk_starts_only: bool = False
    # the walks from zero and the chunk states pass side by side on two streams (``flashgdn.cp.backward.OVERLAP``),
    # taken as the longer of the two instead of their sum (an A/B, the Hopper backend's CP_WALKS_BESIDE_STATES: what
    # each costs the other is not modelled; notes v0.36l)
    walks_beside_states: bool = False
    walk_starts_chunk_us: float = 2.6
    walk_starts_busy_chunk_us: float = 2.7
    # a forward with no backward after it takes the shortest segment length whose estimate is within this factor of
    # the best one (1.0: the best itself; ``SHORTER_WITHIN`` under the Hopper backend's ``CP_SHORTER_TIES``). The
    # estimates count every transition M and splice step at full price, but where a segment's M falls below
    # float32's range the transition pass and the splices leave it out (notes v0.36b), and more of them do, and more
    # output CTAs run, on shorter segments
    shorter_within: float = 1.0
    # the same, wider (``SHORTER_WITHIN_WIDE`` under the Hopper backend's ``CP_SHORTER_WIDE``), for a shorter length of
    # ``SHORTER_WIDE_MIN_CHUNKS`` or more where the best length's output pass leaves half the SMs idle (1.0: none)
    shorter_within_wide: float = 1.0

    @staticmethod
    def for_device(device: Optional[torch.device] = None, paired: bool = False, fused: bool = False,
                   skip_unread: bool = False, reuse_transitions: bool = False,
                   fused_longest_first: bool = False, walk_starts_only: bool = False,
                   shorter_within: float = 1.0, shorter_within_wide: float = 1.0,
                   walks_beside_states: bool = False) -> "CostModel":
        """The model for a CUDA device (its SM count; stage times measured on the H200), or the default;
        ``paired``/``fused``/``skip_unread``/``reuse_transitions``/``fused_longest_first``/``walk_starts_only``/
        ``walks_beside_states``: which of CP's kernels the backend runs, how the fused backward orders its CTAs and
        whether the backward's walks from zero run beside the chunk states pass."""
        flags = dict(paired=paired, fused=fused, skip_unread=skip_unread, reuse_transitions=reuse_transitions,
                     fused_longest_first=fused_longest_first, walk_starts_only=walk_starts_only,
                     shorter_within=shorter_within, shorter_within_wide=shorter_within_wide,
                     walks_beside_states=walks_beside_states)
        if device is not None and device.type == "cuda" and torch.cuda.is_available():
            return CostModel(num_sms=torch.cuda.get_device_properties(device).multi_processor_count, **flags)
        return CostModel(**flags)

    def loop_us(self, item_chunks: Union[Items, Sequence[int]], heads: int, state_only: bool = False) -> float:
        """One chunk loop over work items of the given chunk counts, each for ``heads`` value heads."""
        items = Items.of(item_chunks)
        if not items.count:
            return 0.0
        if state_only:
            item, chunk, busy = self.state_item_us, self.state_chunk_us, self.state_busy_chunk_us
        else:
            item, chunk, busy = self.forward_item_us, self.forward_chunk_us, self.forward_busy_chunk_us
        longest = item + items.longest * chunk
        total = (items.count * item + items.total * busy) * heads
        return max(longest, total / self.num_sms)

    def pairs_us(self, item_chunks: Union[Items, Sequence[int]], heads: int) -> float:
        """The paired transition pass over segments of the given chunk counts, ``heads`` value heads (b and M of
        each: 2 heads items per segment), in whole waves of its longest item."""
        segs = Items.of(item_chunks)
        return self.pair_items_us(Items(2 * segs.count, 2 * segs.total, segs.longest), heads)

    def pair_items_us(self, items: Items, heads: int) -> float:
        """The paired pass's b-or-M items (one CTA per value head each), in whole waves of the longest one."""
        longest = self.pair_item_us + items.longest * self.pair_chunk_us
        if longest <= 0:  # items that cost nothing (a model with zero pair constants) take no time
            return 0.0
        total = heads * (items.count * self.pair_item_us + items.total * self.pair_chunk_us)
        return max(1, math.ceil(total / (self.num_sms * longest) - 1e-9)) * longest

    def pass_us(self, item_chunks: Union[Items, Sequence[int]], heads: int, qk_heads: int,
                state_only: bool = False) -> float:
        """One forward (chunk plan, stage 1, chunk loop) over work items of the given chunk counts."""
        items = Items.of(item_chunks)
        if not items.count:
            return 0.0
        plan = self.plan_us + items.total * self.plan_chunk_us
        kkt = items.total * (qk_heads * self.kkt_chunk_qk_head_us + heads * self.kkt_chunk_head_us)
        return plan + kkt + self.loop_us(items, heads, state_only)


    def makespan_us(self, item_chunks: Sequence[int], heads: int, item_us: float, chunk_us: float,
                    busy_chunk_us: float, longest_first: bool = False) -> float:
        """One pass of one CTA per item and value head over items of the given chunk counts, in launch order (an
        item's ``heads`` CTAs next to each other, as the kernels' ``(Hv, items)`` grids launch them): the SMs take
        the CTAs in that order as they come free (``list_schedule``), each CTA ``item_us + chunks x chunk_us``; and
        no less than the CTAs' total at ``busy_chunk_us`` a chunk over the SMs. Past four waves the schedule is
        taken as the longest CTA (the total then sets the time anyway). ``longest_first``: the items launched in
        the order of their lengths, longest first."""
        if not len(item_chunks) or heads <= 0:
            return 0.0
        if longest_first:
            item_chunks = sorted(item_chunks, reverse=True)
        total = heads * (len(item_chunks) * item_us + sum(item_chunks) * busy_chunk_us) / self.num_sms
        if len(item_chunks) * heads > 4 * self.num_sms:
            return max(item_us + max(item_chunks) * chunk_us, total)
        return max(list_schedule([(item_us + c * chunk_us, heads) for c in item_chunks], self.num_sms), total)

    @property
    def walk_from_zero_chunk_us(self) -> float:
        """A chunk of CP's walk from zero on one SM (``walk_starts_only``: the build without per-chunk stores)."""
        return self.walk_starts_chunk_us if self.walk_starts_only else self.walk_chunk_us

    @property
    def walk_from_zero_busy_chunk_us(self) -> float:
        """A chunk of CP's walk from zero on a full GPU (``walk_starts_only`` as above)."""
        return self.walk_starts_busy_chunk_us if self.walk_starts_only else self.walk_busy_chunk_us

    def backward_gradients_us(self, item_chunks: Sequence[int], heads: int) -> Tuple[float, float]:
        """``(fused, two kernels)``: the backward's gradients on work items of the given chunk counts (launch order)
        by the fused kernel, or by the walk and then ``chunk_grad`` (every chunk and value head spread over the SMs,
        as many CTAs as chunks x heads: one SM's time each, in waves)."""
        fused = self.makespan_us(item_chunks, heads, self.fused_item_us, self.fused_chunk_us, self.fused_busy_chunk_us,
                                 self.fused_longest_first)
        walk = self.makespan_us(item_chunks, heads, self.walk_item_us, self.walk_chunk_us, self.walk_busy_chunk_us)
        grads = math.ceil(sum(item_chunks) * heads / self.num_sms) * self.chunk_grad_us
        return fused, walk + grads


def list_schedule(jobs: Sequence[Tuple[float, int]], workers: int) -> float:
    """The finish time of ``jobs`` (``(duration, copies)`` in order, each copy one worker's) taken by ``workers``
    workers in order as they come free: a heap of (free time, how many workers free then), so the cost grows with
    the jobs, not with their copies."""
    free = [(0.0, workers)]
    end = 0.0
    for duration, copies in jobs:
        while copies > 0:
            t, n = heapq.heappop(free)
            take = min(n, copies)
            if n > take:
                heapq.heappush(free, (t, n - take))
            heapq.heappush(free, (t + duration, take))
            end = max(end, t + duration)
            copies -= take
    return end


@dataclass(frozen=True)
class SegmentPlan:
    """Segments of a packed batch. ``seg_cu`` (int64, host) holds the segments' offsets (a ``cu_seqlens`` over
    segments), ``seg_seq[s]`` the sequence of segment s, ``first[n]`` the index of sequence n's first segment
    and ``count[n]`` its number of segments. ``segment_chunks`` is the segment length (None: no split)."""

    seg_cu: torch.Tensor
    seg_seq: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor
    segment_chunks: Optional[int]

    @property
    def num_segments(self) -> int:
        return int(self.seg_seq.numel())

    @property
    def split(self) -> bool:
        """Whether any sequence has more than one segment."""
        return bool((self.count > 1).any())


def split_sequences(seqlens: Sequence[int], segment_chunks: Optional[int]) -> SegmentPlan:
    """Cut every sequence longer than ``segment_chunks`` chunks into segments of that many chunks (the last
    one shorter); ``None`` keeps every sequence whole. Segment boundaries are multiples of 64 tokens from the
    sequence start, so each segment's chunks are the sequence's own chunks."""
    if segment_chunks is not None and segment_chunks < 1:
        raise ValueError(f"segment length must be >= 1 chunk, got {segment_chunks}")
    if segment_chunks is None or all(L <= segment_chunks * CHUNK for L in seqlens):
        # every sequence whole: a handful of tensor ops instead of a Python loop per sequence (the plan is made on
        # every call that has the lengths on the host)
        lengths = torch.tensor([int(L) for L in seqlens], dtype=torch.int64)
        ids = torch.arange(lengths.numel(), dtype=torch.int64)
        return SegmentPlan(seg_cu=torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]), seg_seq=ids, first=ids.clone(),
                           count=torch.ones_like(ids), segment_chunks=segment_chunks)
    bounds: List[int] = [0]
    seg_seq: List[int] = []
    first: List[int] = []
    count: List[int] = []
    pos = 0
    for n, L in enumerate(seqlens):
        first.append(len(seg_seq))
        step = L if segment_chunks is None else segment_chunks * CHUNK
        pieces = max(1, math.ceil(L / step)) if step > 0 else 1
        for i in range(pieces):
            end = pos + min(L, (i + 1) * step) if step > 0 else pos + L
            bounds.append(end)
            seg_seq.append(n)
        count.append(pieces)
        pos += L
    return SegmentPlan(
        seg_cu=torch.tensor(bounds, dtype=torch.int64),
        seg_seq=torch.tensor(seg_seq, dtype=torch.int64),
        first=torch.tensor(first, dtype=torch.int64),
        count=torch.tensor(count, dtype=torch.int64),
        segment_chunks=segment_chunks,
    )


@dataclass(frozen=True)
class SegmentIndex:
    """A plan's per-segment index tensors on the device: ``seg_cu`` (the segments' offsets, in the dtype of the
    ``cu_seqlens`` they were built from), ``seg_seq``, ``first`` and ``count`` (int64), as in ``SegmentPlan``."""

    seg_cu: torch.Tensor
    seg_seq: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor


def dense_cu_seqlens(batch: int, seqlen: int, device) -> torch.Tensor:
    """``cu_seqlens`` of ``batch`` sequences of ``seqlen`` tokens, built on ``device`` (int32 while it fits)."""
    dtype = torch.int32 if (batch + 1) * seqlen < 2 ** 31 else torch.int64
    return torch.arange(batch + 1, dtype=dtype, device=device) * seqlen


def segment_index_tensors(plan: SegmentPlan, cu_seqlens: torch.Tensor) -> SegmentIndex:
    """The plan's index tensors built on ``cu_seqlens``'s device from its values, with device ops only.

    Only host-known sizes come from the plan (the number of segments and the segment length), so nothing is
    copied between host and device and nothing synchronises: the result equals the host plan's tensors when
    ``cu_seqlens`` holds the lengths the plan was made from, and the calls can be captured in a CUDA graph.
    """
    N, S = plan.first.numel(), plan.num_segments
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() != N + 1:
        raise ValueError(f"cu_seqlens must be [N + 1] = [{N + 1}] for this plan, got {tuple(cu_seqlens.shape)}")
    dev = cu_seqlens.device
    if plan.segment_chunks is None:  # every sequence one segment
        seqs = torch.arange(N, device=dev)
        return SegmentIndex(cu_seqlens, seqs, seqs, torch.ones(N, dtype=torch.int64, device=dev))
    step = plan.segment_chunks * CHUNK
    cu = cu_seqlens.to(torch.int64)
    start = cu[:-1]
    count = ((cu[1:] - start + (step - 1)) // step).clamp_(min=1)  # an empty sequence is one empty segment
    first = torch.cumsum(count, 0) - count
    seg_seq = torch.repeat_interleave(count, output_size=S)
    # segment s of sequence n starts at cu[n] + (s - first[n]) step; the last one ends where n + 1 starts
    seg_start = (start - first * step)[seg_seq] + torch.arange(0, S * step, step, device=dev)
    seg_cu = torch.cat([seg_start, cu[-1:]]).to(cu_seqlens.dtype)
    return SegmentIndex(seg_cu, seg_seq, first, count)


def estimated_us(seqlens: Sequence[int], heads: int, segment_chunks: Optional[int], model: CostModel,
                 qk_heads: Optional[int] = None) -> float:
    """The cost model's time for one forward with the given segment length (None: without CP). ``heads`` is
    the number of value heads, ``qk_heads`` that of qk heads (None: as many as value heads, the most stage 1
    can cost)."""
    return _estimated_us(*_sequences(seqlens), heads, segment_chunks, model, qk_heads)


def _sequences(seqlens: Sequence[int]):
    """The sequences as the model sees them: each one's chunk count, their aggregate, and the tokens in all."""
    chunks = [max(1, -(-int(L) // CHUNK)) for L in seqlens]
    return chunks, Items.of(chunks), sum(int(L) for L in seqlens)


def _estimated_us(chunks: Sequence[int], seqs: Items, tokens: int, heads: int, segment_chunks: Optional[int],
                  model: CostModel, qk_heads: Optional[int]) -> float:
    """``estimated_us`` from the sequences' chunk counts (``chunks``, their aggregate ``seqs``) and token count,
    so that a plan trying several segment lengths converts the lengths once."""
    qk_heads = heads if qk_heads is None else qk_heads
    if segment_chunks is None or seqs.longest <= segment_chunks:
        return model.pass_us(seqs, heads, qk_heads)
    # segment_chunks-long segments and each sequence's remainder: the same chunks in all, and a sequence longer
    # than a segment exists, so the longest segment is a whole one
    pieces = [-(-c // segment_chunks) for c in chunks]
    segs = Items(sum(pieces), seqs.total, segment_chunks)
    steps = max(pieces) - 1
    # b and M: one state-only pass over twice the value heads (with its own stages 0 and 1 unless paired), then
    # the splice
    if model.paired:
        # the pairs loop's constants include the paired and fused driver; unfused, its index and splice set-up
        # launches come on top
        driver = 0.0 if model.fused else model.fused_launches_saved * model.launch_us
        if model.skip_unread:  # b of every segment but a sequence's last, M of those between its first and last
            run = sum(p - 1 for p in pieces) + sum(max(0, p - 2) for p in pieces)
            transitions = model.pair_items_us(Items(run, run * segment_chunks, segment_chunks), heads)
        else:
            transitions = model.pairs_us(segs, heads)
    else:
        launches = model.cp_launches - model.fused_launches_saved * model.fused
        driver = launches * model.launch_us + tokens * heads * model.cp_token_head_us
        transitions = model.pass_us(segs, 2 * heads, qk_heads, state_only=True)
    splice = model.fused_splice_step_us if model.fused else model.splice_step_us
    return driver + transitions + steps * splice + model.pass_us(segs, heads, qk_heads)


def plan_segments(
    seqlens: Optional[Sequence[int]],
    heads: int,
    cp: Union[str, int] = "auto",
    model: Optional[CostModel] = None,
    qk_heads: Optional[int] = None,
    in_between: bool = False,
) -> SegmentPlan:
    """The segments for ``cp`` ("off", "auto" or a segment length in chunks); ``seqlens`` None (lengths not
    on the host) means no split. ``heads``/``qk_heads``: value and qk heads (for the cost model). ``in_between``
    (a forward no backward follows): "auto" also tries ``IN_BETWEEN_SEGMENT_CHUNKS``, each taken only when the model
    puts it at ``IN_BETWEEN_GAIN`` of the best of the others (or of no split) or less, and with the model's
    ``shorter_within`` above 1 takes the shortest power-of-two length whose estimate is within that factor of the
    best one and whose output pass, in whole waves, is shorter than the best one's."""
    if seqlens is None:
        raise ValueError("planning context parallelism needs the sequence lengths on the host")
    if cp == "off":
        return split_sequences(seqlens, None)
    if isinstance(cp, int) and not isinstance(cp, bool):
        return split_sequences(seqlens, cp)
    if cp != "auto":
        raise ValueError(f"cp must be 'auto', 'off' or a positive int (segment length in chunks), got {cp!r}")
    model = model or CostModel()
    seqs = _sequences(seqlens)  # once for every candidate
    off_us = _estimated_us(*seqs, heads, None, model, qk_heads)
    estimates = [(_estimated_us(*seqs, heads, s, model, qk_heads), s) for s in CANDIDATE_SEGMENT_CHUNKS]
    us, best = min(estimates)
    # a gain beyond the model's error only: CP costs memory (the segments' states)
    gain = FORWARD_AUTO_GAIN if len(seqlens) * heads <= model.num_sms // 2 else AUTO_GAIN
    if not us < gain * off_us:
        us, best = off_us, None
    elif in_between and max(model.shorter_within, model.shorter_within_wide) > 1.0:
        # (the split's decision and gain stay the best estimate's) the model spreads the output pass's CTAs over the
        # SMs as a fluid; a shorter length that adds a wave gains nothing there and pays its extra transitions (16/48
        # 32768 at 128 chunks: 1.055x of 256's forward)
        best_waves = _output_wave_chunks(seqs[0], heads, best, model.num_sms)
        half_idle = _output_ctas(seqs[0], heads, best) <= model.num_sms // 2

        def within(s: int) -> float:
            wide = half_idle and s >= SHORTER_WIDE_MIN_CHUNKS
            return max(model.shorter_within, model.shorter_within_wide) if wide else model.shorter_within

        best = min(s for u, s in estimates if u <= within(s) * us
                   and (s == best or _output_wave_chunks(seqs[0], heads, s, model.num_sms) < best_waves))
    if in_between and IN_BETWEEN:
        between_us, between = min((_estimated_us(*seqs, heads, s, model, qk_heads), s)
                                  for s in IN_BETWEEN_SEGMENT_CHUNKS)
        if between_us <= IN_BETWEEN_GAIN * us:
            best = between
    return split_sequences(seqlens, best)


def _output_ctas(chunks: Sequence[int], heads: int, segment_chunks: int) -> int:
    """The output pass's CTAs on ``segment_chunks``-long segments: segments x value heads."""
    return sum(-(-c // segment_chunks) for c in chunks) * heads


def _output_wave_chunks(chunks: Sequence[int], heads: int, segment_chunks: int, num_sms: int) -> int:
    """The output pass on ``segment_chunks``-long segments in whole waves of one CTA an SM: waves times the
    longest segment's chunks."""
    ctas = _output_ctas(chunks, heads, segment_chunks)
    return -(-ctas // num_sms) * min(segment_chunks, max(chunks))


def segment_chunk_counts(chunks: Sequence[int], segment_chunks: Optional[int]) -> List[int]:
    """Every segment's chunk count in order (``split_sequences``'s segments), from the sequences' chunk counts
    (``_sequences``: one chunk at least)."""
    if segment_chunks is None:
        return list(chunks)
    out: List[int] = []
    for c in chunks:
        out.extend([segment_chunks] * (c // segment_chunks) + ([c % segment_chunks] if c % segment_chunks else []))
    return out


def backward_estimated_us(seqlens: Sequence[int], heads: int, segment_chunks: Optional[int], model: CostModel,
                          fused_allowed: bool = True, forward_chunks: Optional[int] = None) -> Tuple[float, bool]:
    """The cost model's time for the backward's stages that its segmenting changes, and whether the fused kernel
    is the faster there: ``(us, fused)``. Without a split: the forward's states at every chunk, then the gradients
    (the fused kernel, or the walk and ``chunk_grad``). With one (``cp.backward``): the transition pass (b of every
    segment but a sequence's last, M of every one but its first) and its splice, the walk of every segment from a
    zero end gradient, the reverse splice, then the same stages on the segments. Stage 1, the chunk plan and the
    group sums of dq and dk see the same chunks either way and are left out. ``forward_chunks``: the forward's
    segment length when the backward starts from the forward's segment starts (``exact.starts_from_known``): the
    forward splice then runs chains of the ratio of the lengths, or none (and the transition pass makes no b)."""
    return _backward_estimated_us(_sequences(seqlens)[0], heads, segment_chunks, model, fused_allowed,
                                  forward_chunks)


def forward_splice_steps(pieces: Sequence[int], segment_chunks: int, forward_chunks: Optional[int]) -> int:
    """The backward's forward splice's chain length in steps: each sequence's pieces less one, or, from the
    forward's starts (``exact.starts_from_known``), the ratio of the lengths less one (none when the backward's is
    a multiple of the forward's)."""
    if forward_chunks is not None:
        if segment_chunks % forward_chunks == 0:
            return 0
        if forward_chunks % segment_chunks == 0:
            return min(forward_chunks // segment_chunks, max(pieces)) - 1
    return max(pieces) - 1


def _backward_estimated_us(chunks: Sequence[int], heads: int, segment_chunks: Optional[int], model: CostModel,
                           fused_allowed: bool, forward_chunks: Optional[int] = None) -> Tuple[float, bool]:
    """``backward_estimated_us`` from the sequences' chunk counts, converted once for every candidate."""
    segs = segment_chunk_counts(chunks, segment_chunks)
    fused, two = model.backward_gradients_us(segs, heads)
    use_fused = fused_allowed and fused < two
    states = model.makespan_us(segs, heads, model.states_item_us, model.states_chunk_us, model.states_busy_chunk_us)
    us = (fused if use_fused else two) + states
    if len(segs) == len(chunks):
        return us, use_fused
    pieces = [-(-c // segment_chunks) for c in chunks]
    if model.reuse_transitions and forward_chunks == segment_chunks:
        # the forward's own segments: its pass made these M, and what it costs here is the M of the sequences' last
        # segments that it made besides (a skipping pass makes b of all but the last, M of those in between)
        transitions = 0.0
        if model.skip_unread:
            between = sum(p - 1 for p in pieces) + sum(max(0, p - 2) for p in pieces)
            runs = 2 * sum(p - 1 for p in pieces)
            transitions = (model.pair_items_us(Items(runs, runs * segment_chunks, segment_chunks), heads)
                           - model.pair_items_us(Items(between, between * segment_chunks, segment_chunks), heads))
    else:
        # b of all but the last, M of all but the first; no b when the starts are gathered from the forward's
        gathered = forward_chunks is not None and segment_chunks % forward_chunks == 0
        runs = (1 if gathered else 2) * sum(p - 1 for p in pieces)
        transitions = model.pair_items_us(Items(runs, runs * segment_chunks, segment_chunks), heads)
    steps = max(pieces) - 1
    forward_steps = forward_splice_steps(pieces, segment_chunks, forward_chunks)
    splices = (forward_steps * (model.splice_step_fixed_us + heads * model.splice_step_head_us)
               + steps * (model.reverse_splice_step_fixed_us + heads * model.reverse_splice_step_head_us))
    walk_from_zero = model.makespan_us(segs, heads, model.walk_item_us, model.walk_from_zero_chunk_us,
                                       model.walk_from_zero_busy_chunk_us)
    if model.walks_beside_states:  # only the longer of the two passes on the critical path
        walk_from_zero = max(0.0, walk_from_zero - states)
    return us + transitions + splices + walk_from_zero + model.backward_cp_driver_us, use_fused


class BackwardPlan(NamedTuple):
    """The backward's segments (None: the sequences themselves) and whether it runs the fused kernel on them (None:
    the backend decides, as for a ``cp`` the caller fixed)."""

    plan: Optional[SegmentPlan]
    fused: Optional[bool]


def plan_backward(seqlens: Sequence[int], heads: int, cp: Union[str, int] = "auto", model: Optional[CostModel] = None,
                  fused_allowed: bool = True, forward_chunks: Optional[int] = None) -> BackwardPlan:
    """The backward's own segments for ``cp`` ("off", "auto" or a segment length in chunks, as ``plan_segments``).
    The backward recomputes its segments' start states itself (``cp.backward``), so it need not split as the
    forward did: its gradients cost ~5x a forward chunk, and the fused kernel wants about one CTA per SM, so
    "auto" picks, by ``backward_estimated_us``, among the forward's candidate lengths, the one that gives every
    sequence about SMs / (sequences x value heads) segments, and no split. ``forward_chunks``: the forward's
    segment length, when the backward starts from the forward's segment starts (``backward_estimated_us``)."""
    if cp == "off":
        return BackwardPlan(None, None)
    if isinstance(cp, int) and not isinstance(cp, bool):
        plan = split_sequences(seqlens, cp)
        return BackwardPlan(plan if plan.split else None, None)
    if cp != "auto":
        raise ValueError(f"cp must be 'auto', 'off' or a positive int (segment length in chunks), got {cp!r}")
    model = model or CostModel()
    chunks, seqs, _ = _sequences(seqlens)  # once for every candidate
    longest = max(1, seqs.longest)
    per_sequence = model.num_sms // max(1, heads * len(seqlens))
    candidates = set(CANDIDATE_SEGMENT_CHUNKS)
    if per_sequence >= 2:  # no shorter than the forward's shortest (where the transition pass was fitted)
        candidates.add(max(min(CANDIDATE_SEGMENT_CHUNKS), -(-longest // per_sequence)))
    off_us, off_fused = _backward_estimated_us(chunks, heads, None, model, fused_allowed)
    best = None
    for c in sorted(candidates):
        if c >= longest:  # no sequence would split
            continue
        us, fused = _backward_estimated_us(chunks, heads, c, model, fused_allowed, forward_chunks)
        if best is None or us < best[0]:
            best = (us, c, fused)
    # a clear gain only, as in the forward; any gain where it also drops the per-chunk state gradients
    gain = 1.0 if BACKWARD_FUSED_ANY_GAIN and best is not None and best[2] and not off_fused else AUTO_GAIN
    if best is None or best[0] >= gain * off_us:
        return BackwardPlan(None, off_fused)
    return BackwardPlan(split_sequences(seqlens, best[1]), best[2])


def parse_cp(cp) -> Union[str, int]:
    """The ``cp=`` argument checked: "auto", "off" or a segment length in chunks (int >= 1)."""
    if isinstance(cp, bool):
        raise TypeError(f"cp must be 'auto', 'off' or a positive int (segment length in chunks), got {cp!r}")
    if isinstance(cp, int):
        if cp < 1:
            raise ValueError(f"cp must be 'auto', 'off' or a positive int (segment length in chunks), got {cp}")
        return cp
    if isinstance(cp, str):
        if cp in ("auto", "off"):
            return cp
        if cp.isdigit() and int(cp) >= 1:
            return int(cp)
        raise ValueError(f"cp must be 'auto', 'off' or a positive int (segment length in chunks), got {cp!r}")
    raise TypeError(f"cp must be 'auto', 'off' or a positive int (segment length in chunks), got {type(cp).__name__}")


def host_seqlens(cu_seqlens_cpu: Optional[torch.Tensor]) -> Optional[List[int]]:
    """Sequence lengths from the host copy of cu_seqlens; None without one (reading the device copy would be
    a device sync)."""
    if cu_seqlens_cpu is None:
        return None
    cu = cu_seqlens_cpu.tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def plan_for_problem(p, auto: bool, model: Optional[CostModel] = None,
                     in_between: bool = False) -> Optional[SegmentPlan]:
    """The segments a backend runs ``p`` (a ``GDNProblem``) with, or None for no split. ``auto`` says whether
    this backend lets ``cp="auto"`` decide by the cost model (otherwise "auto" means off); ``in_between``: no
    backward follows (``plan_segments``)."""
    seqlens = _problem_seqlens(p, auto)
    if seqlens is None:
        return None
    return _plan_segments_cached(seqlens, p.Hv, p.cp, model or CostModel.for_device(p.device), p.Hqk, in_between)


def _problem_seqlens(p, auto: bool) -> Optional[Tuple[int, ...]]:
    """The sequence lengths a plan of ``p`` is made from, or None where no plan is made: cp="off", "auto" where the
    backend does not plan (``auto`` False) or without the lengths on the host. A segment length without them is an
    error."""
    if p.cp == "off" or (p.cp == "auto" and not auto):
        return None
    seqlens = [p.T] * p.B if p.cu_seqlens is None else host_seqlens(p.cu_seqlens_cpu)
    if seqlens is None:
        if p.cp == "auto":
            return None
        raise ValueError(f"cp={p.cp} needs the sequence lengths on the host: pass cu_seqlens_cpu (a host copy of "
                         "cu_seqlens), or a CPU cu_seqlens")
    return tuple(int(L) for L in seqlens)


@functools.lru_cache(maxsize=256)
def _plan_segments_cached(seqlens: Tuple[int, ...], heads: int, cp, model: CostModel,
                          qk_heads: int, in_between: bool = False) -> Optional[SegmentPlan]:
    # every layer of a model asks for the plan of the same batch: its host work (~1 ms for 500 sequences) once
    plan = plan_segments(seqlens, heads, cp, model, qk_heads=qk_heads, in_between=in_between)
    return plan if plan.split else None


def backward_plan_for_problem(p, auto: bool, model: Optional[CostModel] = None,
                              fused_allowed: bool = True, forward_chunks: Optional[int] = None) -> BackwardPlan:
    """``plan_for_problem`` for the backward (``plan_backward``): its own segments under cp="auto", the forward's
    under a segment length, none under "off" or without the lengths on the host. ``forward_chunks``: as
    ``plan_backward``'s."""
    seqlens = _problem_seqlens(p, auto)
    if seqlens is None:
        return BackwardPlan(None, None)
    return _plan_backward_cached(seqlens, p.Hv, p.cp, model or CostModel.for_device(p.device), fused_allowed,
                                 forward_chunks)


@functools.lru_cache(maxsize=256)
def _plan_backward_cached(seqlens: Tuple[int, ...], heads: int, cp, model: CostModel,
                          fused_allowed: bool, forward_chunks: Optional[int] = None) -> BackwardPlan:
    # a training loop asks again for the shapes it has seen: the plan's few hundred microseconds of host work once
    return plan_backward(seqlens, heads, cp, model, fused_allowed, forward_chunks)
