"""Host side of the Hopper forward: plan the launch without touching the host, run the stages in order.

Pipeline (each stage one file, one compile per configuration):
  0. ``chunk_plan``    one small kernel: the chunk slots (first token, rows) and each sequence's first slot
  1. ``kkt_inverse``   per (chunk, qk head): chunk-local cumsum g~ and the gated inverse Ag, as per-slot tiles
  2. the chunk loop   per (sequence, value head): the state in registers, one of ``chunk_forward_rso`` (default;
                      ``chunk_forward_rs`` without an output or in the precise mode), ``chunk_forward_rs``,
                      ``chunk_forward_uw``, ``chunk_forward_ws`` or ``chunk_forward`` (see CHUNK_LOOPS)

Dense input ``[B, T, ...]`` is run as B packed sequences of length T (a free view), so both layouts share
the same kernels. Everything here is device-side tensor work with shapes known on the host (T, N, heads),
so the call path never synchronises with the GPU and can be captured in a CUDA graph on its first call.
"""
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .common import CHUNK, tl_dtype

#: Tests set this to fill every output with NaN before the kernels run, so an element no kernel wrote fails.
POISON_OUTPUTS = False

#: Which chunk-loop kernel runs (default "rso"): "rs" (warp-specialised, transposed state, register-operand GEMMs:
#: ``chunk_forward_rs.py``), "rsd" (rs with the state update's decay in K's tile, GEMMs issued in pairs:
#: ``decayed_k`` there), "fused" (rsd with stage 1 inside: the gate warpgroup makes g~ and Ag, ``inverse_in_loop``
#: there; without an output, with a given stage 1 or in the precise mode the loop is rsd's or rs's), "uw" (rs with
#: the state chain cut to two GEMMs, U and Wk made by the gate warpgroup: ``chunk_forward_uw.py``), "ws"
#: (warp-specialised, state halves through shared memory: ``chunk_forward_ws.py``) or "simple" (one role,
#: ``chunk_forward.py``; the A/B baseline), or "rso" (rs's state chain alone on the state warpgroups, the output on
#: a warpgroup of its own: ``chunk_forward_rso.py``; without an output, or in the precise mode, the loop is rs's).
#: FLASHGDN_HOPPER_CHUNK_LOOP overrides the default.
CHUNK_LOOPS = ("rs", "rsd", "fused", "uw", "ws", "simple", "rso")
DEFAULT_CHUNK_LOOP = os.environ.get("FLASHGDN_HOPPER_CHUNK_LOOP", "rso")

#: Precise mode of the rs chunk loop: register operands as bf16 hi + lo pairs (``chunk_forward_rs.py``), for
#: results that do not depend on their rounding (exact context parallelism to 1e-3); the backward's states pass
#: and walk follow it (``backward.hopper_backward``). FLASHGDN_HOPPER_PRECISE=1.
PRECISE = os.environ.get("FLASHGDN_HOPPER_PRECISE", "0") == "1"

#: Stage 1 (``kkt_inverse``, forward and backward) loads k's tile by cp.async (``async_loads`` there; the same bits,
#: 0.92x-0.97x the time: ``stages-hopper-v0.10e.json``).
#: FLASHGDN_HOPPER_KKT_ASYNC_LOADS=0 for the register-staged loads.
KKT_ASYNC_LOADS = os.environ.get("FLASHGDN_HOPPER_KKT_ASYNC_LOADS", "1") == "1"

#: Stage 1's occupancy (``kkt_inverse``'s ``blocks_per_sm``): 5 CTAs per SM, each head's A21 gated right after its
#: merge so that five fit (38-40 KB of shared memory), or 4 (FLASHGDN_HOPPER_KKT_BLOCKS_PER_SM=4, the build before).
#: The same bits; on the H200 the op took 0.974x-0.990x the time of the four-per-SM build on all six timed shapes and
#: the stage alone 0.90x-1.03x (``stages-hopper-v0.13a.json``, ``gpu-kkt5-v0.13a.log``).
KKT_BLOCKS_PER_SM = int(os.environ.get("FLASHGDN_HOPPER_KKT_BLOCKS_PER_SM", "5"))

#: Stage 1 of an odd group (one value head inverted at a time on the CTA's lower 64 threads) built for more CTAs per
#: SM than KKT_BLOCKS_PER_SM: its ~29-31 KB of shared memory fit seven, and its registers are what keeps it at five
#: (96 a thread). At 72 registers the group-of-one build compiles to the same instructions with no spills, so seven
#: share an SM: 1.4x the heads in flight, against stage 1's 1.4x the time per value head at Hqk = Hv that a group of
#: two takes (``forward/kkt-options-mma32-v0.24b.json``: 32/32 0.167 ms against 16/32's 0.119 on 4096x8). The same
#: code at another register cap, so the same bits. Measured (notes v0.33c): the stage alone 0.927x-0.964x
#: (0.960x-1.007x with A stored; ``forward/odd-blocks-1*-v0.33c.json``), the op's forward 0.994x on the canonical set's
#: full shapes at 32/32 and 16/16 (16/16 0.978x-0.991x), fwd+bwd 0.999x, the same bits on all 36
#: (``forward/odd-blocks-ab-v0.33c.json``). The default; FLASHGDN_HOPPER_KKT_ODD_GROUP_BLOCKS=0 for five per SM.
KKT_ODD_GROUP_BLOCKS = os.environ.get("FLASHGDN_HOPPER_KKT_ODD_GROUP_BLOCKS", "1") == "1"
#: (group, A stored) -> stage 1's CTAs per SM under KKT_ODD_GROUP_BLOCKS, where the build compiles to the same
#: instructions without spills: a group of one. (A group of three at six spills 4-16 bytes at 80 registers, depending
#: on the head counts and A, and its code changes: not taken.)
ODD_GROUP_BLOCKS_PER_SM = {(1, False): 7, (1, True): 7}


def kkt_blocks_per_sm(group: int, store_inverse: bool = False) -> int:
    """Stage 1's CTAs per SM for qk heads of ``group`` value heads (``kkt_inverse``'s ``blocks_per_sm``)."""
    if KKT_ODD_GROUP_BLOCKS and group % 2:
        return ODD_GROUP_BLOCKS_PER_SM.get((group, store_inverse), KKT_BLOCKS_PER_SM)
    return KKT_BLOCKS_PER_SM

#: Stage 1's substitution with its warps given columns by where their work lies (``kkt_inverse``'s ``triangle``): the
#: same bits, the stage 0.933x-0.985x and the op 0.977x-1.003x the time (``forward/kkt-options-v0.21a.json``,
#: ``forward/kkt-triangle-op-v0.21a.json``); the default when KKT_DIAG16 is off. FLASHGDN_HOPPER_KKT_TRIANGLE=0 for
#: the build before.
KKT_TRIANGLE = os.environ.get("FLASHGDN_HOPPER_KKT_TRIANGLE", "1") == "1"

#: Stage 1's diagonal inverted in 16x16 blocks and merged to 32x32 by tf32 mma (``kkt_inverse``'s ``diag16``, in
#: place of ``triangle``): different bits (its 16x16 products are rounded to tf32; Ag and A within their bf16 storage
#: of the oracle). The stage 0.86x-0.92x the time of the build without options (``triangle``: 0.94x-0.99x), the op
#: 0.980x (full shapes) and 0.987x (few-CTA shapes) of ``triangle``'s (``forward/kkt-options-diag16-v0.23b.json``,
#: ``forward/kkt-diag16-op-v0.23b.json``). The default; FLASHGDN_HOPPER_KKT_DIAG16=0 for ``triangle``.
KKT_DIAG16 = os.environ.get("FLASHGDN_HOPPER_KKT_DIAG16", "1") == "1"

#: With KKT_DIAG16, the 32x32 merge by warp mma as well (``kkt_inverse``'s ``mma32``: both heads of a pair at once,
#: X = L21 A11 and A21 = -A22 X in 10 and 12 tf32 ``mma.m16n8k8`` a warp, instead of L21 staged for two ``T.gemm``
#: per head): the same bits as diag16 alone (all 171 canonical shapes), the stage 0.885x its time (0.917x with A
#: stored), the op 0.977x (full shapes) and 0.986x (few-CTA shapes) (``forward/kkt-options-mma32-v0.24b.json``,
#: ``forward/kkt-mma32-op-v0.24b.json``). The default; FLASHGDN_HOPPER_KKT_MMA32=0 for diag16 alone.
KKT_MMA32 = os.environ.get("FLASHGDN_HOPPER_KKT_MMA32", "1") == "1"

#: With KKT_DIAG16, the 16x16 diagonal blocks by elimination in registers, a warp a block (``kkt_inverse``'s
#: ``registers16``), instead of by substitution a thread a column: its latency alone was ~1950 of a CTA's ~6900 cycles
#: (notes "Stage 1's phases measured"), and the loop's gate warpgroup would need the whole inverse in ~1400. Other
#: bits, the same error. An A/B, off; FLASHGDN_HOPPER_KKT_REGISTERS16=1 turns it on.
KKT_REGISTERS16 = os.environ.get("FLASHGDN_HOPPER_KKT_REGISTERS16", "0") == "1"

#: With KKT_REGISTERS16, each warp's 16x16 block from its two 8x8 diagonal blocks, eliminated at once in 7 steps and
#: merged by fp16 mma in registers (``kkt_inverse``'s ``registers8``; notes v0.38e): the 16x16 phase was ~830 cycles
#: alone, ~55 a step of its 15-step chain. An A/B, off; FLASHGDN_HOPPER_KKT_REGISTERS8=1 turns it on (with the above).
KKT_REGISTERS8 = os.environ.get("FLASHGDN_HOPPER_KKT_REGISTERS8", "0") == "1"

#: With KKT_REGISTERS16, the 16 -> 32 merges by fp16 mma from those registers (``kkt_inverse``'s
#: ``merge16_registers``). An A/B, off; FLASHGDN_HOPPER_KKT_MERGE16_REGISTERS=1 turns it on (with the above).
KKT_MERGE16_REGISTERS = os.environ.get("FLASHGDN_HOPPER_KKT_MERGE16_REGISTERS", "0") == "1"

#: With KKT_MERGE16_REGISTERS (and KKT_MMA32), the 32 -> 64 merge by fp16 mma from registers too (``kkt_inverse``'s
#: ``merge32_registers``). An A/B, off; FLASHGDN_HOPPER_KKT_MERGE32_REGISTERS=1 turns it on (with the two above).
KKT_MERGE32_REGISTERS = os.environ.get("FLASHGDN_HOPPER_KKT_MERGE32_REGISTERS", "0") == "1"

#: With KKT_MMA32 and KKT_MERGE16_REGISTERS, the 32 -> 64 merge by fp16 mma on all four warps, a 16x16 quadrant each
#: (``kkt_inverse``'s ``merge32_quadrants``; notes v0.38d), where KKT_MERGE32_REGISTERS chains its products on two warps
#: (934 cycles alone against the tf32 merge's 837). Measured: 694 alone at 32/32, but the stage 1.00x at 32/32 and 1.07x
#: at 16/32 on the full GPU (``v0.38/quadrants/``). Takes the place of KKT_MERGE32_REGISTERS where both are on. An A/B,
#: off; FLASHGDN_HOPPER_KKT_MERGE32_QUADRANTS=1 turns it on.
KKT_MERGE32_QUADRANTS = os.environ.get("FLASHGDN_HOPPER_KKT_MERGE32_QUADRANTS", "0") == "1"

#: The "fused" loop's inverse by stage 1's register-level pieces (``chunk_forward_rs``'s ``register_inverse``: v0.38a,
#: b, d and e in the gate warpgroup, ~1770 cycles a chunk alone against ~3440 for stage 1's default) instead of its
#: 16-row substitution. An A/B of the loop that is not the default; measured 1.09x-1.14x the substitution's time and
#: 1.42x-1.85x the default's on whole waves (notes "v0.39a measured"); with FUSED_STATE_P 0.85x-0.86x its loop, and
#: with FUSED_SWIZZLED_V too the op 0.95x the default's at 32/32 and 16/16 on whole waves (H100, notes "v0.41c
#: measured"). FLASHGDN_HOPPER_FUSED_REGISTER_INVERSE=1 turns it on.
FUSED_REGISTER_INVERSE = os.environ.get("FLASHGDN_HOPPER_FUSED_REGISTER_INVERSE", "0") == "1"

#: The "fused" loop with P made by its state paths, a half each, and the update's decay on Vn^T (``chunk_forward_rs``'s
#: ``state_p``, notes v0.41a), so that its gate warpgroup makes only g~, Ag and the decays. An A/B of the loop that is
#: not the default; measured 0.86x-0.92x the fused loop's time and 1.11x-1.43x the default's on whole waves (H100:
#: the gate's inverse slows beside the state paths' new work, notes "v0.41a measured").
#: FLASHGDN_HOPPER_FUSED_STATE_P=1 turns it on.
FUSED_STATE_P = os.environ.get("FLASHGDN_HOPPER_FUSED_STATE_P", "0") == "1"

#: The "fused" loop with v's ring tiles in the 128-byte swizzle (``chunk_forward_rs``'s ``swizzled_v``, which every
#: other rs build has): the state paths' element-wise reads of V^T free of their 4-way bank conflicts. With
#: FUSED_STATE_P measured 0.84x-0.91x its loop's time (H100, notes "v0.41b measured"); with FUSED_REGISTER_INVERSE
#: too, above. An A/B of the loop that is not the default; FLASHGDN_HOPPER_FUSED_SWIZZLED_V=1 turns it on.
FUSED_SWIZZLED_V = os.environ.get("FLASHGDN_HOPPER_FUSED_SWIZZLED_V", "0") == "1"

#: The rso loop's output path with its element-wise work trimmed (``chunk_forward_rso.py``'s ``lean_output``: row and
#: column factors in registers, O staged by stmatrix): the same bits; the op 0.93x-0.96x on one-wave shapes
#: (``stages-hopper-v0.13b*.json``, ``-v0.13c*.json``). FLASHGDN_HOPPER_RSO_LEAN_OUTPUT=0 for the build before.
RSO_LEAN_OUTPUT = os.environ.get("FLASHGDN_HOPPER_RSO_LEAN_OUTPUT", "1") == "1"

#: The rso loop's state paths with their column factors gamma_j and d_j in registers (``chunk_forward_rso.py``'s
#: ``lean_state``): the same bits (``gpu-ab-v0.13f.log``). On the H200, timed twice in opposite column order
#: (``stages-hopper-v0.13f*.json``), the op took 0.990x the time of the untrimmed state paths (geometric mean of 12;
#: 0.982x-0.992x on the one-wave shapes 2/8 32768x1, 16/32 32768x1, 32/32 8192x1, 2/8 1024x8; full shapes within the
#: power cap's order-dependent drift): the default. FLASHGDN_HOPPER_RSO_LEAN_STATE=0 turns it off.
RSO_LEAN_STATE = os.environ.get("FLASHGDN_HOPPER_RSO_LEAN_STATE", "1") == "1"

#: The state passes' state paths with gamma_j, d_j and exp(g~_last) in registers, made once per chunk: the rs loop's
#: (``chunk_forward_rs.py``'s ``lean``: context parallelism's transitions, the backward's chunk states, the rs loop with
#: an output when it is chosen) and the backward's walk (``state_grad_walk.py``'s ``lean``). The same bits
#: (``gpu-ab-v0.13f.log``), but the rs state-only loop took 1.044x the time of the default (geometric mean of 12,
#: 1.007x-1.073x, ``stages-hopper-v0.13f*.json``) and the op with CP 0.999x: an A/B, off;
#: FLASHGDN_HOPPER_LEAN_STATE_PASSES=1.
LEAN_STATE_PASSES = os.environ.get("FLASHGDN_HOPPER_LEAN_STATE_PASSES", "0") == "1"


#: Context parallelism's reverse splice (``splice.py``, the backward's) in its register-blocked build (``blocked``):
#: 512 threads, each a 4 x (BV / 4) block of a K-group's partial sums, M stored without bank conflicts and the next
#: step's M loaded during the products. The plain build (0) is bound by the SM's shared-memory pipe (~0.4 shared
#: loads per FMA on one warp a sub-partition). A reverse step: 3.5 -> 2.3 us at 4 value heads, 4.3 -> 2.5 at 8,
#: 7.1 -> 3.8 at 16, 14.5 -> 7.8 at 32 (``cp/splice-timing-v0.16c.json``). The forward splice stays plain: it
#: needs M's transpose in shared memory, and its blocked builds were slower than plain, by scalar transposed stores
#: (3.9 against 2.0 us a step at 4 heads) and by 4 x 4 register transposes (4.4 against 2.4 at 4 heads, 5.6
#: against 5.0 at 16: ``cp/splice-timing-v0.16h.json``; notes v0.16e, v0.16h). FLASHGDN_HOPPER_SPLICE_BLOCKED=0|1.
SPLICE_BLOCKED = os.environ.get("FLASHGDN_HOPPER_SPLICE_BLOCKED", "1") == "1"

#: the blocked splice's column widths, narrowest first (a CTA's 128 x BV block of the state). 32 is slower than 16
#: even where 16 needs two waves (8.7 against 7.8 us a step at 32 heads), and 8 slower where it needs two (5.2
#: against 3.8 at 16 heads).
SPLICE_WIDTHS = (8, 16)


def splice_width(Hv: int, num_seqs: int, num_sms: int = 132) -> int:
    """The blocked splice's BV: 8 where its grid (V / 8 CTAs per head and sequence, one CTA per SM for its shared
    memory) fits the SMs, else 16."""
    return SPLICE_WIDTHS[0] if num_seqs * Hv * (128 // SPLICE_WIDTHS[0]) <= num_sms else SPLICE_WIDTHS[1]


def splice_options(reverse: bool, Hv: int = 8, num_seqs: int = 1, num_sms: int = 132) -> dict:
    """``build_splice``'s options as ``SPLICE_BLOCKED`` sets them: the reverse splice blocked, at the width that
    ``splice_width`` picks; the forward splice, and both when off, plain (empty, so the plain builds keep their
    cache entries)."""
    return dict(blocked=True, BV=splice_width(Hv, num_seqs, num_sms)) if SPLICE_BLOCKED and reverse else {}


def lean_state_option() -> dict:
    """The ``lean`` build option of the rs loop and the walk as ``LEAN_STATE_PASSES`` sets it (empty when off, so the
    default builds keep their cache entries)."""
    return dict(lean=True) if LEAN_STATE_PASSES else {}


def rso_options() -> dict:
    """``build_chunk_forward_rso``'s options as ``RSO_LEAN_OUTPUT`` and ``RSO_LEAN_STATE`` set them (only those that
    differ from its defaults, so the default build keeps its cache entry)."""
    return {**({} if RSO_LEAN_OUTPUT else dict(lean_output=False)), **(dict(lean_state=True) if RSO_LEAN_STATE else {})}

#: V block of the chunk loop. 128 = the whole value head: Q K^T, Gam and Ag are computed once per head.
DEFAULT_BV = 128


@dataclass(frozen=True)
class ForwardConfig:
    """Everything a compile depends on; sequence lengths and counts are not part of it."""

    Hqk: int
    Hv: int
    K: int
    V: int
    io_dtype: str
    has_initial_state: bool
    store_final_state: bool
    state_v_first: bool
    BV: int = DEFAULT_BV


def num_chunk_slots(num_tokens: int, num_seqs: int, cu_cpu=None) -> int:
    """The number of chunk slots S. With the host copy of the offsets ``cu_cpu`` (a CPU tensor or sequence that
    equals ``cu_seqlens``, as the API's ``cu_seqlens_cpu`` must), the exact chunk count ``sum ceil(len / 64)``;
    without it ``ceil((T + 63 N) / 64)``, a bound from host-known sizes alone (each sequence adds at most one
    partial chunk), so no value of ``cu_seqlens`` is read on the host either way. Every per-slot tensor (stage 1's
    g~ and Ag, the backward's A, chunk states and state gradients: ~100 KB a slot and value head in all) is sized by
    it, so the exact count matters where many short sequences or CP segments (63 tokens of bound each) are packed."""
    if cu_cpu is not None:
        from ...cp.bounds import chunk_count

        return max(1, chunk_count(torch.as_tensor(cu_cpu, dtype=torch.int64)))
    return max(1, (num_tokens + (CHUNK - 1) * num_seqs + CHUNK - 1) // CHUNK)


def chunk_plan(cu_seqlens: torch.Tensor, num_tokens: int, num_seqs: int,
               cu_cpu=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk slots: ``(bounds, first_slot)`` as in :func:`chunk_plan_torch`, by one small kernel
    (``chunk_plan.py``) on a CUDA device, by torch ops elsewhere; ``cu_cpu``: as :func:`num_chunk_slots`."""
    if cu_seqlens.is_cuda:
        from .chunk_plan import build_chunk_plan

        n_slots = num_chunk_slots(num_tokens, num_seqs, cu_cpu)
        bounds = torch.empty((n_slots, 2), dtype=torch.int32, device=cu_seqlens.device)
        first = torch.empty((num_seqs,), dtype=torch.int32, device=cu_seqlens.device)
        build_chunk_plan()(cu_seqlens.to(torch.int32), bounds, first)
        return bounds, first
    return chunk_plan_torch(cu_seqlens, num_tokens, num_seqs, cu_cpu)


def chunk_plan_torch(cu_seqlens: torch.Tensor, num_tokens: int, num_seqs: int,
                     cu_cpu=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk slots, computed with torch ops on the tensor's device: ``(bounds, first_slot)``.

    ``bounds`` is int32 ``[S, 2]``: (first token, length) of every chunk slot, sequences in order; slots past
    the real chunk count get length 0 and their CTAs exit at once. ``first_slot`` is int32 ``[N]``: the slot
    of each sequence's first chunk (its chunk c is slot ``first_slot[n] + c``), which is how the chunk loop
    finds stage 1's per-slot outputs.
    """
    dev = cu_seqlens.device
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    n_chunks = (lens + CHUNK - 1) // CHUNK
    last = torch.cumsum(n_chunks, 0)  # one past each sequence's last chunk
    n_slots = num_chunk_slots(num_tokens, num_seqs, cu_cpu)
    slots = torch.arange(n_slots, device=dev, dtype=torch.int64)
    seq = torch.searchsorted(last, slots, right=True)
    idle = seq >= num_seqs
    seq = seq.clamp(max=num_seqs - 1)
    first_chunk = last[seq] - n_chunks[seq]
    start = cu[seq] + CHUNK * (slots - first_chunk)
    length = (cu[seq + 1] - start).clamp(min=0, max=CHUNK)
    length = torch.where(idle, torch.zeros_like(length), length)
    start = torch.where(idle, torch.zeros_like(start), start)
    bounds = torch.stack([start, length], dim=1).to(torch.int32).contiguous()
    return bounds, (last - n_chunks).to(torch.int32)


def chunk_bounds(cu_seqlens: torch.Tensor, num_tokens: int, num_seqs: int) -> torch.Tensor:
    """The ``bounds`` of :func:`chunk_plan` alone."""
    return chunk_plan(cu_seqlens, num_tokens, num_seqs)[0]


def slots_to_tokens(x: torch.Tensor, bounds: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Map a per-slot stage-1 output back to token order (for checks against the reference).

    ``x`` is ``[S, 64, ...]`` (row r of slot s); returns ``[num_tokens, ...]`` with zeros where no chunk
    lies (padded tail).
    """
    rows = torch.arange(CHUNK, device=x.device)
    start, length = bounds[:, :1].long(), bounds[:, 1:].long()
    valid = rows[None, :] < length
    tok = (start + rows[None, :])[valid]
    out = torch.zeros((num_tokens,) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    out[tok] = x[valid]
    return out


def _output(shape, dtype, device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass
class Stage1:
    """The outputs of stages 0 and 1 for one packed problem: chunk slots and the per-slot g~ and Ag (and the
    ungated A when asked for: the backward's). They depend on k, g, beta and the sequence offsets only, so passes
    over the same segments can share them."""

    bounds: torch.Tensor
    first_slot: torch.Tensor
    gcum: torch.Tensor
    Ag: torch.Tensor
    A: Optional[torch.Tensor] = None
    #: ``[Hv, S]`` float32, each chunk's bound on its transition's log norm (``kkt_inverse``'s ``chunk_bounds``)
    chunk_bound: Optional[torch.Tensor] = None
    #: ``[Hv, S]`` float32, the log of what each chunk's tokens inject, carried to its end (``chunk_injects``)
    chunk_inject: Optional[torch.Tensor] = None


def packed_offsets(cu_seqlens: Optional[torch.Tensor], B: int, T: int, device) -> Tuple[torch.Tensor, int]:
    """``(cu int32, N)``: the kernels' sequence offsets of varlen input, or of dense input ``[B, T, ...]`` run as
    B packed sequences of T tokens."""
    if cu_seqlens is None:
        return torch.arange(0, (B + 1) * T, T, device=device, dtype=torch.int32), B
    return cu_seqlens.to(torch.int32), cu_seqlens.shape[0] - 1


def host_offsets(cu_seqlens: Optional[torch.Tensor], cu_seqlens_cpu: Optional[torch.Tensor], B: int, T: int):
    """The host copy of the packed offsets where the host knows them without reading the device: the caller's copy
    of varlen offsets (or None), or dense input's ``0, T, ..., B T``."""
    if cu_seqlens is None:
        return torch.arange(0, (B + 1) * T, T)
    return cu_seqlens_cpu


def hopper_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor],
    state_v_first: bool,
    return_intermediates: bool = False,
    chunk_loop: Optional[str] = None,
    with_output: bool = True,
    stage1: Optional[Stage1] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Run the forward kernels. q, k, v contiguous bf16/fp16 on an SM90 device; L2 norm already applied.

    ``with_output=False`` runs the state-only pass (the "rs" loop without q, P and O, or the "uw" loop's when
    that is the chunk loop; o is returned as None), which is what context parallelism's transition passes need.

    ``stage1``: stages 0 and 1 already run on the same k, g, beta and offsets (``hopper_stage1``), skipped here.
    ``cu_seqlens_cpu``: the host copy of ``cu_seqlens`` if there is one (the chunk slots are then counted exactly,
    ``num_chunk_slots``; dense input needs none).

    Returns ``(o, final_state or None)``; with ``return_intermediates`` also a dict of the stage outputs
    (``gcum``, ``Ag``, token-major like the reference's) for stage-by-stage checks.
    """
    from .chunk_forward import build_chunk_forward
    from .chunk_forward_rs import build_chunk_forward_rs
    from .chunk_forward_rso import build_chunk_forward_rso
    from .chunk_forward_uw import build_chunk_forward_uw
    from .chunk_forward_ws import build_chunk_forward_ws

    chunk_loop = chunk_loop or DEFAULT_CHUNK_LOOP
    if PRECISE:
        if q.dtype != torch.bfloat16:
            raise NotImplementedError(f"the Hopper backend's precise mode (FLASHGDN_HOPPER_PRECISE=1) takes bfloat16 "
                                      f"q/k/v, got {q.dtype}")
        chunk_loop = "rs"  # the only loop with a precise mode
    if chunk_loop not in CHUNK_LOOPS:
        raise ValueError(f"chunk_loop must be one of {CHUNK_LOOPS}, got {chunk_loop!r}")
    fused = chunk_loop == "fused" and with_output and stage1 is None
    if chunk_loop == "fused" and not fused:
        chunk_loop = "rsd"  # stage 1 exists already (or no output): the same loop reading its tiles

    B, T, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    dev = q.device
    cu, N = packed_offsets(cu_seqlens, B, T, dev)
    TT = B * T
    qf = q.reshape(1, TT, Hqk, K)
    kf = k.reshape(1, TT, Hqk, K)
    vf = v.reshape(1, TT, Hv, V)
    gf = g.reshape(1, TT, Hv).to(torch.float32).contiguous()
    bf = beta.reshape(1, TT, Hv).to(torch.float32).contiguous()

    cfg = ForwardConfig(
        Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=tl_dtype(q.dtype),
        has_initial_state=initial_state is not None,
        store_final_state=output_final_state,
        state_v_first=state_v_first,
    )
    if chunk_loop == "rso" and with_output:
        main = build_chunk_forward_rso(
            Hqk, Hv, K, V, cfg.io_dtype, cfg.has_initial_state, cfg.store_final_state, cfg.state_v_first,
            **rso_options()
        )
    elif chunk_loop == "uw":
        main = build_chunk_forward_uw(
            Hqk, Hv, K, V, cfg.io_dtype, cfg.has_initial_state, cfg.store_final_state, cfg.state_v_first, with_output
        )
    elif fused:
        main = build_chunk_forward_rs(
            Hqk, Hv, K, V, cfg.io_dtype, cfg.has_initial_state, cfg.store_final_state, cfg.state_v_first, True,
            decayed_k=not FUSED_STATE_P, inverse_in_loop=True, register_inverse=FUSED_REGISTER_INVERSE,
            state_p=FUSED_STATE_P, swizzled_v=FUSED_SWIZZLED_V,
        )
    elif not with_output or chunk_loop in ("rs", "rsd", "rso"):
        main = build_chunk_forward_rs(
            Hqk, Hv, K, V, cfg.io_dtype, cfg.has_initial_state, cfg.store_final_state, cfg.state_v_first, with_output,
            PRECISE, decayed_k=chunk_loop == "rsd", **({} if chunk_loop == "rsd" else lean_state_option()),
        )
    elif chunk_loop == "ws":
        main = build_chunk_forward_ws(
            Hqk, Hv, K, V, cfg.io_dtype, cfg.has_initial_state, cfg.store_final_state, cfg.state_v_first
        )
    else:
        main = build_chunk_forward(
            Hqk, Hv, K, V, cfg.BV, cfg.io_dtype, cfg.has_initial_state, cfg.store_final_state, cfg.state_v_first
        )

    if stage1 is None and (not fused or return_intermediates):  # the fused loop's own g~ and Ag stay inside it
        stage1 = hopper_stage1(kf, gf, bf, cu, cu_cpu=host_offsets(cu_seqlens, cu_seqlens_cpu, B, T))

    state_shape = (Hv, V, K) if state_v_first else (Hv, K, V)
    if initial_state is not None:
        h0 = initial_state.to(torch.float32).contiguous()
    else:
        h0 = torch.empty((1,) + state_shape, device=dev, dtype=torch.float32)
    ht = _output(((N if output_final_state else 1),) + state_shape, torch.float32, dev)
    o = _output((1, TT if with_output else 1, Hv, V), q.dtype, dev)
    if fused:
        main(qf, kf, vf, gf, bf, cu, h0, float(scale), o, ht)
    else:
        main(qf, kf, vf, stage1.gcum, stage1.Ag, cu, stage1.first_slot, h0, float(scale), o, ht)

    o = o.reshape(B, T, Hv, V) if with_output else None
    final = ht if output_final_state else None
    if return_intermediates:  # stage 1's (with the fused loop: the kkt_inverse kernel's, run for this)
        bounds, gcum, Ag = stage1.bounds, stage1.gcum, stage1.Ag
        S = bounds.shape[0]
        gc_tok = slots_to_tokens(gcum.reshape(Hv, S, CHUNK).permute(1, 2, 0), bounds, TT)
        ag_tok = slots_to_tokens(Ag.permute(0, 2, 1, 3), bounds, TT)
        return o, final, {"gcum": gc_tok.reshape(B, T, Hv), "Ag": ag_tok.reshape(B, T, Hv, CHUNK)}
    return o, final


def hopper_stage1(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
                  store_inverse: bool = False, cu_cpu=None, chunk_bounds: bool = False,
                  inject_v: Optional[torch.Tensor] = None) -> Stage1:
    """Stages 0 and 1 on packed ``[1, T, ...]`` k, g, beta with offsets ``cu_seqlens`` (device, int32): the chunk
    plan (exactly as many slots as chunks when the host copy ``cu_cpu`` is given), then ``kkt_inverse`` (also
    storing the ungated A, in k's dtype, with ``store_inverse``, and each chunk's bound on its transition's log norm
    with ``chunk_bounds``; with ``inject_v``, the values ``[1, T, Hv, V]`` as well, what each chunk's tokens inject,
    the kernel's ``chunk_injects``)."""
    from .kkt_inverse import build_kkt_inverse

    _, TT, Hqk, K = k.shape
    Hv = g.shape[2]
    N = cu_seqlens.shape[0] - 1
    dev = k.device
    bounds, first_slot = chunk_plan(cu_seqlens, TT, N, cu_cpu)
    S = bounds.shape[0]
    gcum = _output((Hv, S * CHUNK), torch.float32, dev)
    Ag = _output((S, Hv, CHUNK, CHUNK), k.dtype, dev)
    io = tl_dtype(k.dtype)
    args = [k, g.to(torch.float32).contiguous(), beta.to(torch.float32).contiguous(), bounds, gcum, Ag]
    A = _output((S, Hv, CHUNK, CHUNK), k.dtype, dev) if store_inverse else None
    chunk_bound = _output((Hv, S), torch.float32, dev) if chunk_bounds else None
    chunk_inject = None
    # the optional outputs last, in the kernel's order; only the options asked for are passed
    extra = {**({"store_inverse": True} if store_inverse else {}), **({"chunk_bounds": True} if chunk_bounds else {})}
    if inject_v is not None:
        if not chunk_bounds:
            raise ValueError("inject_v comes with chunk_bounds (the kernel's chunk_injects needs it)")
        if inject_v.shape[:3] != (1, TT, Hv) or inject_v.shape[3] != K or inject_v.dtype != k.dtype:
            raise ValueError(f"inject_v must be [1, {TT}, {Hv}, {K}] {k.dtype}, got {tuple(inject_v.shape)} "
                             f"{inject_v.dtype}")
        chunk_inject = _output((Hv, S), torch.float32, dev)
        extra["chunk_injects"] = True
        args.insert(3, inject_v.contiguous())
    build_kkt_inverse(Hqk, Hv, K, io, io, **extra, async_loads=KKT_ASYNC_LOADS,
                      **_kkt_build_options(Hv // Hqk, store_inverse))(*args, *(x for x in (A, chunk_bound, chunk_inject)
                                                                              if x is not None))
    return Stage1(bounds, first_slot, gcum, Ag, A, chunk_bound, chunk_inject)


def _kkt_build_options(group: int, store_inverse: bool = False) -> dict:
    # occupancy and the switched options; the four-per-SM build passes nothing (build_kkt_inverse's own default), so
    # that its cache entry stays the same
    blocks = kkt_blocks_per_sm(group, store_inverse)
    return {**({} if blocks == 4 else dict(blocks_per_sm=blocks)), **kkt_options()}


def kkt_options() -> dict:
    """Stage 1's build options that the host's switches add (``diag16`` with ``mma32`` by default, ``diag16`` alone
    with KKT_MMA32 off, either with ``registers16`` under KKT_REGISTERS16 (and with it ``registers8`` under
    KKT_REGISTERS8 and ``merge16_registers`` under KKT_MERGE16_REGISTERS; with that and KKT_MMA32,
    ``merge32_quadrants`` under KKT_MERGE32_QUADRANTS, else ``merge32_registers`` under KKT_MERGE32_REGISTERS), else
    ``triangle``)."""
    if KKT_DIAG16:
        merge16 = KKT_REGISTERS16 and KKT_MERGE16_REGISTERS
        quadrants = KKT_MMA32 and merge16 and KKT_MERGE32_QUADRANTS
        return dict(diag16=True, **({"mma32": True} if KKT_MMA32 else {}),
                    **({"registers16": True} if KKT_REGISTERS16 else {}),
                    **({"registers8": True} if KKT_REGISTERS16 and KKT_REGISTERS8 else {}),
                    **({"merge16_registers": True} if merge16 else {}),
                    **({"merge32_registers": True} if KKT_MMA32 and merge16 and KKT_MERGE32_REGISTERS
                       and not quadrants else {}),
                    **({"merge32_quadrants": True} if quadrants else {}))
    return dict(triangle=True) if KKT_TRIANGLE else {}


def hopper_transition_pairs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stage1: Stage1,
                            start: Optional[torch.Tensor], cu_seqlens: torch.Tensor, unread=None,
                            h0: Optional[torch.Tensor] = None, m_bound: Optional[torch.Tensor] = None,
                            b_start: Optional[torch.Tensor] = None,
                            chunk_bound: Optional[torch.Tensor] = None,
                            chunk_inject: Optional[torch.Tensor] = None,
                            h0_log_norm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Context parallelism's transition pass with stage 1 shared (the rs loop's ``transition_pairs`` variant):
    packed ``[1, T, ...]`` inputs over segments ``cu_seqlens``; ``start [S, 2 Hv, K, V]`` float32 K-major, head
    2h the b pass of value head h and 2h + 1 its M pass (v = 0). Returns the end states, same layout.
    ``unread = (index, "forward" | "backward")`` (``flashgdn.cp.SegmentIndex``): the items the splices never read
    walk no chunk (their end is their start; the kernel's ``skip_unread``). ``h0`` (with ``unread``, instead of
    ``start``): the sequences' initial states ``[sequences, Hv, K, V]``, from which the kernel makes the start
    states itself (its ``starts_from_h0``: h0 for b on a sequence's first segment, else zero; the identity for M).
    ``m_bound`` (with ``h0``): ``[S, Hv]`` float32, the log of a bound on each segment's ||M||_2
    (``flashgdn.cp.bounds.transition_log_bounds``); an M below float32's range is then stored as zero without a walk
    (the kernel's ``negligible_m``). ``b_start`` (with ``m_bound``): ``[S, Hv]`` int32, the chunks each b item leaves
    out (``flashgdn.cp.bounds.b_start_chunks``; the kernel's ``late_b``). ``chunk_bound`` (with ``h0``, instead of
    ``m_bound``): stage 1's ``[Hv, S]`` per-chunk bounds (``hopper_stage1(..., chunk_bounds=True)``), from which the
    kernel makes each M item's bound itself (its ``chunk_bounds``), and the pairs returned carry the flags of the M
    it stored as zero (``m_zero_of``), which ``hopper_splice`` uses to leave their products out. ``chunk_inject``
    (with ``chunk_bound``): stage 1's ``[Hv, S]`` injections (``hopper_stage1(..., inject_v=v)``), with
    ``h0_log_norm [sequences, Hv]`` float32 (log of each initial state's Frobenius norm): each b item then makes its
    late start itself (the kernel's ``chunk_late_b``; PyTorch counterpart ``flashgdn.cp.bounds.segment_b_starts``)."""
    from .chunk_forward_rs import build_chunk_forward_rs

    _, TT, Hqk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    mode = "" if unread is None else unread[1]
    if (h0 is None) == (start is None) or (h0 is not None and unread is None):
        raise ValueError("hopper_transition_pairs takes start, or h0 with unread (the segment index)")
    from_h0 = {} if h0 is None else dict(starts_from_h0=True)
    if chunk_bound is not None:
        if m_bound is not None or b_start is not None or h0 is None:
            raise ValueError("chunk_bound comes with h0, instead of m_bound and b_start")
        if chunk_bound.shape != (Hv, stage1.Ag.shape[0]):
            raise ValueError(f"chunk_bound must be [{Hv}, {stage1.Ag.shape[0]}] (value heads, chunk slots), got "
                             f"{tuple(chunk_bound.shape)}")
        from_h0.update(negligible_m=True, chunk_bounds=True)
    if (chunk_inject is None) != (h0_log_norm is None) or chunk_inject is not None and chunk_bound is None:
        raise ValueError("chunk_inject and h0_log_norm come together, with chunk_bound")
    if chunk_inject is not None:
        if chunk_inject.shape != (Hv, stage1.Ag.shape[0]):
            raise ValueError(f"chunk_inject must be [{Hv}, {stage1.Ag.shape[0]}] (value heads, chunk slots), got "
                             f"{tuple(chunk_inject.shape)}")
        n_seqs = unread[0].first.shape[0]
        if h0_log_norm.shape != (n_seqs, Hv):
            raise ValueError(f"h0_log_norm must be [{n_seqs}, {Hv}] (sequences, value heads), got "
                             f"{tuple(h0_log_norm.shape)}")
        from_h0["chunk_late_b"] = True
    if m_bound is not None:
        from_h0["negligible_m"] = True
    if b_start is not None:
        if m_bound is None:
            raise ValueError("b_start comes with m_bound (the kernel's late_b is built beside negligible_m)")
        from_h0["late_b"] = True
    kernel = build_chunk_forward_rs(Hqk, Hv, K, V, tl_dtype(k.dtype), True, True, False, with_output=False,
                                    transition_pairs=True, skip_unread=mode, **lean_state_option(), **from_h0)
    end = _output((N, 2 * Hv, K, V), torch.float32, k.device)
    o1 = torch.empty((1, 1, Hv, V), dtype=k.dtype, device=k.device)  # not touched by a state-only pass
    first_states = start if h0 is None else h0
    args = (q, k, v, stage1.gcum, stage1.Ag, cu_seqlens, stage1.first_slot,
            first_states.to(torch.float32).contiguous(), 1.0, o1, end)
    if unread is not None:
        index = unread[0]
        args += (index.seg_seq.to(torch.int64), index.first.to(torch.int64), index.count.to(torch.int64))
    if m_bound is not None:
        if m_bound.shape != (N, Hv):
            raise ValueError(f"m_bound must be [{N}, {Hv}] (segments, value heads), got {tuple(m_bound.shape)}")
        args += (m_bound.to(torch.float32).contiguous(),)
    if b_start is not None:
        if b_start.shape != (N, Hv):
            raise ValueError(f"b_start must be [{N}, {Hv}] (segments, value heads), got {tuple(b_start.shape)}")
        args += (b_start.to(torch.int32).contiguous(),)
    m_zero = None
    if chunk_bound is not None:
        m_zero = torch.empty((N, Hv), dtype=torch.int32, device=k.device)
        args += (chunk_bound.to(torch.float32).contiguous(), m_zero)
    if chunk_inject is not None:
        args += (chunk_inject.to(torch.float32).contiguous(), h0_log_norm.to(torch.float32).contiguous())
    kernel(*args)
    if m_zero is not None:
        set_m_zero(end, m_zero)
    return end


#: the attribute of a transition pass's pairs that holds its ``m_zero`` flags (``set_m_zero``)
_M_ZERO = "_flashgdn_m_zero"


def set_m_zero(pairs: torch.Tensor, m_zero: torch.Tensor) -> None:
    """Attach to ``pairs`` the ``[S, Hv]`` int32 flags of the M items the transition pass stored as zero (its
    ``chunk_bounds`` build), for the splices (``m_zero_of``). A hint only: the zeros are in ``pairs`` themselves,
    so a copy of ``pairs`` without the flags (a clone, a cast) splices to the same values, with every product made."""
    setattr(pairs, _M_ZERO, m_zero)


def m_zero_of(pairs: torch.Tensor) -> Optional[torch.Tensor]:
    """The flags ``set_m_zero`` attached to ``pairs`` (the same tensor object), else None."""
    return getattr(pairs, _M_ZERO, None)


def hopper_splice(pairs: torch.Tensor, start: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
                  num_segments: int, D: Optional[torch.Tensor] = None,
                  from_known: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Context parallelism's splice in one kernel (``splice.py``): from the transition pass's ``pairs``
    ``[S, 2 Hv, K, V]`` float32, every segment's start state from the sequences' initial states ``start``
    ``[N, Hv, K, V]`` (forward), or, with ``D`` (the walk of every segment from zero, ``[S, Hv, K, V]``), every
    segment's end gradient from the final states' gradients ``start`` (backward). ``first``/``count``: each
    sequence's first segment and segment count (``flashgdn.cp.SegmentIndex``). ``from_known`` (forward only,
    ``[N]``): the rows are chains of segments from known starts (``flashgdn.cp.exact.starts_from_known``), and
    a chain whose entry is nonzero begins inside its sequence, so its first step is ``M start + b`` (the splice's
    ``chains`` build). Where ``pairs`` carry the transition pass's flags of the M it stored as zero (``m_zero_of``),
    the splice's ``m_zero`` build leaves those products out (a step is then its b, or D). Returns
    ``[S, Hv, K, V]``."""
    from .splice import build_splice

    _, Hv, K, V = start.shape
    reverse = D is not None
    if reverse and from_known is not None:
        raise ValueError("from_known is the forward splice's (its chains from known starts), not the reverse's")
    m_zero = m_zero_of(pairs)
    if m_zero is not None and m_zero.shape != (pairs.shape[0], Hv):
        raise ValueError(f"the pairs' m_zero flags must be [{pairs.shape[0]}, {Hv}], got {tuple(m_zero.shape)}")
    out = _output((num_segments, Hv, K, V), torch.float32, start.device)
    start = start.to(torch.float32).contiguous()
    num_sms = torch.cuda.get_device_properties(start.device).multi_processor_count if start.is_cuda else 132
    args = (pairs.to(torch.float32).contiguous(), D.to(torch.float32).contiguous() if reverse else start, start,
            first.to(torch.int64), count.to(torch.int64))
    flags = {} if m_zero is None else dict(m_zero=True)
    tail = () if m_zero is None else (m_zero.to(torch.int32).contiguous(),)
    if from_known is not None:
        build_splice(Hv, K, V, False, chains=True, **flags)(*args, from_known.to(torch.int64), *tail, out)
    else:
        build_splice(Hv, K, V, reverse, **splice_options(reverse, Hv, start.shape[0], num_sms), **flags)(
            *args, *tail, out)
    return out


def hopper_chain_index(index, known_index, m: int):
    """The backward's chains from the forward's segment starts (``flashgdn.cp.exact.chain_index_tensors``) by one
    kernel (``segment_index.build_chain_index``) instead of eight small torch ops: ``(chains, jf)``."""
    from ...cp.plan import SegmentIndex
    from .segment_index import build_chain_index

    fseq = known_index.seg_seq
    F, N = fseq.numel(), index.first.numel()
    if known_index.first.numel() != N:
        raise ValueError(f"the known plan has {known_index.first.numel()} sequences, this one {N}")
    jf, chain_first, chain_count = (torch.empty((F,), dtype=torch.int64, device=fseq.device) for _ in range(3))
    build_chain_index()(fseq, known_index.first, index.first, index.count, int(m), jf, chain_first, chain_count)
    return SegmentIndex(index.seg_cu, index.seg_seq, chain_first, chain_count), jf


def hopper_segment_index(plan, cu_seqlens: torch.Tensor):
    """Context parallelism's segment index tensors (``flashgdn.cp.SegmentIndex``) by one kernel
    (``segment_index.py``) instead of ~16 small torch ops; ``flashgdn.cp.plan.segment_index_tensors`` when the
    plan does not split."""
    from ...cp.plan import SegmentIndex, segment_index_tensors
    from .segment_index import build_segment_index

    if plan.segment_chunks is None:
        return segment_index_tensors(plan, cu_seqlens)
    N, S = plan.first.numel(), plan.num_segments
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() != N + 1:
        raise ValueError(f"cu_seqlens must be [N + 1] = [{N + 1}] for this plan, got {tuple(cu_seqlens.shape)}")
    dev = cu_seqlens.device
    seg_cu = torch.empty((S + 1,), dtype=cu_seqlens.dtype, device=dev)
    seg_seq = torch.empty((S,), dtype=torch.int64, device=dev)
    first = torch.empty((N,), dtype=torch.int64, device=dev)
    count = torch.empty((N,), dtype=torch.int64, device=dev)
    build_segment_index(tl_dtype(cu_seqlens.dtype))(cu_seqlens.contiguous(), plan.segment_chunks * CHUNK, seg_cu,
                                                    seg_seq, first, count)
    return SegmentIndex(seg_cu, seg_seq, first, count)
