"""Host side of the Hopper backward: the stages, run in order (``hopper_backward``).

Pipeline, mirroring the forward (``forward.py``) and following ``reference/chunked_backward.py``:
  0, 1. ``chunk_plan`` and ``kkt_inverse`` with ``store_inverse``: the forward's slots, g~ and Ag again, and the
                          ungated A for dL = -A^T dA A^T
  1a. the forward states  the rs loop's state-only variant storing S at every chunk's start (recomputed, so
                          autograd saves no states; io dtype)
  1b. ``state_grad_walk``  per (sequence, value head), chunks last to first: the state gradient at the end of
                          every chunk (io dtype) and at every sequence's start (d initial state, float32)
  2.  ``chunk_grad``      per (chunk, value head): dv, dq and dk per value head, dg, dbeta; q and k gradients are
                          then summed over each qk head's group (when it has more than one value head)
  1b + 2, ``fused_backward``: the walk and ``chunk_grad`` in one kernel, per (sequence, value head), where
                          ``fused_backward_wanted`` finds it faster (``FUSED_BACKWARD``); the per-chunk state
                          gradients then never reach HBM

``HopperBackwardStages`` is these stages in the form ``flashgdn.cp.backward`` drives, so the backward runs with
exact context parallelism (every segment's walk in parallel) on a segment plan of the backward's own
(``flashgdn.cp.plan_backward``: its cost model, with the fused kernel's, picks the segments and the kernel).

Autograd saves the inputs alone (q, k, v, g, beta, the initial state); the backward's largest buffers are the
chunk states and their gradients, ``[S, Hv, V, K]`` in the io dtype each (S = number of chunk slots, about T/64),
A and Ag (``[S, Hv, 64, 64]``, io dtype), and with GVA the per-value-head dq and dk (io dtype); for the fused
kernel the states leave out each sequence's first, which waits in the memory of its d(initial state) output
(``FIRST_STATES_APART``). Like the forward, everything here is device-side work with shapes known on the host: no
synchronisation, capturable in a CUDA graph.
"""
import os
from typing import NamedTuple, Optional, Tuple

import torch

from .common import CHUNK, tl_dtype
from .forward import _output, host_offsets, hopper_stage1, packed_offsets, lean_state_option


#: ``chunk_grad`` loading its eight tiles by cp.async, all in flight before one wait, instead of through registers
#: (``chunk_grad.py``). On the H200 it took 0.917x to 0.952x the time of the register-staged loads with the same
#: bits out (``stages-hopper-v0.6c-bwd.json``, ``gpu-ab-v0.6c.log``): the default.
#: FLASHGDN_HOPPER_CHUNK_GRAD_ASYNC_LOADS=0 turns it off.
CHUNK_GRAD_ASYNC_LOADS = os.environ.get("FLASHGDN_HOPPER_CHUNK_GRAD_ASYNC_LOADS", "1") == "1"

#: ``chunk_grad`` with gamma_i and d_i computed once per row into registers instead of per element from
#: shared memory, and Gam once instead of three times (``chunk_grad.py``). On the H200 it took 0.960x to 0.970x the
#: time of the per-element factors with the same bits out (``stages-hopper-v0.7a-bwd.json``, ``gpu-suite-v0.7a.log``):
#: the default. FLASHGDN_HOPPER_CHUNK_GRAD_ROW_FACTORS=0 turns it off.
CHUNK_GRAD_ROW_FACTORS = os.environ.get("FLASHGDN_HOPPER_CHUNK_GRAD_ROW_FACTORS", "1") == "1"

#: ``chunk_grad`` with dg's reverse cumsum by a scan of a [2, C] tile instead of a [C, C] masked sum
#: (``chunk_grad.py``). On the H200 it took 0.979x to 0.990x the time of the masked sum, dg within 1e-5 of it and
#: every other gradient the same bits (``stages-hopper-v0.7a-bwd.json``, ``gpu-suite-v0.7a.log``): the default.
#: FLASHGDN_HOPPER_CHUNK_GRAD_SCAN_DG=0 turns it off.
CHUNK_GRAD_SCAN_DG = os.environ.get("FLASHGDN_HOPPER_CHUNK_GRAD_SCAN_DG", "1") == "1"

#: ``chunk_grad`` writing dv, dq and dk through a shared tile that is dead by then, in 16-byte stores,
#: instead of from the accumulators in 4-byte ones (the profile's LG-queue stalls, ``chunk_grad.py``). On the H200
#: it took 0.901x to 0.942x the time of the 4-byte stores with the same bits out (``stages-hopper-v0.7b-bwd.json``,
#: ``gpu-suite-v0.7b.log``): the default. FLASHGDN_HOPPER_CHUNK_GRAD_WIDE_STORES=0 turns it off.
CHUNK_GRAD_WIDE_STORES = os.environ.get("FLASHGDN_HOPPER_CHUNK_GRAD_WIDE_STORES", "1") == "1"

#: ``chunk_grad`` adding dq and dk into one zeroed [T, Hqk, K] output with bf16x2 atomics when each qk head has
#: two value heads, instead of writing them per value head for a group sum after it (``chunk_grad.py``): two
#: addends onto zero give RN(a + b) in either order, the same bits as the sum (deterministic), without the sum's
#: pass and its 2 x [T, Hv, K] buffers. On the H200 (``stages-hopper-v0.7e-bwd.json``) ``chunk_grad`` took 1.29x its
#: time with them (16/32; the atomics' throughput), more than the group sum it saves, while a training step's peak
#: was 0.90x (``backward/memory-peak-v0.7e*``): a memory option, off. FLASHGDN_HOPPER_CHUNK_GRAD_PAIR_SUMS=1.
CHUNK_GRAD_PAIR_SUMS = os.environ.get("FLASHGDN_HOPPER_CHUNK_GRAD_PAIR_SUMS", "0") == "1"

#: ``chunk_grad``'s blocks taken value heads first (the linear block id mapped to value head fastest), so that the
#: value heads of one qk head are neighbours and read their q and k tiles while they are in L2 (``chunk_grad.py``).
#: An A/B, off: as a grid of (value heads, slots) it took 0.979x to 1.001x the time (``stages-hopper-v0.9b-bwd.json``,
#: ``-v0.9c-bwd.json``), but that grid caps the slots at 65535 (4.2M tokens); mapped from the linear id on a grid of
#: (slots, value heads) it was measured once, in a training step on 16/32 4096x8, at 2.657 ms against 2.566 for that
#: grid and 2.60 chunks first (``backward/step-kernels-v0.9d.json``, ``-v0.9c``, ``-v0.8a``): no gain shown. The same
#: bits out (``gpu-ab-v0.9b.log``, ``gpu-tests-v0.9d.log``). FLASHGDN_HOPPER_CHUNK_GRAD_HEADS_INNER=1.
CHUNK_GRAD_HEADS_INNER = os.environ.get("FLASHGDN_HOPPER_CHUNK_GRAD_HEADS_INNER", "0") == "1"

#: dq and dk summed over each qk head's value heads by one kernel over both (``group_sum.py``: 16-byte vectors,
#: float32 sums in head order) instead of torch's ``sum`` on each, whose two reduce kernels took 0.54 ms of 16/32
#: 4096x8's 4.6 ms training step. On the H200 the kernel takes 0.187 ms there (at HBM speed), and the backward
#: 0.92x (16/64: 0.98x) of its time with torch's sums (``stages-hopper-v0.8a-bwd.json``,
#: ``backward/step-kernels-v0.8a.json``): the default. FLASHGDN_HOPPER_GROUP_SUM_KERNEL=0 turns it off.
GROUP_SUM_KERNEL = os.environ.get("FLASHGDN_HOPPER_GROUP_SUM_KERNEL", "1") == "1"

#: the states pass and the walk send every chunk's S^T / dS'^T through shared memory with one TMA store per
#: warpgroup instead of element-wise stores from registers (the profile has those stores at 14% of the walk's
#: stall samples, and the states pass at 2.4x the time of the same loop without them). On the H200 the states pass
#: took 0.52x to 0.59x and the walk 0.56x to 0.70x of their time with element-wise stores
#: (``stages-hopper-v0.6-bwd.json``): the default. FLASHGDN_HOPPER_STAGED_STATE_STORES=0 turns it off.
STAGED_STATE_STORES = os.environ.get("FLASHGDN_HOPPER_STAGED_STATE_STORES", "1") == "1"

#: the walk and ``chunk_grad`` as one kernel (``fused_backward.py``): one CTA per (sequence or segment, value head)
#: walks the chunks with the state gradient in registers and makes every gradient on the way, so the per-chunk state
#: gradients never reach HBM. "auto" (the default) takes it where ``fused_backward_wanted``'s cost comparison says it
#: is faster (enough CTAs, no item much longer than the rest); "1" always, "0" never (FLASHGDN_HOPPER_FUSED_BACKWARD).
#: Not in the precise mode (the walk's three-term operands), which keeps the two kernels.
_FUSED = os.environ.get("FLASHGDN_HOPPER_FUSED_BACKWARD", "auto")
FUSED_BACKWARD = "auto" if _FUSED == "auto" else _FUSED == "1"


#: the states pass leaves every sequence's (or segment's) first chunk state out of the per-slot states for the fused
#: kernel, and writes it into the fused kernel's d(initial state) buffer instead, which the kernel reads it from in
#: its last chunk step before writing the gradient over it (``fused_backward.py``, ``first_apart``): the same bits,
#: one [Hv, V, K] tile per sequence off the backward's peak (the states tensor has S - N slots where every sequence
#: is known on the host to be non-empty, else S with the first slots unwritten). The bwd set's eight-sequence 16/32
#: mix peaked 0.2% above FlashQLA's memory by its partial chunks' slots (docs/hopper-notes.md).
#: FLASHGDN_HOPPER_FIRST_STATES_APART=0: every chunk state in the states tensor.
FIRST_STATES_APART = os.environ.get("FLASHGDN_HOPPER_FIRST_STATES_APART", "1") == "1"

#: the fused kernel's rows of CTAs take the sequences (or segments) longest first (``fused_backward.py``'s
#: ``longest_first``, beside FIRST_STATES_APART): the GPU starts CTAs in grid order as SMs come free, so in the
#: sequences' own order a long one may start only after short ones have taken the SMs, and the kernel then ends a
#: long CTA after them. Longest first (LPT scheduling) it tends to its longest CTA. The same bits. The cost model
#: (``CostModel.fused_longest_first``) puts the fused kernel at 0.81x-0.93x of its time on seven of the bwd set's
#: 32 shapes (uneven mixes with more CTAs than SMs) and unchanged elsewhere. An A/B (notes v0.34b), off: on an H100
#: fwd+bwd 0.92x-0.98x on seven uneven mixes of the bwd set, up to 4% slower on most of the rest (notes "The five
#: measured"). FLASHGDN_HOPPER_FUSED_LONGEST_FIRST=1 turns it on.
FUSED_LONGEST_FIRST = os.environ.get("FLASHGDN_HOPPER_FUSED_LONGEST_FIRST", "0") == "1"

#: the fused kernel reads A alone and makes Ag from it (``fused_backward.py``'s ``ag_from_a``: its producer gates A's
#: tile in place by stage 1's expression), so that stage 1's Ag is let go before the kernel's outputs are allocated:
#: 128 B per token and value head (Ag's 64 x 64 tile a chunk) off the training step's peak where it holds A, Ag, the
#: chunk states and dq, dk and dv per value head (measured on an H100, notes "v0.37a measured": 4/16 131072x1 3621 ->
#: 3365 MiB, against FlashQLA's 3505). Ag then comes from A rounded to the io dtype: within one rounding of stage 1's
#: Ag, not the same bits. On an H100 fwd+bwd took 1.06x with one warp gating (v0.37a) and 1.048x-1.069x with the
#: producer's four (v0.37b: the group's signal 5.7k cycles after its release instead of 9.4k, but the median chunk
#: step still 1.12x, notes "v0.37b measured"), where FUSED_PAIR_SUMS in groups of four takes more off the peak at
#: 0.968x the time. An A/B, off; FLASHGDN_HOPPER_FUSED_AG_FROM_A=1 turns it on.
FUSED_AG_FROM_A = os.environ.get("FLASHGDN_HOPPER_FUSED_AG_FROM_A", "0") == "1"

#: context parallelism's walks from zero (``flashgdn.cp.backward``'s step 2) by the walk's ``starts_only`` build,
#: which writes each segment's start gradient (D) alone: the other build also stores dS'^T at the end of every chunk,
#: 32 KB a chunk and value head that the walks from zero throw away, with a TMA store waited for on the chain of
#: each chunk, and an ``[S, Hv, V, K]`` tensor allocated for it beside the states pass. The same bits. The cost model
#: (``CostModel.walk_starts_only``, estimated from the states pass with and without its stores) put the walk from
#: zero at ~0.83x of its time and fwd+bwd at 0.97-0.98x on split shapes; measured on an H100 (notes v0.35a,
#: results/h100/v0.35): fwd+bwd 0.975x on the cp set's 2/4-8/16 shapes (0.968x-0.988x), 0.98x on the bwd set, the
#: same bits on every shape. On by default; FLASHGDN_HOPPER_WALK_STARTS_ONLY=0 runs the walk with its stores.
WALK_STARTS_ONLY = os.environ.get("FLASHGDN_HOPPER_WALK_STARTS_ONLY", "1") == "1"

#: beside WALK_STARTS_ONLY, each walk from zero covers only a segment's first chunks, up to where a bound from the
#: inputs (``flashgdn.cp.bounds.walk_stop_chunks``: scale |q_t| |dO_t| of each later token carried back to the
#: segment's start by the per-token transition bounds) puts what the later tokens owe its start gradient below
#: e^-88: D is then what it was up to entries below float32's smallest normal number. With the benchmark's gates
#: (~-3.2 a chunk) a walk covers ~30 chunks whatever the segment's length. The bound reads dO, on the walks' stream.
#: An A/B (notes v0.35c), off: the same bits, 1.30x the cp set's fwd+bwd on an H100, the bound's read of dO costing
#: more than the walks save (notes "The five measured"). FLASHGDN_HOPPER_WALK_EARLY_STOP=1 turns it on.
WALK_EARLY_STOP = os.environ.get("FLASHGDN_HOPPER_WALK_EARLY_STOP", "0") == "1"

#: WALK_EARLY_STOP's stop made from per-chunk terms instead of a PyTorch pass over the tokens: ``chunk_emits.py``
#: bounds what each chunk's outputs add to a state gradient (reading q, k and dO), and its ``walk_covers`` kernel sums
#: those with stage 1's chunk bounds (``chunk_bounds``) over each segment's chunks, a warp an item (PyTorch
#: counterpart ``flashgdn.cp.bounds.segment_walk_stops``; v0.36j made the count by PyTorch ops, v0.36k by that
#: kernel). All of it on the walks' stream, beside the chunk states pass; the walk is the ``early_stop`` build, so D
#: is what it was up to entries below float32's smallest normal number. Only where the longest segment has WALK_STOP_MIN_CHUNKS
#: chunks or more (known from the host's offsets): the emission pass reads dO, as many bytes as the walk's own read,
#: and a walk over a short segment has little to leave out. Exact: the same bits on every shape measured. With the
#: count by PyTorch ops (v0.36j) fwd+bwd took 0.984x-1.056x on an H100; with the count by a kernel (v0.36k) 0.955x-0.999x
#: on ten shapes past the gate, 0.978x their geometric mean (notes "Measured on 2e10422"): the default.
#: FLASHGDN_HOPPER_WALK_STOP_IN_KERNEL=0 turns it off.
WALK_STOP_IN_KERNEL = os.environ.get("FLASHGDN_HOPPER_WALK_STOP_IN_KERNEL", "1") == "1"

#: the shortest longest segment (chunks) at which WALK_STOP_IN_KERNEL applies; FLASHGDN_HOPPER_WALK_STOP_MIN_CHUNKS
#: sets it (0: every split plan)
WALK_STOP_MIN_CHUNKS = int(os.environ.get("FLASHGDN_HOPPER_WALK_STOP_MIN_CHUNKS", "128"))


def walk_stop_in_kernel(seg_cu_cpu) -> bool:
    """Whether the walks from zero over the segments of host offsets ``seg_cu_cpu`` stop where stage 1's and the
    emission pass's terms say (WALK_STOP_IN_KERNEL, and the longest segment WALK_STOP_MIN_CHUNKS chunks or more);
    never without the host's offsets."""
    if not WALK_STOP_IN_KERNEL or seg_cu_cpu is None or seg_cu_cpu.shape[0] < 2:
        return False
    return longest_chunks(seg_cu_cpu) >= max(WALK_STOP_MIN_CHUNKS, 1)


def longest_chunks(cu_cpu) -> int:
    """The chunks of the longest sequence (or segment) of host offsets ``cu_cpu``."""
    if cu_cpu.shape[0] < 2:
        return 0
    return int((cu_cpu[1:] - cu_cpu[:-1]).max() + CHUNK - 1) // CHUNK


def fused_longest_first() -> bool:
    """Whether the fused kernel the backward builds takes its rows longest first: FUSED_LONGEST_FIRST, where its
    build has first_apart (FIRST_STATES_APART) to carry it. What the cost models are told."""
    return FUSED_LONGEST_FIRST and FIRST_STATES_APART


class FirstStatesApart(NamedTuple):
    """The chunk states as the fused kernel takes them with ``first_apart``: ``states [S - shift N, Hv, V, K]``,
    every chunk but each sequence's first; ``ds_start`` the fused kernel's d(initial state) output ``[N, Hv, K, V]``
    float32, whose memory holds the first chunk states until the kernel overwrites it; ``shift`` 0 or 1."""
    states: torch.Tensor
    ds_start: torch.Tensor
    shift: int


def first_apart_shift(cu_cpu) -> int:
    """1 where the host copy of the offsets shows no empty sequence (chunk c >= 1 of sequence n is then state
    ``first_slot[n] + c - (n + 1)``: S - N states), else 0 (the slots' own numbering, S states)."""
    if cu_cpu is None:
        return 0
    cu = torch.as_tensor(cu_cpu, dtype=torch.int64)
    return int(bool((cu[1:] > cu[:-1]).all()))


def _auto_switch(name: str):
    """A build switch read from the environment: "auto" (unset: ``fused_backward_options`` decides by the head
    count), or True/False for "1"/"0"."""
    value = os.environ.get(name, "auto")
    return "auto" if value == "auto" else value == "1"


#: the fused kernel's gate side waits for Q K^T alone and releases P before it waits for K S (``fused_backward.py``,
#: ``p_first``): the v0.15d trace has the value side waiting 3.2k cycles of a 23k step for P, of which K S, issued
#: beside Q K^T and twice its work, is about a third. Predicted: ~1k cycles off the step (~4%), the same bits out.
#: Measured alone: the same bits, and within 1.5% of the default either way (``stages-hopper-v0.16b-bwd-p1g0.json``).
#: Taken with ``lean_gates`` (below). FLASHGDN_HOPPER_FUSED_P_FIRST=auto|1|0.
FUSED_P_FIRST = _auto_switch("FLASHGDN_HOPPER_FUSED_P_FIRST")

#: the fused kernel's gate side gates P, E and dQK with g~ read into register fragments of its threads' rows and
#: columns, instead of two shared-memory loads per element (``fused_backward.py``, ``lean_gates``; as the forward's
#: output path since v0.13c). The v0.15d trace has P out 2.2k cycles after Q K^T and K S are done, while the value
#: side waits for it, and E to dQK take 4.9k on the gate side's path to dKK. Predicted: a few hundred cycles off P
#: and off dKK, the same bits out (two more values of the gate side spilled, stored and reloaded once a chunk).
#: Measured with P_FIRST: the same bits; 10-12% off the kernel on 2/8 32768x1 and 2/8 1024x8, 0-3% on at 16/32 and
#: 16/64 (``stages-hopper-v0.16a-bwd-p1g1.json``). FLASHGDN_HOPPER_FUSED_LEAN_GATES=auto|1|0.
FUSED_LEAN_GATES = _auto_switch("FLASHGDN_HOPPER_FUSED_LEAN_GATES")

# "auto" takes both options above wherever the fused kernel's gate side makes P itself (no ``p_given``): below
# ``FUSED_P_GIVEN_MIN_HV`` value heads, or with the P pass switched off or the cluster sum on. A training step's
# kernels on the backward's CP plans (one partial wave of the fused kernel, ``backward/step-kernels-v0.16o-gates{0,1}
# .json``) measured 0.955x-1.0x at 1/4, 2/4, 4/8 and 8/16 (8192x1 to 131072x1) and 1.011x and 1.017x at 16/32, which
# set the bound at 16 value heads then. But where the gate side makes P the builds without them are serialised by
# ptxas (C7512, too few registers for the wgmma pipeline) in the code that runs, compiled with fast math: with no
# option at 2/8 (at v0.16o too), 4/16, 16/16 and 8/24, and with the fold (``fold_mma``, which the operator built from
# 17 to 31 value heads) at 8/24, 12/24, 8/32 and 16/32 (notes v0.32c, which found it when the compile report moved
# onto the library's flags); no build with them is. Where P is given the builds without them are not serialised
# (16/32, 8/32, 16/48).

#: the fused kernel sums dq and dk over each qk head's value heads itself (``fused_backward.py``, ``cluster_sum``):
#: the group's CTAs run as one thread-block cluster and exchange their bf16 rows through shared memory, so neither
#: the per-value-head dq and dk (2 x (group - 1) / group of 256 B per token and value head at a training step's peak)
#: nor the group-sum pass (5-7% of the backward's kernels, notes "What limits the backward after v0.17") remain; the
#: same additions in the same order, so the same bits. For groups of 2 to ``CLUSTER_SUM_MAX_GROUP``. A memory
#: option, off: on the H200 the bwd set's fwd+bwd takes 1.08x the time (0.99x-1.23x, most on 16/32) at 0.86x-0.88x
#: the peak memory wherever the fused kernel runs (``backward/cluster-v0.18e-{0,1}.json``; the kernel alone
#: 1.25x-1.57x, ``fused-cluster-v0.18e.json``; five builds in notes v0.18a-e), and on CP segments of the cp set's
#: Hqk = Hv / 4 shapes 1.29x-1.47x at 0.79x-0.80x (``cluster-cp-quarter-v0.18e-*``).
#: FLASHGDN_HOPPER_FUSED_CLUSTER_SUM=1|0.
FUSED_CLUSTER_SUM = os.environ.get("FLASHGDN_HOPPER_FUSED_CLUSTER_SUM", "0") == "1"

#: the fused kernel adds each value head's dq and dk rows into one zeroed output per pair of value heads (heads 2p and
#: 2p + 1, of one qk head since the group is even) by 16-byte vector reductions in L2 (``fused_backward.py``,
#: ``pair_sums``), instead of storing them per value head: with two addends onto zero the sum is RN(a + b) in
#: either order, so deterministic, and in a group of two the group sum's value, with no group-sum pass and half the
#: per-value-head dq and dk at the training step's peak. On the H200 (notes v0.26a, ``backward/pairs-ab-v0.26a.*``,
#: ``memory-peak-v0.26a-pairs{0,1}.*``): the same bits on all 32 bwd-set shapes (every one a group of two), fwd+bwd
#: 0.994x (0.977x-1.006x; 0.98x at 4/8 and 8/16, ~1.0x at 16/32, where the fused kernel loses about what the pass
#: cost), the peak 256 MiB lower at 16/32 (1835.5 -> 1579.5 MiB on the eight-sequence mix, 0.86x). In larger even
#: groups the pair sums are rounded to the io dtype before their sum, which adds that rounding to dq and dk (2.8e-3
#: against the two-kernel backward at 2/8, where the group sum gives under 2e-3; on the bars against float64). In
#: groups of four on an H100 (notes "v0.37c measured", ``h100/v0.37/pairs-quarter-*``): fwd+bwd 0.968x on the cp
#: set's 27 Hqk = Hv / 4 shapes (0.943x-1.004x), the peak 0.77x-0.95x FlashQLA's on all 27 (3621 -> 3109 MiB at 4/16
#: 131072x1); beside a given P from 32 value heads (notes "v0.37d measured", ``h100/v0.37/pairs-given-*``, where
#: ``fold_mma`` comes with it) 0.948x on twelve 8/32 and 16/64 shapes (0.933x-0.973x), the peak 0.87x (16/64 32768x1
#: 3880 -> 3368 MiB). "auto" (the default) takes it for groups of two and four, where it was measured
#: (``_pair_sums_by_default``). FLASHGDN_HOPPER_FUSED_PAIR_SUMS=auto|1 (every even group)|0.
FUSED_PAIR_SUMS = _auto_switch("FLASHGDN_HOPPER_FUSED_PAIR_SUMS")

#: with ``pair_sums``, the fused kernel's zeroed dq and dk (2 x 128 MiB at 16/32 on 32768 tokens: ~0.08 ms of memset)
#: are allocated when the chunk states are asked for, and zeroed on a stream of their own while the states pass runs
#: (the states pass is bound by its chunk steps, not by HBM, and leaves room on the SMs for the memset's small
#: blocks); the fused kernel's stream waits for them. On the H200 (notes v0.26b, ``backward/zeros-ab-v0.26b.*``): the
#: same bits, fwd+bwd 0.991x at 16/32 and 8/16 (0.984x-0.997x), the memsets off the critical path (0.081 ms in order
#: on 16/32 32768x1, ``backward/step-kernels-v0.26b-zeros{0,1}.*``). FLASHGDN_HOPPER_PAIR_ZEROS_ASIDE=1|0 (0: zeroed
#: in order, right before the fused kernel).
PAIR_ZEROS_ASIDE = os.environ.get("FLASHGDN_HOPPER_PAIR_ZEROS_ASIDE", "1") == "1"

#: the gated scores P of every chunk made by a pass of their own (``gated_scores.py``) right before the fused kernel,
#: which loads them with its second group instead of making them at the start of each chunk step (``fused_backward``'s
#: ``p_given``): the value side's wait for P was on the step's critical path. The same bits (the same product and
#: expression); 128 bytes per token and value head more, live from the states pass (P is made beside it, on a stream
#: of its own, when the stages know the op's scale) to the end of the fused kernel. The fused kernel alone, with P
#: from PyTorch: 0.891x at 16/32 8 x 4096, 0.955x at 8/16 8 x 8192 (notes v0.28a); fwd+bwd on the bwd set (notes
#: v0.28b, ``backward/p-given-ab-v0.28b.*``): 0.983x at 16/32 (0.950x-1.004x), 0.999x at 8/16 (0.980x-1.018x), and
#: 1.00x-1.014x at 2/4 and 4/8, where the pass costs what the kernel gains. "auto" takes it from
#: ``FUSED_P_GIVEN_MIN_HV`` value heads. FLASHGDN_HOPPER_FUSED_P_GIVEN=auto|1|0.
FUSED_P_GIVEN = _auto_switch("FLASHGDN_HOPPER_FUSED_P_GIVEN")
FUSED_P_GIVEN_MIN_HV = 32

#: the fused kernel's value side takes <dS', S> (dg's g~_last term) from two wgmma groups, the diagonals of
#: dS'^T[r] (S^T[r])^T over V's halves r, instead of an element-wise fold of the two [128, 128] bf16 tiles
#: (``fused_backward.py``, ``fold_mma``): v0.28a's profile puts ~520 of the value side's ~3080 instructions a step in
#: that fold (256 2-byte shared reads a thread, their unpacks and products), against ~2 MFLOP more on the tensor pipe
#: (30% busy). Beside ``p_given`` the gate side makes it, into Q K^T's accumulator (free there; on the value side
#: ptxas serialised the kernel's wgmma for want of registers, C7512), while the value side goes straight on to P^T dO.
#: The same products of bf16 values summed in another order: dg moves by float32 rounding (at most 2.2e-7 relative),
#: nothing else. On the H200 (notes v0.30a): the kernel alone 0.931x-0.984x (``backward/fold-mma-options-v0.30a.*``);
#: fwd+bwd on/off 0.944x-0.980x on every bwd-set and cp-set shape below 32 value heads where the fused kernel runs
#: (``backward/fold-mma-ab-*-v0.30a.*``). Beside ``p_given`` (notes v0.30b), by the kernel's duration under Nsight
#: Compute: 0.86x at 16/32 and 0.89x at 32/64, where ``pair_sums`` keeps the value side the longer path, and 1.00x at
#: 8/32, whose gate side is the longer one (``profiles/backward-v0.30b-fused-*``); fwd+bwd 0.961x on the bwd set's
#: 16/32 shapes (``backward/fold-gates-ab-bwd-v0.30b.*``). "auto" (the default) takes it wherever the cluster sum is
#: off (not measured together), and beside ``p_given`` only with ``pair_sums``.
#: FLASHGDN_HOPPER_FUSED_FOLD_MMA=auto|1|0 (1: also beside cluster_sum).
FUSED_FOLD_MMA = _auto_switch("FLASHGDN_HOPPER_FUSED_FOLD_MMA")


def _pair_sums_by_default(group: int) -> bool:
    """``FUSED_PAIR_SUMS`` "auto": groups of two and four at any head count, where it was measured (v0.37c below 32
    value heads, v0.37d beside a given P from there). Larger even groups round more pair sums before their sum and
    have not been timed."""
    return group in (2, 4)


def fused_backward_options(Hv: int, group: int = 1) -> dict:
    """``build_fused_backward``'s options as the switches above set them for ``Hv`` value heads in groups of
    ``group`` per qk head (what the backward builds, and what ``variants.training_variants`` precompiles); options at
    their defaults are left out, so that the build without them is the one its cache key names."""
    from .fused_backward import CLUSTER_SUM_MAX_GROUP

    options = {}
    if FUSED_CLUSTER_SUM and 2 <= group <= CLUSTER_SUM_MAX_GROUP:
        options["cluster_sum"] = True
    elif (FUSED_PAIR_SUMS is True and group % 2 == 0) or (FUSED_PAIR_SUMS == "auto"
                                                            and _pair_sums_by_default(group)):
        options["pair_sums"] = True
    p_given = (FUSED_P_GIVEN is True or (FUSED_P_GIVEN == "auto" and Hv >= FUSED_P_GIVEN_MIN_HV)) \
        and not options.get("cluster_sum")
    lean = not p_given  # the gate side gates P itself (FUSED_LEAN_GATES above)
    if FUSED_P_FIRST is True or (FUSED_P_FIRST == "auto" and lean):
        options["p_first"] = True
    if FUSED_LEAN_GATES is True or (FUSED_LEAN_GATES == "auto" and lean):
        options["lean_gates"] = True
    if p_given:
        options["p_given"] = True
    if FUSED_FOLD_MMA is True or (FUSED_FOLD_MMA == "auto" and not options.get("cluster_sum")
                                  and (options.get("pair_sums") or not options.get("p_given"))):
        options["fold_mma"] = True
    if FUSED_AG_FROM_A:
        options["ag_from_a"] = True
    return options


def fused_backward_wanted(item_lengths, num_items: int, Hv: int, device: torch.device) -> bool:
    """Whether the backward runs the fused kernel on ``num_items`` sequences or segments of ``Hv`` value heads, as
    ``FUSED_BACKWARD`` says. "auto" compares the two designs' times by the CP cost model
    (``CostModel.backward_gradients_us``: the fused kernel's 11.1 us a chunk step of one CTA against the walk's 3.15
    and ``chunk_grad``'s 21 us for every chunk and value head spread over the SMs, v0.15d): the fused kernel wins
    where its CTAs come near the SM count and no item is much longer than the rest (16/32 8 x 4096: 0.60x the two
    kernels' time; the bwd set's 8-sequence mix with one of 132 chunks in 54: 0.91x in fwd+bwd), and loses where a
    few long items set the time (6400 + 7 x 64 tokens). ``item_lengths``: the items' token counts on the host, in
    order, or None (then the fused kernel whenever its CTAs are at least the SM count). The backward's own plan
    (``flashgdn.cp.plan_backward``) makes the same comparison for the segments it picks and passes its choice."""
    if FUSED_BACKWARD != "auto":
        return bool(FUSED_BACKWARD)
    from ...cp.plan import CostModel

    # the H200's count where there is no CUDA device to ask (the host code's CPU tests), as the CP cost model does
    model = CostModel.for_device(device if device.type == "cuda" and torch.cuda.is_available() else None,
                                 fused_longest_first=fused_longest_first())
    if item_lengths is None:
        return num_items * Hv >= model.num_sms
    chunks = [-(-int(n) // CHUNK) for n in item_lengths]
    if sum(chunks) == 0:
        return False
    fused, two_kernels = model.backward_gradients_us(chunks, Hv)
    return fused < two_kernels


def longest_first_order(cu: torch.Tensor) -> torch.Tensor:
    """The items of offsets ``cu`` (``[N + 1]`` on the device) longest first, ties in their own order: an int32
    permutation ``[N]``, by device ops (nothing read back to the host)."""
    return torch.argsort(cu[1:] - cu[:-1], descending=True, stable=True).to(torch.int32)


def chunk_grad_options(group: int = 1) -> dict:
    """``build_chunk_grad``'s options as the switches above set them for qk heads of ``group`` value heads (what the
    backward builds, and what ``variants.training_variants`` precompiles); pair sums only for groups of two."""
    return dict(async_loads=CHUNK_GRAD_ASYNC_LOADS, row_factors=CHUNK_GRAD_ROW_FACTORS, scan_dg=CHUNK_GRAD_SCAN_DG,
                wide_stores=CHUNK_GRAD_WIDE_STORES, pair_sums=CHUNK_GRAD_PAIR_SUMS and group == 2,
                heads_inner=CHUNK_GRAD_HEADS_INNER)


def _plan_and_stage1(q, k, g, beta, cu_seqlens, store_inverse=False, cu_cpu=None, chunk_bounds=False):
    """The forward's stages 0 and 1 (``forward.hopper_stage1``) on packed views:
    ``((q, k) packed, cu, N, Stage1)``; ``cu_cpu``: the host copy of the offsets if there is one."""
    B, T, Hqk, K = q.shape
    Hv = g.shape[2]
    cu, N = packed_offsets(cu_seqlens, B, T, q.device)
    TT = B * T
    qf, kf = q.reshape(1, TT, Hqk, K), k.reshape(1, TT, Hqk, K)
    return (qf, kf), cu, N, hopper_stage1(kf, g.reshape(1, TT, Hv), beta.reshape(1, TT, Hv), cu,
                                          store_inverse=store_inverse,
                                          cu_cpu=host_offsets(cu_seqlens, cu_cpu, B, T), chunk_bounds=chunk_bounds)


def _end_gradients(dht: Optional[torch.Tensor], Hv: int, K: int, V: int, device) -> torch.Tensor:
    """The walk's end gradients as its kernels take them: ``dht`` float32 and contiguous, or (None) a placeholder the
    kernel built without ``has_final_grad`` never reads."""
    return dht.to(torch.float32).contiguous() if dht is not None else torch.empty((1, Hv, K, V), device=device)


def _token_gradients(q, v, cu_cpu, qk_heads: int, qk_alloc=None):
    """``(dv, dq, dk, dg, dbeta)`` for the per-chunk gradient kernels to write, dq and dk for ``qk_heads`` heads
    (``qk_alloc``: their allocator, default the others'). Tokens past the last sequence belong to no chunk and are
    never written: zeros, unless the host copy of the offsets ``cu_cpu`` says there are none."""
    _, TT, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    dev = q.device
    alloc = torch.zeros if cu_cpu is None or int(cu_cpu[-1]) < TT else torch.empty
    qk_alloc = qk_alloc or alloc
    dv = alloc((1, TT, Hv, V), dtype=q.dtype, device=dev)
    dq = qk_alloc((1, TT, qk_heads, K), dtype=q.dtype, device=dev)
    dk = qk_alloc((1, TT, qk_heads, K), dtype=q.dtype, device=dev)
    dg = alloc((1, TT, Hv), dtype=torch.float32, device=dev)
    dbeta = alloc((1, TT, Hv), dtype=torch.float32, device=dev)
    return dv, dq, dk, dg, dbeta


def hopper_chunk_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    _stage1=None,
    precise: bool = False,
    first_apart: Optional[Tuple[torch.Tensor, int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The forward's state at the start of every chunk slot, recomputed by the rs loop's state-only variant with
    ``store_chunk_states``: ``(states [S, Hv, V, K] V-major in q's dtype, bounds)``; ``initial_state`` K-major
    ``[N, Hv, K, V]`` or None (zero). Idle slots are not written. ``precise``: the rs loop's precise mode (bf16).
    ``first_apart``: ``(ds_start, shift)``, every sequence's first chunk state written into the memory of
    ``ds_start`` (float32 ``[N, Hv, K, V]``, the fused kernel's d(initial state) output) instead, and ``states``
    ``[S - shift N, Hv, V, K]`` (``FirstStatesApart``)."""
    from .chunk_forward_rs import build_chunk_forward_rs

    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    (qf, kf), cu, N, st1 = _stage1 or _plan_and_stage1(q, k, g, beta, cu_seqlens)
    S = st1.bounds.shape[0]
    dev = q.device
    has_h0 = initial_state is not None
    h0 = initial_state.to(torch.float32).contiguous() if has_h0 else torch.empty((1, Hv, K, V), device=dev)
    shift = first_apart[1] if first_apart is not None else 0
    # (one row at least: a tensor map needs one, also where every sequence is a single chunk)
    states = _output((max(1, S - shift * N), Hv, V, K), q.dtype, dev)
    o1 = torch.empty((1, 1, Hv, V), dtype=q.dtype, device=dev)  # not touched by a state-only pass
    kernel = build_chunk_forward_rs(Hqk, Hv, K, V, tl_dtype(q.dtype), has_h0, False, False, False, precise, True,
                                    staged_stores=STAGED_STATE_STORES, **lean_state_option(),
                                    **(dict(first_apart=True) if first_apart is not None else {}))
    args = (qf, kf, v.reshape(1, B * T, Hv, V), st1.gcum, st1.Ag, cu, st1.first_slot, h0, 1.0, o1, states)
    if first_apart is not None:
        args += (_first_states_view(first_apart[0], q.dtype, V, K), shift)
    kernel(*args)
    return states, st1.bounds


def _first_states_view(ds_start: torch.Tensor, dtype: torch.dtype, V: int, K: int) -> torch.Tensor:
    """The d(initial state) buffer ``[N, Hv, K, V]`` float32 as ``[N, Hv, 2 V, K]`` values of the 2-byte io dtype,
    whose first V rows of each [n, h] hold sequence n's first chunk state (``first_apart``)."""
    N, Hv = ds_start.shape[:2]
    return ds_start.view(dtype).view(N, Hv, 2 * V, K)


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
    precise: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state gradients by the walk kernel. q, k (normalised as the forward used them), do: contiguous
    bf16/fp16 ``[B, T, H, D]``; g, beta ``[B, T, Hv]``; dht ``[N, Hv, K, V]`` float32 K-major, or None.

    Returns ``(ds_end, dh0, bounds)``: ``ds_end [S, Hv, V, K]`` in q's dtype, the gradient at the end of every
    chunk slot, V-major (slot s holds chunk ``bounds[s]``; idle slots are not written); ``dh0 [N, Hv, K, V]`` float32,
    K-major, the gradient at every sequence's start; ``bounds`` the chunk plan (``forward.chunk_plan``).
    ``precise``: the walk's precise mode (bf16; ``state_grad_walk.py``)."""
    from .state_grad_walk import build_state_grad_walk

    B, T, Hqk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    dev = q.device
    (qf, kf), cu, N, st1 = _stage1 or _plan_and_stage1(q, k, g, beta, cu_seqlens)
    S = st1.bounds.shape[0]
    dof = do.reshape(1, B * T, Hv, V).contiguous()
    ds_end = _output((S, Hv, V, K), q.dtype, dev)
    dh0 = _output((N, Hv, K, V), torch.float32, dev)
    build_state_grad_walk(Hqk, Hv, K, V, tl_dtype(q.dtype), dht is not None, staged_stores=STAGED_STATE_STORES,
                          precise=precise, **lean_state_option())(
        qf, kf, dof, st1.gcum, st1.Ag, cu, st1.first_slot, _end_gradients(dht, Hv, K, V, dev), float(scale), ds_end,
        dh0)
    return ds_end, dh0, st1.bounds


def hopper_walk_starts(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    scale: float,
    cu_seqlens: Optional[torch.Tensor],
    _stage1=None,
    precise: bool = False,
    walk_chunks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The walk from a zero end gradient, its start gradients alone (the walk's ``starts_only`` build): ``[N, Hv,
    K, V]`` float32 K-major, what ``hopper_state_gradients(..., dht=None)[1]`` gives, without the per-chunk
    gradients. Inputs as ``hopper_state_gradients``'s. ``walk_chunks`` ``[N, Hv]`` int32: the chunks each item walks,
    from its start (``flashgdn.cp.bounds.walk_stop_chunks`` or ``hopper_walk_covers``; the walk's ``early_stop``)."""
    from .state_grad_walk import build_state_grad_walk

    B, T, Hqk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    dev = q.device
    (qf, kf), cu, N, st1 = _stage1 or _plan_and_stage1(q, k, g, beta, cu_seqlens)
    dh0 = _output((N, Hv, K, V), torch.float32, dev)
    args = (qf, kf, do.reshape(1, B * T, Hv, V).contiguous(), st1.gcum, st1.Ag, cu, st1.first_slot,
            _end_gradients(None, Hv, K, V, dev), float(scale), dh0)
    if walk_chunks is not None:
        if walk_chunks.shape != (N, Hv):
            raise ValueError(f"walk_chunks must be [{N}, {Hv}] (sequences, value heads), got {tuple(walk_chunks.shape)}")
        args += (walk_chunks.to(torch.int32).contiguous(),)
    build_state_grad_walk(Hqk, Hv, K, V, tl_dtype(q.dtype), False, staged_stores=STAGED_STATE_STORES,
                          precise=precise, starts_only=True, early_stop=walk_chunks is not None,
                          **lean_state_option())(*args)
    return dh0


def hopper_chunk_emits(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, do: torch.Tensor,
                       scale: float, bounds: torch.Tensor) -> torch.Tensor:
    """``chunk_emits.py`` on packed ``[1, T, ...]`` inputs (q and k as the kernels read them, normalised where the op
    normalises) and stage 1's chunk slots ``bounds [S, 2]``: ``[Hv, S]`` float32, per chunk slot and value head the log
    of a bound on what its outputs add to a state gradient (PyTorch counterpart ``flashgdn.cp.bounds.chunk_log_emits``)."""
    from .chunk_emits import build_chunk_emits

    _, TT, Hqk, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    if k.shape != q.shape or g.shape != (1, TT, Hv) or beta.shape != (1, TT, Hv) or do.shape[:2] != (1, TT):
        raise ValueError(f"hopper_chunk_emits takes q and k [1, T, Hqk, K], g and beta [1, T, Hv] and do [1, T, Hv, V]; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}, {tuple(beta.shape)}, "
                         f"{tuple(do.shape)}")
    emit = _output((Hv, bounds.shape[0]), torch.float32, q.device)
    build_chunk_emits(Hqk, Hv, K, V, tl_dtype(q.dtype))(
        q.contiguous(), k.contiguous(), g.to(torch.float32).contiguous(), beta.to(torch.float32).contiguous(),
        do.to(q.dtype).contiguous(), bounds, float(scale), emit)
    return emit


def hopper_walk_covers(chunk_bound: torch.Tensor, chunk_emit: torch.Tensor, cu_seqlens: torch.Tensor,
                       first_slot: torch.Tensor) -> torch.Tensor:
    """``chunk_emits.py``'s ``build_walk_covers``: ``[N, Hv]`` int32, the chunks each walk from zero over the sequences
    (segments) of ``cu_seqlens`` covers from its start, from stage 1's ``chunk_bound`` and ``hopper_chunk_emits``'s
    ``chunk_emit`` (both ``[Hv, S]`` float32) and stage 1's ``first_slot`` (PyTorch counterpart
    ``flashgdn.cp.bounds.segment_walk_stops``): what ``hopper_walk_starts`` takes as ``walk_chunks``."""
    from .chunk_emits import build_walk_covers

    Hv, S = chunk_bound.shape
    N = cu_seqlens.shape[0] - 1
    if chunk_emit.shape != (Hv, S) or chunk_bound.dtype != torch.float32 or chunk_emit.dtype != torch.float32:
        raise ValueError(f"chunk_bound and chunk_emit must both be [Hv, S] float32, got {tuple(chunk_bound.shape)} "
                         f"{chunk_bound.dtype} and {tuple(chunk_emit.shape)} {chunk_emit.dtype}")
    if first_slot.shape != (N,):
        raise ValueError(f"first_slot must be [{N}] (one per sequence of cu_seqlens), got {tuple(first_slot.shape)}")
    covers = _output((N, Hv), torch.int32, chunk_bound.device)
    build_walk_covers(Hv)(chunk_bound.contiguous(), chunk_emit.contiguous(), cu_seqlens.to(torch.int32),
                          first_slot.to(torch.int32), covers)
    return covers


def hopper_inverse(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   cu_seqlens: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1 with the ungated inverse stored too (``kkt_inverse(..., store_inverse=True)``), for the per-chunk
    gradients: ``(A [S, Hv, 64, 64] and Ag [S, Hv, 64, 64] in k's dtype, bounds)``; k ``[B, T, Hqk, K]``
    normalised as the forward used it. Idle slots are not written."""
    B, T, Hqk, K = k.shape
    Hv = g.shape[2]
    cu, _ = packed_offsets(cu_seqlens, B, T, k.device)
    TT = B * T
    st1 = hopper_stage1(k.reshape(1, TT, Hqk, K), g.reshape(1, TT, Hv), beta.reshape(1, TT, Hv), cu,
                        store_inverse=True)
    return st1.A, st1.Ag, st1.bounds


def _scores_buffer(stage1, Hv: int) -> torch.Tensor:
    """``gated_scores.py``'s output ``[S, Hv, 64, 64]`` for stage 1's ``((q, k) packed, cu, N, Stage1)``, allocated on
    the current stream."""
    (qf, _), _, _, st1 = stage1
    return _output((st1.Ag.shape[0], Hv, CHUNK, CHUNK), qf.dtype, qf.device)


def _gated_scores(stage1, Hv: int, scale: float, p: torch.Tensor) -> None:
    """``gated_scores.py`` into ``p`` (``_scores_buffer``) from stage 1's ``((q, k) packed, cu, N, Stage1)``."""
    from .gated_scores import build_gated_scores

    (qf, kf), _, _, st1 = stage1
    build_gated_scores(qf.shape[2], Hv, qf.shape[3], tl_dtype(qf.dtype))(qf, kf, st1.gcum, st1.bounds, float(scale), p)


class HopperBackwardStages:
    """The Hopper backward as the three stages of ``flashgdn.cp.backward.BackwardStages`` (packed ``[1, T, ...]``
    inputs, K-major float32 states): the chunk states (``hopper_chunk_states``), the walk
    (``hopper_state_gradients``) and ``chunk_grad``. Stages 0 and 1 run once per set of offsets and are shared
    by the three (the driver hands them the same ``cu`` tensor). States and state gradients pass between the
    stages as the kernels' per-slot ``[S, Hv, V, K]`` io-dtype tensors. ``precise``: the states pass and the walk
    in their precise mode (``forward.PRECISE``; bf16). ``scale``: the op's, for what is made ahead of the stage that
    reads it (the fused kernel's P, beside the states pass); without it P is made right before the fused kernel."""

    def __init__(self, precise: bool = False, fused: bool = False, scale: Optional[float] = None):
        self.precise = precise
        self.scale = scale
        #: ``cp_backward`` runs ``fused_gradients`` instead of ``state_gradients`` and ``chunk_gradients`` (step 4)
        self.fuses_gradients = fused and not precise
        self._cu = None
        self._stage1 = None
        #: (cu, dq, dk, stream) while the pair sums' outputs are being zeroed on ``stream`` (``PAIR_ZEROS_ASIDE``)
        self._pair_zeros = None
        #: (cu, P, stream) while the fused kernel's P is being made on ``stream`` (``FUSED_P_GIVEN``)
        self._scores = None

    def _stage1_for(self, q, k, g, beta, cu, cu_cpu):
        # under backend.CP_NEGLIGIBLE_M_IN_KERNEL every stage 1 here is the build with the chunks' bounds, whichever
        # pass asks first (the backward's own transition pass reads them)
        from .backend import CP_NEGLIGIBLE_M_IN_KERNEL

        if self._cu is not cu:
            self._stage1 = _plan_and_stage1(q, k, g, beta, cu, store_inverse=True, cu_cpu=cu_cpu,
                                            chunk_bounds=CP_NEGLIGIBLE_M_IN_KERNEL)
            self._cu = cu
        return self._stage1

    def prepare(self, q, k, g, beta, cu, cu_cpu):
        """Stages 0 and 1 for these offsets, made now (on the current stream) if not yet: the passes of
        ``cp_backward`` that run on two streams both read them."""
        self._stage1_for(q, k, g, beta, cu, cu_cpu)

    def chunk_states(self, q, k, v, g, beta, h0, cu, cu_cpu):
        """The states as ``chunk_gradients`` reads them, or, for ``fused_gradients`` (``FIRST_STATES_APART``), a
        ``FirstStatesApart``: the first chunk states in the memory of the fused kernel's d(initial state) output,
        which is allocated here for it."""
        stage1 = self._stage1_for(q, k, g, beta, cu, cu_cpu)
        self._zero_pair_outputs_aside(q, v, cu)
        self._scores_aside(q, v, cu, stage1)
        if not (self.fuses_gradients and FIRST_STATES_APART):
            return hopper_chunk_states(q, k, v, g, beta, h0, cu, _stage1=stage1, precise=self.precise)[0]
        _, _, N, _ = stage1
        Hv, K, V = v.shape[2], q.shape[3], v.shape[3]
        ds_start = _output((N, Hv, K, V), torch.float32, q.device)
        shift = first_apart_shift(cu_cpu)
        states = hopper_chunk_states(q, k, v, g, beta, h0, cu, _stage1=stage1, precise=self.precise,
                                     first_apart=(ds_start, shift))[0]
        return FirstStatesApart(states, ds_start, shift)

    def _zero_pair_outputs_aside(self, q, v, cu):
        """With the fused kernel's pair sums and ``PAIR_ZEROS_ASIDE``: its dq and dk, allocated here and zeroed on
        their own stream from this point of the current one (so, beside the states pass that follows)."""
        Hqk, Hv = q.shape[2], v.shape[2]
        if not (PAIR_ZEROS_ASIDE and q.is_cuda and self.fuses_gradients
                and fused_backward_options(Hv, Hv // Hqk).get("pair_sums")):
            return
        from ...cp.backward import side_stream

        # a stream of their own: in the CP backward the walks' stream is busy beside the states pass too
        main, side = torch.cuda.current_stream(q.device), side_stream(q.device, "pair zeros")
        dq, dk = (torch.empty((1, q.shape[1], Hv // 2, q.shape[3]), dtype=q.dtype, device=q.device) for _ in range(2))
        side.wait_stream(main)  # after their allocation, in the order the main stream sees
        with torch.cuda.stream(side):
            dq.zero_()
            dk.zero_()
        self._pair_zeros = (cu, dq, dk, side)

    def _scores_aside(self, q, v, cu, stage1):
        """With the fused kernel's ``p_given`` and the op's scale known: the chunks' P (``gated_scores.py``), allocated
        here and made on a stream of its own from this point of the current one, beside the states pass that
        follows (bound by its chunk steps; where its CTAs leave SMs free, this pass costs the step nothing)."""
        Hqk, Hv = q.shape[2], v.shape[2]
        if not (self.scale is not None and q.is_cuda and self.fuses_gradients
                and fused_backward_options(Hv, Hv // Hqk).get("p_given")):
            return
        from ...cp.backward import side_stream

        main, side = torch.cuda.current_stream(q.device), side_stream(q.device, "gated scores")
        p = _scores_buffer(stage1, Hv)
        side.wait_stream(main)  # stage 1 and the allocation, in the order the main stream sees them
        with torch.cuda.stream(side):
            _gated_scores(stage1, Hv, self.scale, p)
        self._scores = (cu, p, side)

    def _given_scores(self, cu, stage1, Hv, scale):
        """The fused kernel's P: the one made aside for these offsets (the current stream then waits for it), else
        made now."""
        held, self._scores = self._scores, None
        if held is not None and held[0] is cu:
            torch.cuda.current_stream(held[1].device).wait_stream(held[2])
            return held[1]
        p = _scores_buffer(stage1, Hv)
        _gated_scores(stage1, Hv, scale, p)
        return p

    def _pair_outputs(self, cu, shape, dtype, device):
        """The pair sums' zeroed dq and dk: those zeroed aside for these offsets (the current stream then waits for
        them), else zeros made now."""
        held, self._pair_zeros = self._pair_zeros, None
        if held is not None and held[0] is cu and held[1].shape == shape:
            torch.cuda.current_stream(device).wait_stream(held[3])
            return held[1], held[2]
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def state_gradients(self, q, k, g, beta, do, dht, scale, cu, cu_cpu):
        ds_end, dh0, _ = hopper_state_gradients(q, k, g, beta, do, dht, scale, cu,
                                                _stage1=self._stage1_for(q, k, g, beta, cu, cu_cpu),
                                                precise=self.precise)
        return ds_end, dh0

    def walk_starts(self, q, k, g, beta, do, scale, cu, cu_cpu):
        """The walk from a zero end gradient, its start gradients alone (context parallelism's D): the walk's
        ``starts_only`` build with WALK_STARTS_ONLY (each walk stopped, given the host's offsets, by the emission
        pass's covers with WALK_STOP_IN_KERNEL past its gate, else by ``walk_stop_chunks`` with WALK_EARLY_STOP),
        else ``state_gradients``' second output."""
        if not WALK_STARTS_ONLY:
            return self.state_gradients(q, k, g, beta, do, None, scale, cu, cu_cpu)[1]
        stage1 = self._stage1_for(q, k, g, beta, cu, cu_cpu)
        walk_chunks = None
        (qf, kf), offsets, _, st1 = stage1
        TT, Hv = qf.shape[1], g.shape[-1]
        gf, betaf, dof = g.reshape(1, TT, Hv), beta.reshape(1, TT, Hv), do.reshape(1, TT, Hv, do.shape[-1])
        if st1.chunk_bound is not None and walk_stop_in_kernel(cu_cpu):
            emit = hopper_chunk_emits(qf, kf, gf, betaf, dof, scale, st1.bounds)
            walk_chunks = hopper_walk_covers(st1.chunk_bound, emit, offsets, st1.first_slot)
        elif WALK_EARLY_STOP and cu_cpu is not None:  # (the chunks' count from the host's offsets: no read back)
            from ...cp.bounds import chunk_count, walk_stop_chunks

            walk_chunks = walk_stop_chunks(qf, kf, gf, betaf, dof, scale, offsets, chunk_count(cu_cpu))
        return hopper_walk_starts(q, k, g, beta, do, scale, cu, _stage1=stage1, precise=self.precise,
                                  walk_chunks=walk_chunks)

    def chunk_gradients(self, q, k, v, g, beta, do, states, ds_end, scale, cu, cu_cpu):
        from .chunk_grad import build_chunk_grad

        (qf, kf), _, _, st1 = self._stage1_for(q, k, g, beta, cu, cu_cpu)
        _, TT, Hqk, K = q.shape
        Hv, V = v.shape[2], v.shape[3]
        # dq and dk per value head in the io dtype (half of float32's memory; +0.4e-3 on their error,
        # benchmarks/numerics_backward.py), returned as [1, T, Hqk, group, K] for finish_gradients to sum; with
        # pair sums, per qk head (a group of one for finish_gradients), zeroed for the kernel's atomics
        group = Hv // Hqk
        options = chunk_grad_options(group)
        heads, per, alloc_qk = (Hqk, 1, torch.zeros) if options["pair_sums"] else (Hv, group, None)
        dv, dq, dk, dg, dbeta = _token_gradients(q, v, cu_cpu, heads, alloc_qk)
        build_chunk_grad(Hqk, Hv, K, V, tl_dtype(q.dtype), **options)(
            qf, kf, v.contiguous(), do.contiguous(), st1.gcum, beta.to(torch.float32).contiguous(), st1.Ag, st1.A,
            st1.bounds, states, ds_end, float(scale), dv, dq, dk, dg, dbeta)
        return dq.view(1, TT, Hqk, per, K), dk.view(1, TT, Hqk, per, K), dv, dg, dbeta

    def fused_gradients(self, q, k, v, g, beta, do, states, dht, scale, cu, cu_cpu):
        """The walk and ``chunk_gradients`` in one kernel (``fused_backward.py``): ``((dq, dk, dv, dg, dbeta) as
        ``chunk_gradients`` gives them, dh0 [N, Hv, K, V] float32 K-major)`` from the chunk states and the end
        gradients ``dht`` (K-major float, or None: zero)."""
        from .fused_backward import build_fused_backward

        offsets = cu
        stage1 = self._stage1_for(q, k, g, beta, cu, cu_cpu)
        (qf, kf), cu, N, st1 = stage1
        _, TT, Hqk, K = q.shape
        Hv, V = v.shape[2], v.shape[3]
        group = Hv // Hqk
        options = fused_backward_options(Hv, group)
        # dq and dk per value head for finish_gradients to sum, or (cluster_sum) summed by the kernel: a group of one,
        # or (pair_sums) per pair of value heads, added by the kernel into zeros
        per = 1 if options.get("cluster_sum") else group // 2 if options.get("pair_sums") else group
        qk_alloc = None
        if options.get("pair_sums"):
            zeroed = iter(self._pair_outputs(offsets, (1, TT, Hqk * per, K), q.dtype, q.device))
            qk_alloc = lambda *shape, **kwargs: next(zeroed)  # noqa: E731
        ag = st1.Ag
        if options.get("ag_from_a"):
            # the kernel makes Ag from A: stage 1's is let go here, before the outputs below are allocated (the
            # states pass and the walks, its other readers, have run), and A stands in for it as the argument
            ag, st1.Ag = st1.A, None
        dv, dq, dk, dg, dbeta = _token_gradients(q, v, cu_cpu, Hqk * per, qk_alloc)
        apart = isinstance(states, FirstStatesApart)
        if apart:  # dh0 is the buffer that holds the first chunk states until the kernel writes over them
            states, dh0, shift = states
            options = dict(options, first_apart=True)
            if FUSED_LONGEST_FIRST:  # (built beside first_apart only)
                options["longest_first"] = True
        else:
            dh0 = _output((N, Hv, K, V), torch.float32, q.device)
        args = (qf, kf, v.contiguous(), do.contiguous(), st1.gcum, beta.to(torch.float32).contiguous(), ag, st1.A,
                cu, st1.first_slot, states, _end_gradients(dht, Hv, K, V, q.device), float(scale), dv, dq, dk, dg,
                dbeta, dh0)
        if apart:
            args += (_first_states_view(dh0, q.dtype, V, K), shift)
        if options.get("p_given"):  # the chunks' P, let go once the kernel has read it
            args += (self._given_scores(offsets, stage1, Hv, scale),)
        if options.get("longest_first"):  # the rows of CTAs in the order of the items' lengths, longest first
            args += (longest_first_order(cu),)
        build_fused_backward(Hqk, Hv, K, V, tl_dtype(q.dtype), dht is not None, **options)(*args)
        return (dq.view(1, TT, Hqk, per, K), dk.view(1, TT, Hqk, per, K), dv, dg, dbeta), dh0

    def finish_gradients(self, grads):
        """dq and dk summed over each qk head's group of value heads; the stage-1 tensors kept for the three stages
        (A and Ag: 256 B per token and value head) are let go first, so the sums' allocations are not live beside
        them either."""
        dq, dk, dv, dg, dbeta = grads  # dq, dk: [1, T, Hqk, group, K]
        self._stage1 = self._cu = None
        # each qk head's value heads, summed in a fixed order (deterministic), accumulating in float32 and writing
        # the io dtype: the same values as a float32 sum cast afterwards, without its float32 [T, Hqk, K] temporary
        # and the second pass over it (the two steps took 0.75 ms of 16/32 32768x1's backward: waited chunk_grad
        # with them 4.09 ms in stages-hopper-v0.6-bwd.json, without them 3.34 ms in -v0.6b-bwd.json); by
        # ``group_sum.py``'s kernel (GROUP_SUM_KERNEL), else torch's sum; a group of one is a view
        _, TT, Hqk, group, K = dq.shape
        if group == 1:
            return dq.squeeze(3), dk.squeeze(3), dv, dg, dbeta
        if not GROUP_SUM_KERNEL:
            return dq.sum(3), dk.sum(3), dv, dg, dbeta
        from .group_sum import build_group_sum

        dq_out = torch.empty((1, TT, Hqk, K), dtype=dq.dtype, device=dq.device)
        dk_out = torch.empty_like(dq_out)
        build_group_sum(group, K, tl_dtype(dq.dtype))(dq.view(-1, group, K), dk.view(-1, group, K),
                                                      dq_out.view(-1, K), dk_out.view(-1, K))
        return dq_out, dk_out, dv, dg, dbeta


def hopper_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: Optional[torch.Tensor],
    scale: float,
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    state_v_first: bool = False,
    plan=None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    fused: Optional[bool] = None,
    forward_starts=None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """All gradients of the Hopper forward, by stages 0-2 (module docstring), on the segments of ``plan`` (a
    ``flashgdn.cp`` plan, the backward's own from ``flashgdn.cp.plan_backward``; None or unsplit: the sequences
    themselves) through ``flashgdn.cp.cp_backward``, from the forward's segment starts when given
    (``forward_starts``: the forward's plan and its K-major start states, or their ``StartsHandoff``,
    ``cp_backward``'s).
    q, k (normalised as the forward used them), v, do: contiguous bf16/fp16 ``[B, T, H, D]``; g, beta
    ``[B, T, Hv]``; the states (initial state and ``dht``, the final state's gradient or None) in the
    ``state_v_first`` layout; ``cu_seqlens_cpu`` the host copy of ``cu_seqlens`` if there is one. ``fused``: whether
    the walk and the per-chunk gradients run as the fused kernel (None: ``fused_backward_wanted`` on the plan's
    items; never in the precise mode).

    Returns ``(dq, dk, dv, dg, dbeta, dh0)``: dq, dk, dv in q's dtype, dg and dbeta float32 (the caller casts to
    the inputs' dtypes), dh0 float32 in the initial state's layout, or None without an initial state. Gradients
    of tokens past ``cu_seqlens[-1]`` are zero."""
    from ...cp.backward import cp_backward
    from .backend import CP_PAIRED, _HopperSegmentsForward
    from .forward import PRECISE

    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    TT = B * T
    cu, N = packed_offsets(cu_seqlens, B, T, q.device)
    cu_cpu = host_offsets(cu_seqlens, cu_seqlens_cpu, B, T)

    def packed(x):
        return x.reshape((1, TT) + tuple(x.shape[2:]))

    def k_major(x):  # the kernels' host calls make it float32 and contiguous
        return x.transpose(-1, -2) if x is not None and state_v_first else x

    if PRECISE and q.dtype != torch.bfloat16:
        raise NotImplementedError(f"the Hopper backend's precise mode (FLASHGDN_HOPPER_PRECISE=1) takes bfloat16 "
                                  f"q/k/v, got {q.dtype}")
    split = plan is not None and plan.split
    # the fused kernel's CTAs: one per value head and sequence, or segment when the plan splits (their lengths from
    # the host's offsets when there are some)
    offsets = plan.seg_cu if plan is not None else cu_cpu
    lengths = None if offsets is None else (offsets[1:] - offsets[:-1]).tolist()
    items = (plan.seg_cu.shape[0] - 1) if plan is not None else N
    if fused is None:
        fused = fused_backward_wanted(lengths, items, Hv, q.device)
    stages = HopperBackwardStages(precise=PRECISE, fused=fused, scale=scale)
    forward = None
    if split:  # the paired transition pass takes the stages' stage 1 (with A) instead of running its own
        forward = _HopperSegmentsForward(paired=CP_PAIRED and not PRECISE,
                                         stage1_source=lambda *a, chunk_bounds=False: stages._stage1_for(*a)[3])
    dq, dk, dv, dg, dbeta, dh0 = cp_backward(
        stages, forward, packed(q), packed(k), packed(v), packed(g), packed(beta),
        packed(do).contiguous(), k_major(dht), scale, k_major(initial_state), plan, cu, cu_cpu,
        forward_starts=forward_starts if split else None)
    if initial_state is not None:
        dh0 = dh0.transpose(-1, -2) if state_v_first else dh0
    else:
        dh0 = None
    return (dq.reshape(B, T, Hqk, K), dk.reshape(B, T, Hqk, K), dv.reshape(B, T, Hv, V), dg.reshape(B, T, Hv),
            dbeta.reshape(B, T, Hv), dh0)
