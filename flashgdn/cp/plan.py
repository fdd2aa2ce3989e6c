"""Context-parallel planning: whether to split long sequences into segments, and how long the segments are.

Exact context parallelism (DESIGN.md §4, ``docs/context-parallel.md``) runs a forward in three steps:

1. per segment, in parallel: the state pass, giving the segment's affine map ``S_end = M S_start + b`` (``b``
   from a zero state, or from the sequence's initial state for a first segment, whose end state is then exact
   at once; ``M`` from the identity with zero values);
2. splice, sequentially over the segments of each sequence: ``S_{i+1} = M_i S_i + b_i``;
3. the fused forward on all segments at once, each from its true start state.

The plan needs the sequence lengths on the host (``cu_seqlens_cpu``, or dense input); without them the
operator runs without context parallelism rather than synchronise.

The cost model is deliberately small: a pass over a set of work items (segment x value head, each a number of
chunks walked serially) takes ``launch + max(longest item, total / SMs) * chunk time``; CP pays a state pass
over twice the heads (b and M; per chunk cheaper than the forward) plus one splice step per segment, and wins
when it shortens the longest item enough. Constants are per GPU (``CostModel.for_device``) and come from measurements
(``benchmarks/stage_timing.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

CHUNK = 64

#: segment lengths tried by ``cp="auto"``, in chunks
CANDIDATE_SEGMENT_CHUNKS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class CostModel:
    """Times in microseconds of one (sequence or segment) x value-head work item walking one chunk."""

    num_sms: int = 132
    forward_chunk_us: float = 3.0  # fused forward, one CTA per SM
    state_chunk_us: float = 1.5  # state-only pass (no output)
    launch_us: float = 5.0  # fixed cost of one pass (launches, planning)
    splice_step_us: float = 10.0  # one sequential splice step (a batched K x K by K x V product)

    @staticmethod
    def for_device(device: Optional[torch.device] = None) -> "CostModel":
        """The model for a CUDA device (its SM count; chunk times measured on the H200), or the default."""
        if device is not None and device.type == "cuda" and torch.cuda.is_available():
            return CostModel(num_sms=torch.cuda.get_device_properties(device).multi_processor_count)
        return CostModel()

    def pass_us(self, item_chunks: Sequence[int], chunk_us: float, heads: int) -> float:
        """One pass over work items of the given chunk counts, each for ``heads`` value heads."""
        if not item_chunks:
            return 0.0
        longest = max(item_chunks)
        total = sum(item_chunks) * heads
        return self.launch_us + max(longest, total / self.num_sms) * chunk_us


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


def estimated_us(seqlens: Sequence[int], heads: int, segment_chunks: Optional[int], model: CostModel) -> float:
    """The cost model's time for one forward with the given segment length (None: without CP)."""
    chunks = [max(1, math.ceil(L / CHUNK)) for L in seqlens]
    if segment_chunks is None or all(c <= segment_chunks for c in chunks):
        return model.pass_us(chunks, model.forward_chunk_us, heads)
    segs: List[int] = []
    steps = 0
    for c in chunks:
        pieces = math.ceil(c / segment_chunks)
        segs += [min(segment_chunks, c - i * segment_chunks) for i in range(pieces)]
        steps = max(steps, pieces - 1)
    state = model.pass_us(segs, model.state_chunk_us, 2 * heads)  # b and M: one pass over twice the heads
    return state + steps * model.splice_step_us + model.pass_us(segs, model.forward_chunk_us, heads)


def plan_segments(
    seqlens: Optional[Sequence[int]],
    heads: int,
    cp: Union[str, int] = "auto",
    model: Optional[CostModel] = None,
) -> SegmentPlan:
    """The segments for ``cp`` ("off", "auto" or a segment length in chunks); ``seqlens`` None (lengths not
    on the host) means no split."""
    if seqlens is None:
        raise ValueError("planning context parallelism needs the sequence lengths on the host")
    if cp == "off":
        return split_sequences(seqlens, None)
    if isinstance(cp, int) and not isinstance(cp, bool):
        return split_sequences(seqlens, cp)
    if cp != "auto":
        raise ValueError(f"cp must be 'auto', 'off' or a positive int (segment length in chunks), got {cp!r}")
    model = model or CostModel()
    off_us = estimated_us(seqlens, heads, None, model)
    us, best = min((estimated_us(seqlens, heads, s, model), s) for s in CANDIDATE_SEGMENT_CHUNKS)
    # a clear gain only: CP costs extra passes and memory
    return split_sequences(seqlens, best if us < 0.9 * off_us else None)


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


def plan_for_problem(p, auto: bool, model: Optional[CostModel] = None) -> Optional[SegmentPlan]:
    """The segments a backend runs ``p`` (a ``GDNProblem``) with, or None for no split. ``auto`` says whether
    this backend lets ``cp="auto"`` decide by the cost model (otherwise "auto" means off)."""
    if p.cp == "off" or (p.cp == "auto" and not auto):
        return None
    seqlens = [p.T] * p.B if p.cu_seqlens is None else host_seqlens(p.cu_seqlens_cpu)
    if seqlens is None:
        if p.cp == "auto":
            return None
        raise ValueError(f"cp={p.cp} needs the sequence lengths on the host: pass cu_seqlens_cpu (a host copy of "
                         "cu_seqlens), or a CPU cu_seqlens")
    plan = plan_segments(seqlens, p.Hv, p.cp, model or CostModel.for_device(p.device))
    return plan if plan.split else None
