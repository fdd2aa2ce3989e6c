"""The forward in phases: stage 1 of later chunks on the SMs that the chunk loop leaves idle.

The forward is stage 1 (``kkt_inverse``: every chunk's g~ and Ag at once, by throughput over the whole GPU) and then
the chunk loop (one CTA per sequence and value head walking its chunks in order). Where the loop has fewer CTAs than
the GPU has SMs (one or two long sequences at 16-64 value heads, a long sequence beside short ones), most SMs idle
while it runs, and stage 1 before it, 15-25% of the op on such shapes, is on the critical path for nothing.

Run in phases, the loop walks chunk windows ``[c_0, c_1), [c_1, c_2), ...`` of every sequence, one launch per
window; a window's launch starts from the state the previous one stored (float32, so the same bits as one launch)
and reads the g~ and Ag of its own window's chunks, which a stage-1 launch of that window alone made. Only the first
window's stage 1 precedes the loop: the others run on a second stream while the loop walks the window before, on
the SMs it leaves idle. The loop's launches go on a stream of higher priority than the caller's, where stage 1
runs, so that the loop's CTAs are placed first when both are waiting.

The windows (``plan_windows``) come from a small timeline model: a window's stage 1 takes its chunks' stage-1 work
spread over the SMs the loop leaves free, the loop a fixed time per chunk, each launch a fixed cost. Windows grow as
fast as stage 1 keeps ahead of the loop; the first one is the size that makes the modelled op shortest, and the
forward is phased only where the model says it gains. It needs the host to know the sequence lengths (dense input,
or ``cu_seqlens_cpu``), as the chunk slots' exact count does; nothing is read back from the device.

PyTorch counterpart: none of its own (the same outputs as ``forward.hopper_forward`` unphased, which is checked
bit for bit on the GPU); the window plan's torch form is ``window_plan_torch``.
"""
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .common import CHUNK

#: FLASHGDN_HOPPER_PHASES=0: never phased (one stage-1 launch, then one loop launch)
PHASES = os.environ.get("FLASHGDN_HOPPER_PHASES", "1") == "1"
#: a window's stage 1 starts once the loop's launch before it may have placed its CTAs: after the end of the loop of
#: the window two back (or the first window's stage 1) and a short spin on its stream (``STAGGER_CYCLES``), instead of
#: as soon as the stage 1 before it ends. Stream priorities do not reach a CUDA graph's kernels (their graph launches
#: at one priority), and a stage-1 launch that is waiting when a loop launch becomes ready takes the SMs the loop
#: needs whole (214.5 KB of shared memory a CTA) a few CTAs at a time. FLASHGDN_HOPPER_PHASE_STAGGER=0: off.
STAGGER = os.environ.get("FLASHGDN_HOPPER_PHASE_STAGGER", "1") == "1"
STAGGER_CYCLES = 6000


@dataclass(frozen=True)
class PhaseModel:
    """The timeline model's constants (H200, bf16, K = V = 128).

    ``loop_chunk_us``: one chunk of the rso loop where the loop leaves SMs idle (16/32 28672+4096: 0.81 ms of which
    ~0.15 ms stage 1, over 448 chunks; the CP cost model's 2.21 us is v0.12's loop at full clocks' fit). A low
    figure sizes the windows so that stage 1 keeps ahead even of a fast loop.
    ``kkt_chunk_qk_head_us`` / ``kkt_chunk_head_us``: stage 1 over the whole GPU, per chunk and qk head / value head
    (``flashgdn.cp.plan.CostModel``'s fit), so x SMs its SM time.
    ``launch_us``: what a window's launch adds to the loop's path (launch, state load and store, ring fill).
    ``min_gain``: the modelled fraction that phasing must save."""

    num_sms: int = 132
    loop_chunk_us: float = 1.45
    kkt_chunk_qk_head_us: float = 0.0074
    kkt_chunk_head_us: float = 0.0064
    kkt_launch_us: float = 4.0
    launch_us: float = 6.0
    min_gain: float = 0.03
    max_windows: int = 12

    @staticmethod
    def for_device(device: Optional[torch.device] = None) -> "PhaseModel":
        if device is not None and device.type == "cuda" and torch.cuda.is_available():
            return PhaseModel(num_sms=torch.cuda.get_device_properties(device).multi_processor_count)
        return PhaseModel()

    def kkt_sm_us(self, chunks: int, Hqk: int, Hv: int) -> float:
        """Stage 1's SM time for ``chunks`` chunks (all heads)."""
        return chunks * (Hqk * self.kkt_chunk_qk_head_us + Hv * self.kkt_chunk_head_us) * self.num_sms


def window_chunks(chunks: Sequence[int], lo: int, hi: int) -> List[int]:
    """Each sequence's chunk count in the window ``[lo, hi)``."""
    return [max(0, min(hi, c) - lo) for c in chunks]


def timeline_us(chunks: Sequence[int], bounds: Sequence[int], Hqk: int, Hv: int, model: PhaseModel) -> float:
    """The modelled op for window boundaries ``bounds`` (``0 = c_0 < c_1 < ... = max(chunks)``; ``[0, max]`` is the
    forward unphased)."""
    sms = model.num_sms
    windows = list(zip(bounds[:-1], bounds[1:]))
    work = [model.kkt_sm_us(sum(window_chunks(chunks, lo, hi)), Hqk, Hv) for lo, hi in windows]
    # the first window's stage 1 on the whole GPU, the others on the SMs the loop of the window before leaves free
    kkt_end = model.kkt_launch_us + work[0] / sms
    loop_end = kkt_end
    for w, (lo, hi) in enumerate(windows):
        loop_start = max(loop_end, kkt_end) + (model.launch_us if w else 0.0)
        active = sum(1 for c in chunks if c > lo)
        steps = max(window_chunks(chunks, lo, hi))
        loop_end = loop_start + model.launch_us + steps * model.loop_chunk_us
        if w + 1 < len(windows):
            free = sms - active * Hv
            if free <= 0:
                return math.inf
            kkt_end = max(loop_start, kkt_end) + model.kkt_launch_us + work[w + 1] / free
    return loop_end


def _grow(chunks: Sequence[int], first: int, Hqk: int, Hv: int, model: PhaseModel) -> List[int]:
    """Window boundaries from a first window of ``first`` chunks: each next window the largest whose stage 1, on
    the SMs the loop leaves free, ends before the loop of the window before."""
    longest = max(chunks)
    bounds = [0, min(first, longest)]
    while bounds[-1] < longest:
        lo_prev, lo = bounds[-2], bounds[-1]
        active = sum(1 for c in chunks if c > lo_prev)
        free = model.num_sms - active * Hv
        if free <= 0:
            return [0, longest]
        budget = (max(window_chunks(chunks, lo_prev, lo)) * model.loop_chunk_us) * free - model.kkt_launch_us * free
        step, size = 1, 0
        while lo + size < longest and model.kkt_sm_us(sum(window_chunks(chunks, lo, lo + size + step)), Hqk, Hv) <= budget:
            size += step
            step *= 2
        while step > 1:  # back off to the largest that fits
            step //= 2
            if lo + size + step <= longest and \
                    model.kkt_sm_us(sum(window_chunks(chunks, lo, lo + size + step)), Hqk, Hv) <= budget:
                size += step
        size = max(size, 1)
        if len(bounds) == model.max_windows:
            size = longest - lo  # the rest in one window
        bounds.append(min(lo + size, longest))
    return bounds


def plan_windows(chunks: Sequence[int], Hqk: int, Hv: int, model: Optional[PhaseModel] = None) -> Optional[List[int]]:
    """The window boundaries ``[0, c_1, ..., max(chunks)]`` for sequences of ``chunks`` chunks, or None where the
    forward runs unphased (the loop fills the GPU, or the model gains less than ``min_gain``)."""
    model = model or PhaseModel()
    chunks = [int(c) for c in chunks]
    if not chunks or max(chunks) < 4 or sum(1 for c in chunks if c > 0) * Hv >= model.num_sms:
        return None
    unphased = timeline_us(chunks, [0, max(chunks)], Hqk, Hv, model)
    best, best_us = None, unphased * (1.0 - model.min_gain)
    for first in (2, 4, 8, 16, 32, 64):
        if first >= max(chunks):
            break
        bounds = _grow(chunks, first, Hqk, Hv, model)
        if len(bounds) < 3:
            continue
        us = timeline_us(chunks, bounds, Hqk, Hv, model)
        if us < best_us:
            best, best_us = bounds, us
    return best


def sequence_chunks(cu_host) -> List[int]:
    """Each sequence's chunk count from the host copy of the offsets."""
    cu = torch.as_tensor(cu_host, dtype=torch.int64)
    return ((cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK).tolist()


def window_plan_torch(cu_seqlens: torch.Tensor, lo: int, hi: int, num_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The window build of ``chunk_plan`` by torch ops: ``(bounds [num_slots, 2], first_slot [N])`` int32 for
    chunks ``lo .. hi - 1`` of every sequence (slots past the window's chunks ``(0, 0)``)."""
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]
    counts = (torch.clamp(torch.minimum((lens + CHUNK - 1) // CHUNK, torch.full_like(lens, hi)) - lo, min=0))
    first = torch.cumsum(counts, 0) - counts
    bounds = torch.zeros((num_slots, 2), dtype=torch.int64, device=cu.device)
    for n in range(lens.shape[0]):
        for c in range(int(counts[n])):
            start = int(cu[n]) + (lo + c) * CHUNK
            bounds[int(first[n]) + c] = torch.tensor([start, min(int(cu[n + 1]) - start, CHUNK)])
    return bounds.to(torch.int32), first.to(torch.int32)


_LOOP_STREAMS: Dict[torch.device, "torch.cuda.Stream"] = {}


def loop_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream of the loop's launches: of the highest priority, one per device, made on first use."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    if device not in _LOOP_STREAMS:
        highest = torch.cuda.Stream.priority_range()[1]
        _LOOP_STREAMS[device] = torch.cuda.Stream(device=device, priority=highest)
    return _LOOP_STREAMS[device]


def phased_forward(qf, kf, vf, gf, bf, cu, cu_host, bounds: Sequence[int], scale: float,
                   initial_state: Optional[torch.Tensor], output_final_state: bool, state_v_first: bool,
                   o: torch.Tensor, ht: torch.Tensor) -> None:
    """Run the forward in the windows ``bounds`` on packed ``[1, T, ...]`` inputs (g, beta float32), writing o and,
    with ``output_final_state``, ht (``[N, ...]``), as ``forward.hopper_forward``'s one launch would."""
    from .chunk_forward_rso import build_chunk_forward_rso
    from .chunk_plan import build_chunk_plan
    from .common import tl_dtype
    from .forward import _output, rso_options, run_kkt_inverse

    _, TT, Hqk, K = kf.shape
    Hv, V = vf.shape[2], vf.shape[3]
    N = cu.shape[0] - 1
    dev = qf.device
    io = tl_dtype(qf.dtype)
    chunks = sequence_chunks(cu_host)
    windows = list(zip(bounds[:-1], bounds[1:]))
    last = len(windows) - 1
    state_shape = (Hv, V, K) if state_v_first else (Hv, K, V)

    # everything made on the caller's stream before the fork (its memory is then the caller stream's, which waits
    # for the loop's stream at the end)
    plans, stage1 = [], []
    for lo, hi in windows:
        S = max(1, sum(window_chunks(chunks, lo, hi)))
        plans.append((torch.empty((S, 2), dtype=torch.int32, device=dev),
                      torch.empty((N,), dtype=torch.int32, device=dev)))
        stage1.append((_output((Hv, S * CHUNK), torch.float32, dev), _output((S, Hv, CHUNK, CHUNK), qf.dtype, dev)))
    states = [torch.empty((N,) + state_shape, device=dev, dtype=torch.float32) for _ in range(min(2, last))]
    h0_first = (initial_state.to(torch.float32).contiguous() if initial_state is not None
                else torch.empty((1,) + state_shape, device=dev, dtype=torch.float32))

    plan = build_chunk_plan(window=True)
    caller = torch.cuda.current_stream(dev)
    loops = loop_stream(dev)
    loops.wait_stream(caller)
    ready = []
    with torch.cuda.stream(loops):
        for (lo, hi), (b, f) in zip(windows, plans):
            plan(cu, lo, hi, b, f)
        run_kkt_inverse(kf, gf, bf, plans[0][0], *stage1[0])
        first_done = torch.cuda.Event()
        first_done.record(loops)
    caller.wait_event(first_done)
    mains = [build_chunk_forward_rso(Hqk, Hv, K, V, io, w > 0 or initial_state is not None,
                                     w < last or output_final_state, state_v_first, window=True, **rso_options())
             for w in range(len(windows))]

    def stage1_of(w):  # on the caller's stream
        if STAGGER:
            torch.cuda._sleep(STAGGER_CYCLES)
        run_kkt_inverse(kf, gf, bf, plans[w][0], *stage1[w])
        ev = torch.cuda.Event()
        ev.record(caller)
        ready.append(ev)

    if not STAGGER:
        for w in range(1, len(windows)):
            stage1_of(w)
    elif len(windows) > 1:
        stage1_of(1)
    for w, (lo, hi) in enumerate(windows):
        with torch.cuda.stream(loops):
            h0 = h0_first if w == 0 else states[(w - 1) % 2]
            out_state = ht if w == last else states[w % 2]
            if w:
                loops.wait_event(ready[w - 1])
            mains[w](qf, kf, vf, stage1[w][0], stage1[w][1], cu, plans[w][1], h0, float(scale), lo, hi, o, out_state)
            ended = torch.cuda.Event()
            ended.record(loops)
        if STAGGER and w + 2 < len(windows):
            caller.wait_event(ended)  # window w + 2's stage 1 as window w + 1's loop starts
            stage1_of(w + 2)
    caller.wait_stream(loops)
