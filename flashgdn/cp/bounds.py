"""An upper bound on the size of every segment's transition M, from the inputs alone: where it shows that M is
below float32's range, context parallelism's transition pass need not walk the segment to make it.

The recurrence's transition over one token is ``S' = exp(g_t) (I - beta_t k_t k_t^T) S + ...``: the matrix
``I - beta k k^T`` has the eigenvalue ``1 - beta |k|^2`` (along k) and 1 (on k's complement), so its spectral norm
is ``max(1, |1 - beta_t |k_t|^2|)``. A segment's M is the product of its tokens' transitions (the chunked form
computes the same product, ``reference.chunked.state_pass`` and ``compose_transitions``), so

    log ||M_s||_2  <=  sum over the segment's tokens of  g_t + log max(1, |1 - beta_t |k_t|^2|)

for any gate (g = 0 included), any beta and keys of any norm. With normalised keys and 0 <= beta <= 2 the second
term is zero and the bound is the segment's summed decay.

Every entry of M is at most its spectral norm. Where the bound is below ``NEGLIGIBLE_LOG_NORM`` (float32's smallest
normal number is 1.18e-38, e^-88 = 6.1e-39), the pass that makes M in float32 would make values the hardware
flushes to zero or leaves as denormals, and the splice's ``M S + b`` adds to b a term below 6.1e-39 |S|: nothing at
float32's resolution for any start state S up to ~1e31 in size. Taking M = 0 there is exact in the
sense of ``docs/context-parallel.md`` (no history is cut that float32 could hold), unlike a cut at a summed decay of
e^-10, which drops terms a float32 result still sees.

``transition_log_bounds`` is the bound per segment and value head, by a handful of device ops (no value read on the
host, so CUDA-graph capturable); the Hopper backend's transition pass (``FLASHGDN_HOPPER_CP_NEGLIGIBLE_M``) skips
the M of a segment whose bound is below ``NEGLIGIBLE_LOG_NORM``.

The same factors bound what a segment's b (its end state from a zero start, or from the sequence's initial state on
its first segment) owes to its early tokens. Token t injects ``beta_t k_t v_t^T`` (spectral norm
``|beta_t| |k_t| |v_t|``), which reaches the segment's end e through the transitions of the tokens after it, so the
tokens before a point p contribute to b at most

    E(p) = sum over t < p of |beta_t| |k_t| |v_t| exp(sum over t < u < e of l_u)  (+ |h0| exp(sum over the segment of l_u))

with ``l_u`` the per-token log bound above and the h0 term on a sequence's first segment (the Frobenius norm bounds
the spectral one). Where E(p) is below e^-88 at a chunk boundary p, b walked from zero at p differs from b walked
from the segment's start by less than float32's smallest normal number in every entry: the walk may start there
(``b_start_chunks``, the Hopper transition pass's ``late_b``). This needs |v| per token, a read of v.

The same bound factors over chunks: with J_c what chunk c's tokens inject, carried to the chunk's end, and L_c the
chunk's sum of ``l_u``, E(p) is at most the log-sum-exp over chunks c < p of J_c plus the L of the segment's chunks
after c. Hopper's stage 1 makes both per chunk (``chunk_log_bounds``, ``chunk_log_injects``: it has k, g and beta
of the chunk, and reads its v rows for J), and each b item of the transition pass counts its own start from them
(``segment_b_starts``, the pass's ``chunk_late_b``), with no pass over the inputs between the two kernels.

The backward's walk of a segment from a zero end gradient (context parallelism's D, the state gradient at the
segment's start) is the mirror image. Token t's output ``o_t = scale S_t^T q_t`` adds ``scale q_t dO_t^T`` to the
state gradient after it, which reaches the segment's start a through the transposed transitions of tokens a..t. So
the tokens from a point p on owe D at most

    E'(p) = sum over t >= p of scale |q_t| |dO_t| exp(sum over a <= u <= t of l_u)

and where E'(p) is below e^-88 at a chunk boundary, the walk may stop there: it walks the segment's chunks before p
only, from zero (``walk_stop_chunks``, the Hopper walk's ``early_stop``). This needs |dO| per token, a read of dO.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

#: log of the bound on ||M||_2 below which M is taken as zero: e^-88 = 6.1e-39, under float32's smallest normal
#: number (1.18e-38)
NEGLIGIBLE_LOG_NORM = -88.0

#: The same bound made by the kernels (``chunk_log_bounds``, ``segment_log_bounds``), each float32 sum rounded up:
#: a chunk's by a share of the sum of its terms' magnitudes (float32's rounding of 64 of them, the cumsum's included,
#: is below 64 x 6e-8 of it, and |k|^2 from K K^T's float32 diagonal below 128 x 6e-8) and a constant a chunk for
#: terms near zero whose rounding is not (|1 - beta |k|^2| near 1); a segment's by ``(chunks + 64) x 2^-23`` of
#: the sum of its chunks' magnitudes (float32's rounding of a sum in two levels of at most chunks / 32 + 32 terms) and
#: a constant
CHUNK_BOUND_REL = 2.0 ** -12
CHUNK_BOUND_ABS = 2.0 ** -6
SEGMENT_SUM_REL = 2.0 ** -23
SEGMENT_SUM_ABS = 1.0


def _row_norms(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` over the last dimension in float32 (bf16/fp16 rows summed in float32 without a float32 copy of them;
    float32 and float64 rows in their own precision, then rounded)."""
    if x.element_size() < 4:
        return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
    return torch.linalg.vector_norm(x, dim=-1).to(torch.float32)


def token_log_growth(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Per token and value head, ``g_t + log max(1, |1 - beta_t |k_t|^2|)`` in float32 ``[T, Hv]``: the log of the
    bound on the norm of that token's transition. ``k [1, T, Hqk, K]`` (the keys the kernels read: normalised
    where the op normalises them), ``g`` and ``beta`` ``[1, T, Hv]``; value head h reads qk head ``h // (Hv // Hqk)``."""
    _, T, Hqk, _ = k.shape
    Hv = g.shape[2]
    if Hv % Hqk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of qk heads ({Hqk})")
    # |k|^2 in float32 from the stored values (bf16/fp16 keys: their rounding is what the kernels multiply)
    kk = _row_norms(k[0]).square_()  # [T, Hqk]
    x = beta[0].reshape(T, Hqk, Hv // Hqk).to(torch.float32) * kk.unsqueeze(-1)  # beta |k|^2 per value head
    # log max(1, |1 - x|) = max(0, log |1 - x|), then + g
    x = x.sub_(1).abs_().log_().clamp_(min=0).reshape(T, Hv)
    return x.add_(g[0].to(torch.float32))


#: Tokens per block of ``_token_scan``'s first level.
TOKEN_SCAN_BLOCK = 256


def _token_scan(x: torch.Tensor, log: bool) -> torch.Tensor:
    """The inclusive prefix over dim 0 of ``x [T, C]`` (C a few heads, T up to the packed tokens): the running sum
    (``log=False``) or the running log-sum-exp (``log=True``), ``[T, C]`` in x's dtype, as ``x.cumsum(0)`` and
    ``x.logcumsumexp(0)`` give it. Not those calls themselves: along a strided dim 0, PyTorch's CUDA scan gives each
    of the C columns one thread that walks all T tokens in turn (~0.3 us a token, 40 ms at 131072 tokens,
    several hundred times the forward it bounds). Here it runs in two levels along contiguous rows, each block of
    ``TOKEN_SCAN_BLOCK`` tokens scanned on its own, then the blocks' totals (recursively), each block's result
    combined with the total of the blocks before it; -inf (log) or 0 pad the last block. The sums are those of the
    one-level scan up to float64 rounding, NaN and infinities carried to every later token as there."""
    T, C = x.shape
    scan, nothing = (torch.logcumsumexp, -math.inf) if log else (torch.cumsum, 0.0)
    if T <= TOKEN_SCAN_BLOCK:
        return scan(x.t().contiguous(), -1).t()
    nb = -(-T // TOKEN_SCAN_BLOCK)
    blocks = x.new_full((C, nb * TOKEN_SCAN_BLOCK), nothing)
    blocks[:, :T] = x.t()
    blocks = scan(blocks.view(C, nb, TOKEN_SCAN_BLOCK), -1)
    before = _token_scan(blocks[:, :, -1].t(), log).t()  # [C, nb]: the blocks up to each one, inclusive
    before = torch.nn.functional.pad(before[:, :-1], (1, 0), value=nothing).unsqueeze(-1)
    blocks = torch.logaddexp(blocks, before) if log else blocks.add_(before)
    return blocks.view(C, nb * TOKEN_SCAN_BLOCK)[:, :T].t()


def _growth_prefix(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   per_token: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[T + 1, Hv]`` float64: row t the sum of ``token_log_growth`` over the tokens before t (``per_token``: that
    growth where the caller has it). A bound over tokens a..b-1 is a difference of two rows; the float64 running
    sum's rounding (~1e-16 relative to the largest partial sum) stays far below the threshold's margin for any
    realistic length."""
    if per_token is None:
        per_token = token_log_growth(k, g, beta)
    return torch.nn.functional.pad(_token_scan(per_token.to(torch.float64), log=False), (0, 0, 1, 0))


def _per_value_head(x: torch.Tensor, Hv: int) -> torch.Tensor:
    """A ``[T, Hqk]`` per-qk-head value as ``[T, Hv]``: value head h reads qk head ``h // (Hv // Hqk)``."""
    T_, Hqk = x.shape
    return x.unsqueeze(-1).expand(T_, Hqk, Hv // Hqk).reshape(T_, Hv)


class _SegmentChunks(NamedTuple):
    """Every chunk of every segment of offsets ``seg_cu``, flat in order: its segment ``seg_of`` and its number
    ``c`` in the segment (0 ..), beside the segments' ``starts``, ``ends`` and chunk counts ``chunks`` (int64)."""

    starts: torch.Tensor
    ends: torch.Tensor
    chunks: torch.Tensor
    seg_of: torch.Tensor
    c: torch.Tensor


def _segment_chunks(seg_cu: torch.Tensor, num_chunks: int) -> _SegmentChunks:
    """``_SegmentChunks`` of ``seg_cu`` by device ops; ``num_chunks`` (their total, from the host) sizes the flat
    tensors without a read back."""
    cu = seg_cu.to(torch.int64)
    starts, ends = cu[:-1], cu[1:]
    chunks = torch.div(ends - starts + 63, 64, rounding_mode="floor")
    seg_of = torch.repeat_interleave(torch.arange(chunks.shape[0], device=cu.device), chunks, output_size=num_chunks)
    c = torch.arange(num_chunks, device=cu.device) - (torch.cumsum(chunks, 0) - chunks).index_select(0, seg_of)
    return _SegmentChunks(starts, ends, chunks, seg_of, c)


def chunk_count(cu_cpu: torch.Tensor) -> int:
    """The chunks of the packed sequences (or segments) of host offsets ``cu_cpu`` in all, an empty one none: the
    ``num_chunks`` that ``b_start_chunks`` and ``walk_stop_chunks`` take, and the Hopper forward's exact slot count
    (``num_chunk_slots``, at least one), with no device value read."""
    lengths = cu_cpu[1:] - cu_cpu[:-1]
    return int(torch.div(lengths + 63, 64, rounding_mode="floor").sum())


def _chunk_rows(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor):
    """The per-row terms the chunk-wise bounds sum, gathered by chunk slot (``slots [S, 2]``: first token and length):
    ``(|k| [T, Hv], token [S, 64], real rows [S, 64, 1], g [S, 64, Hv], growth [S, 64, Hv])`` in float32, the growth
    ``log max(1, |1 - beta |k|^2|)`` (NaN passes) and both zero on the rows past a slot's length."""
    _, T, _, _ = k.shape
    Hv = g.shape[2]
    k_norm = _per_value_head(_row_norms(k[0]), Hv)
    growth = (1 - beta[0].to(torch.float32) * k_norm.square()).abs_().log_()
    growth = torch.where(growth < 0, torch.zeros_like(growth), growth)  # (NaN passes)
    starts, lengths = slots[:, 0].to(torch.int64), slots[:, 1].to(torch.int64)
    rows = torch.arange(64, device=k.device)
    tok = (starts[:, None] + rows).clamp(max=max(T - 1, 0))  # [S, 64]
    real = (rows < lengths[:, None]).unsqueeze(-1)  # [S, 64, 1]
    zero = torch.zeros((), dtype=torch.float32, device=k.device)
    return k_norm, tok, real, torch.where(real, g[0].to(torch.float32)[tok], zero), torch.where(real, growth[tok], zero)


def chunk_log_bounds(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """What the Hopper stage 1 writes with ``chunk_bounds`` (``kkt_inverse``), in PyTorch: ``[Hv, S]`` float32, per
    chunk slot (``slots [S, 2]``: first token and length, 0 for an idle slot) and value head, the chunk's sum of
    ``token_log_growth``'s terms rounded up by ``CHUNK_BOUND_REL`` of the sum of |g| and the growth and by
    ``CHUNK_BOUND_ABS``. An upper bound on the log norm of the chunk's transition, as computed; an idle slot's is the
    constant alone. The kernel sums in another order, so the two agree to float32's rounding, not bit for bit."""
    Hv = g.shape[2]
    S = slots.shape[0]
    _, _, _, gc, gr = _chunk_rows(k, g, beta, slots)
    decay, grown, gabs = gc.sum(1), gr.sum(1), gc.abs().sum(1)
    return (decay + grown + (gabs + grown) * CHUNK_BOUND_REL + CHUNK_BOUND_ABS).t().reshape(Hv, S)


def segment_log_bounds(chunk_bound: torch.Tensor, first_slot: torch.Tensor, seg_cu: torch.Tensor) -> torch.Tensor:
    """What the Hopper transition pass compares with ``NEGLIGIBLE_LOG_NORM`` for each M item under ``chunk_bounds``
    (``chunk_forward_rs``), in PyTorch: ``[S, Hv]`` float64, each segment's chunks of ``chunk_bound [Hv, slots]``
    (the segment's first slot ``first_slot``, its chunks from ``seg_cu``) summed and rounded up by
    ``SEGMENT_SUM_REL`` x (chunks + 64) of the sum of their magnitudes and ``SEGMENT_SUM_ABS``. The sum here is in
    float64; the kernel's float32 sum may fall either side of the threshold only within that rounding."""
    cb = chunk_bound.to(torch.float64)
    chunks = torch.div(seg_cu[1:].to(torch.int64) - seg_cu[:-1].to(torch.int64) + 63, 64, rounding_mode="floor")
    prefix = torch.nn.functional.pad(cb.cumsum(1), (1, 0))  # [Hv, slots + 1]
    aprefix = torch.nn.functional.pad(cb.abs().cumsum(1), (1, 0))
    a, b = first_slot.to(torch.int64), first_slot.to(torch.int64) + chunks
    summed = (prefix[:, b] - prefix[:, a]).t()
    mags = (aprefix[:, b] - aprefix[:, a]).t()
    return summed + mags * (chunks[:, None] + 64).to(torch.float64) * SEGMENT_SUM_REL + SEGMENT_SUM_ABS


def chunk_log_injects(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
    """What the chunk-wise late b needs of each chunk besides ``chunk_log_bounds``, in PyTorch: ``[Hv, S]`` float32,
    per chunk slot (``slots [S, 2]``: first token and length, 0 for an idle slot) and value head, the log of

        J_c = sum over the chunk's tokens t of |beta_t| |k_t| |v_t| exp(sum over t < u <= the chunk's last token of l_u)

    (``l_u`` the per-token log bound of ``token_log_growth``): what the chunk's tokens inject into a state walked from
    zero at its start, carried to its end. Each term's exponent is rounded up as ``chunk_log_bounds`` rounds the
    chunk's sum (by ``CHUNK_BOUND_REL`` of the chunk's sum of |g| and the growth, and ``CHUNK_BOUND_ABS``), so the
    float32 sums of a kernel that makes it (stage 1, which has |k|^2, beta and the gates of each chunk, reading v's
    rows beside them) stay above the exact value. An idle slot, or a chunk whose tokens inject nothing, gives -inf.

    With ``chunk_log_bounds`` it gives a segment's bound E(p) of the module docstring chunk by chunk:
    ``log E(p) <= logsumexp over chunks c < p of (J_c + sum over the chunks after c of the chunk bounds)``, which
    ``segment_b_starts`` evaluates."""
    k_norm, tok, real, gc, gr = _chunk_rows(k, g, beta, slots)
    Hv = g.shape[2]
    inject = (beta[0].to(torch.float32).abs() * k_norm * _row_norms(v[0])).log_()  # [T, Hv]
    lu = gc + gr  # [S, 64, Hv]: each row's g + growth (zero past the chunk's length)
    mag = (gc.abs() + gr).sum(1, keepdim=True)
    # the sum over the rows after t: the chunk's total less the inclusive prefix
    after = lu.sum(1, keepdim=True) - lu.cumsum(1)
    terms = torch.where(real, inject[tok] + after, torch.full_like(after, -math.inf))
    out = terms.logsumexp(1) + (mag[:, 0] * CHUNK_BOUND_REL + CHUNK_BOUND_ABS)  # [S, Hv]
    return out.t().reshape(Hv, slots.shape[0])


def _segment_chunk_terms(chunk_bound: torch.Tensor, chunk_term: torch.Tensor, first_slot: torch.Tensor,
                         seg_cu: torch.Tensor):
    """The per-chunk terms of every segment side by side, in float64, for the per-chunk b start and walk stop:
    ``(chunks [S], c [width], real [S, width], L [S, width, Hv], J [S, width, Hv], margin [S, 1, Hv])``, with L the
    segment's chunk bounds (0 past its chunks), J its chunks of ``chunk_term`` (-inf past them) and margin the segment
    sum's rounding (``SEGMENT_SUM_REL`` x (chunks + 64) of the sum of the bounds' magnitudes, and ``SEGMENT_SUM_ABS``).
    Reads the longest segment's chunk count on the host."""
    cb = chunk_bound.to(torch.float64)
    ct = chunk_term.to(torch.float64)
    seg_cu = seg_cu.to(torch.int64)
    chunks = torch.div(seg_cu[1:] - seg_cu[:-1] + 63, 64, rounding_mode="floor")
    S = chunks.shape[0]
    width = int(chunks.max()) if S else 0
    c = torch.arange(width, device=cb.device)
    real = c[None, :] < chunks[:, None]  # [S, width]
    slot = (first_slot.to(torch.int64)[:, None] + c[None, :]).clamp(max=max(cb.shape[1] - 1, 0))
    # (gathers by index_select and python scalars in the selects: a host tensor there would be copied to the device
    # and waited for)
    def gathered(x):
        return x.index_select(1, slot.reshape(-1)).reshape(x.shape[0], S, width).permute(1, 2, 0)

    L = torch.where(real[..., None], gathered(cb), 0.0)
    J = torch.where(real[..., None], gathered(ct), -math.inf)
    margin = L.abs().sum(1, keepdim=True) * (chunks[:, None, None] + 64).to(torch.float64) * SEGMENT_SUM_REL \
        + SEGMENT_SUM_ABS
    return chunks, c, real, L, J, margin


def segment_b_starts(chunk_bound: torch.Tensor, chunk_inject: torch.Tensor, first_slot: torch.Tensor,
                     seg_cu: torch.Tensor, h0_log_norm: Optional[torch.Tensor] = None,
                     seg_seq: Optional[torch.Tensor] = None, first: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What a transition pass that makes each b item's start from stage 1's per-chunk terms would leave out, in
    PyTorch (float64): ``[S, Hv]`` int32, for every segment (its first chunk slot ``first_slot``, its tokens from
    ``seg_cu``) and value head, the most chunks p from the segment's start such that

        logsumexp over its chunks c < p of (chunk_inject[c] + sum of chunk_bound over its chunks after c)

    (with ``log |h0|_F`` plus the sum of all its chunk bounds beside them on a sequence's first segment, from
    ``h0_log_norm [N, Hv]``, ``seg_seq`` and ``first``), rounded up by ``SEGMENT_SUM_REL`` x (chunks + 64) of the sum
    of the chunk bounds' magnitudes and ``SEGMENT_SUM_ABS``, is below ``NEGLIGIBLE_LOG_NORM``: what
    ``b_start_chunks`` bounds token by token, here by ``chunk_log_bounds`` and ``chunk_log_injects`` over the
    segment's own chunks only. A NaN injection stops the count at its chunk; a chunk bound that is not finite leaves
    out nothing in its segment. Reads the longest
    segment's chunk count on the host (a reference, not the call path)."""
    chunks, c, real, L, J, margin = _segment_chunk_terms(chunk_bound, chunk_inject, first_slot, seg_cu)
    S = chunks.shape[0]
    total = L.sum(1, keepdim=True)  # [S, 1, Hv]
    after = total - L.cumsum(1)  # the chunk bounds after each chunk
    log_e = torch.logcumsumexp(J + after, 1)  # [S, width, Hv]: E at the boundary after each chunk
    if h0_log_norm is not None:
        is_first = first.to(torch.int64).index_select(0, seg_seq.to(torch.int64)) == torch.arange(S, device=c.device)
        h0_term = h0_log_norm.to(torch.float64).index_select(0, seg_seq.to(torch.int64)) + total[:, 0]  # [S, Hv]
        h0_term = torch.where(is_first[:, None], h0_term, torch.full_like(h0_term, -math.inf))
        log_e = torch.logaddexp(log_e, h0_term[:, None, :])
    below = (log_e + margin < NEGLIGIBLE_LOG_NORM) & real[..., None]
    # the leading run of boundaries below the threshold (E grows with p; a NaN term breaks the run there, a chunk
    # bound that is not finite makes the segment's sum and margin so and leaves out nothing)
    run = torch.cumprod(below.to(torch.int64), 1).sum(1)
    bad = ~torch.isfinite(L).all(1)
    return torch.where(bad, torch.zeros_like(run), run).to(torch.int32)


def chunk_log_emits(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, do: torch.Tensor,
                    scale: float, slots: torch.Tensor) -> torch.Tensor:
    """The mirror image of ``chunk_log_injects`` for the backward's walks from zero, in PyTorch: ``[Hv, S]`` float32,
    per chunk slot (``slots [S, 2]``: first token and length, 0 for an idle slot) and value head, the log of

        J'_c = sum over the chunk's tokens t of scale |q_t| |dO_t| exp(sum over the chunk's first token <= u <= t of l_u)

    (``l_u`` the per-token log bound of ``token_log_growth``): what the chunk's outputs add to a state gradient, carried
    back to the chunk's start by its own transposed transitions. Each term's exponent is rounded up as
    ``chunk_log_bounds`` rounds the chunk's sum, so that the float32 sums of a kernel that makes it (a stage 1 that
    reads q's and dO's rows beside the chunk's gates and |k|^2) stay above the exact value. An idle slot, or a chunk
    whose outputs add nothing, gives -inf.

    With ``chunk_log_bounds`` it gives a segment's bound E'(p) of the module docstring chunk by chunk:
    ``log E'(p) <= logsumexp over chunks c >= p of (J'_c + sum over the chunks before c of the chunk bounds)``, which
    ``segment_walk_stops`` evaluates. Made on the GPU by ``kernels/hopper/chunk_emits.py`` (notes v0.36j)."""
    _, tok, real, gc, gr = _chunk_rows(k, g, beta, slots)
    Hv = g.shape[2]
    emit = (_per_value_head(abs(float(scale)) * _row_norms(q[0]), Hv) * _row_norms(do[0])).log_()  # [T, Hv]
    lu = gc + gr  # [S, 64, Hv]: each row's g + growth (zero past the chunk's length)
    mag = (gc.abs() + gr).sum(1, keepdim=True)
    terms = torch.where(real, emit[tok] + lu.cumsum(1), torch.full_like(lu, -math.inf))
    out = terms.logsumexp(1) + (mag[:, 0] * CHUNK_BOUND_REL + CHUNK_BOUND_ABS)  # [S, Hv]
    return out.t().reshape(Hv, slots.shape[0])


def segment_walk_stops(chunk_bound: torch.Tensor, chunk_emit: torch.Tensor, first_slot: torch.Tensor,
                       seg_cu: torch.Tensor) -> torch.Tensor:
    """What a walk from zero that makes its stop from stage 1's per-chunk terms would cover, in PyTorch (float64):
    ``[S, Hv]`` int32, for every segment (its first chunk slot ``first_slot``, its tokens from ``seg_cu``) and value
    head, the fewest chunks c from the segment's start such that

        logsumexp over its chunks c' >= c of (chunk_emit[c'] + sum of chunk_bound over its chunks before c')

    rounded up by ``SEGMENT_SUM_REL`` x (chunks + 64) of the sum of the chunk bounds' magnitudes and
    ``SEGMENT_SUM_ABS``, is below ``NEGLIGIBLE_LOG_NORM``, and at every later boundary too: what ``walk_stop_chunks``
    bounds token by token, here over the segment's own chunks only. A NaN term fails its boundary and every earlier
    one; a chunk bound that is not finite keeps every chunk of its segment. Reads the longest segment's chunk count
    on the host (a reference, not the call path: the Hopper backward's covers are ``chunk_emits.build_walk_covers``)."""
    chunks, c, real, L, J, margin = _segment_chunk_terms(chunk_bound, chunk_emit, first_slot, seg_cu)
    before = L.cumsum(1) - L  # the chunk bounds before each chunk
    # E' at the boundary before each chunk: a suffix log-sum-exp (a NaN term makes every earlier boundary NaN)
    log_e = torch.logcumsumexp((J + before).flip(1), 1).flip(1)
    fails = ~(log_e + margin < NEGLIGIBLE_LOG_NORM) & real[..., None]
    # the walk covers every chunk up to the last boundary that fails
    cover = torch.where(fails, c[None, :, None] + 1, 0).amax(1)
    bad = ~torch.isfinite(L).all(1)
    return torch.where(bad, chunks[:, None].expand_as(cover), cover).to(torch.int32)


def transition_log_bounds(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          seg_cu: torch.Tensor, out: Optional[torch.Tensor] = None,
                          per_token: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The log of an upper bound on every segment's ||M||_2, ``[S, Hv]`` float32, for the segments
    ``[seg_cu[s], seg_cu[s + 1])`` of the packed tokens (``seg_cu`` ``[S + 1]`` on the device, any integer dtype).
    Tokens outside every segment count in none; an empty segment gets 0 (its M is the identity). Non-finite gates
    give -inf or NaN, and a NaN bound is never below the threshold (nothing is skipped on it). ``out``: a float32
    ``[S, Hv]`` tensor to write them into (e.g. one allocated on the stream that will read them). ``per_token``:
    ``token_log_growth(k, g, beta)`` where the caller has it (one read of k for several bounds)."""
    at = _growth_prefix(k, g, beta, per_token).index_select(0, seg_cu.to(torch.int64))
    if out is None:
        return (at[1:] - at[:-1]).to(torch.float32)
    return torch.sub(at[1:], at[:-1], out=out)


def b_start_chunks(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, seg_cu: torch.Tensor,
                   num_chunks: int, h0: Optional[torch.Tensor] = None, seg_seq: Optional[torch.Tensor] = None,
                   first: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                   per_token: Optional[torch.Tensor] = None) -> torch.Tensor:
    """For every segment ``[seg_cu[s], seg_cu[s + 1])`` and value head, how many of the segment's first chunks its b
    walk may leave out: the most chunk boundaries p from the segment's start at which the bound E(p) of the module
    docstring on the dropped tokens' share of b is below ``NEGLIGIBLE_LOG_NORM`` (all of them: b is zero). ``[S, Hv]``
    int32, by device ops (nothing read on the host). ``k [1, T, Hqk, K]``, ``v [1, T, Hv, V]``, ``g``, ``beta``
    ``[1, T, Hv]``; ``num_chunks``: the segments' chunk count in all (known on the host with the plan). ``h0``: the
    sequences' initial states ``[N, Hv, K, V]`` (any layout of the last two), from which the b of a sequence's first
    segment starts (``seg_seq [S]`` and ``first [N]``: each segment's sequence and each sequence's first segment);
    None: every b starts from zero.

    Conservative where that is cheaper: the sum over t < p runs over every token before p, those of earlier segments
    too (one running log-sum-exp over the packed tokens instead of one per segment); it only adds to E. A NaN or an
    infinite bound leaves out nothing. ``out``: an int32 ``[S, Hv]`` tensor to write the counts into.
    ``per_token``: ``token_log_growth(k, g, beta)``, as ``transition_log_bounds`` takes it."""
    run = _growth_prefix(k, g, beta, per_token)  # [T + 1, Hv]: the sum of l_u for u < t
    Hv = run.shape[1]
    inject = beta[0].to(torch.float32).abs() * _per_value_head(_row_norms(k[0]), Hv)
    inject = inject.mul_(_row_norms(v[0])).to(torch.float64).log_()  # log |beta_t| |k_t| |v_t|
    # log of sum over t' <= t of |beta||k||v| exp(-(sum of l_u for u <= t')): E(p) = exp(at[p - 1] + run[e])
    at = _token_scan(inject.sub_(run[1:]), log=True)
    starts, ends, chunks, seg_of, c = _segment_chunks(seg_cu, num_chunks)
    S = chunks.shape[0]
    c = c + 1  # the boundary after each chunk: c = 1 .. chunks
    p = torch.minimum(starts.index_select(0, seg_of) + 64 * c, ends.index_select(0, seg_of))
    log_e = at.index_select(0, (p - 1).clamp_(min=0)) + run.index_select(0, ends).index_select(0, seg_of)
    if h0 is not None:
        is_first = first.to(torch.int64).index_select(0, seg_seq.to(torch.int64)) == torch.arange(S, device=c.device)
        h0_norm = torch.linalg.vector_norm(h0.to(torch.float64), dim=(-2, -1))  # [N, Hv]
        h0_term = h0_norm.index_select(0, seg_seq.to(torch.int64)).log_() + run.index_select(0, ends) \
            - run.index_select(0, starts)  # [S, Hv]
        h0_term = torch.where(is_first.unsqueeze(-1), h0_term, torch.full_like(h0_term, -math.inf))
        log_e = torch.logaddexp(log_e, h0_term.index_select(0, seg_of))
    # the first boundary where the bound fails (NaN fails), chunks + 1 where none does; the walk starts one before
    fails = ~(log_e < NEGLIGIBLE_LOG_NORM)
    limit = (chunks + 1).unsqueeze(-1).expand(S, Hv)
    where = torch.where(fails, c.unsqueeze(-1).expand(-1, Hv), limit.index_select(0, seg_of))
    first_fail = limit.clone().scatter_reduce_(0, seg_of.unsqueeze(-1).expand(-1, Hv), where, "amin")
    if out is None:
        return (first_fail - 1).to(torch.int32)
    return out.copy_(first_fail - 1)


def walk_stop_chunks(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, do: torch.Tensor,
                     scale: float, seg_cu: torch.Tensor, num_chunks: int,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """For every segment ``[seg_cu[s], seg_cu[s + 1])`` and value head, how many of the segment's chunks, from its
    start, its walk from a zero end gradient must cover: the fewest c such that the bound E'(p) of the module
    docstring on what the tokens from ``p = start + 64 c`` on owe the start gradient is below ``NEGLIGIBLE_LOG_NORM``
    (the segment's chunk count where none is). ``[S, Hv]`` int32, by device ops (nothing read on the host). ``q``,
    ``k`` ``[1, T, Hqk, K]`` (as the kernels read them: normalised where the op normalises them), ``g``, ``beta``
    ``[1, T, Hv]``, ``do [1, T, Hv, V]``; ``num_chunks``: the segments' chunk count in all (known on the host with
    the plan). Conservative as ``b_start_chunks``: the sum over t >= p runs over every later packed token. A NaN or an
    infinite bound keeps every chunk. ``out``: an int32 ``[S, Hv]`` tensor to write the counts into."""
    run = _growth_prefix(k, g, beta)  # [T + 1, Hv]: the sum of l_u for u < t
    Hv = run.shape[1]
    src = _per_value_head(abs(float(scale)) * _row_norms(q[0]), Hv) * _row_norms(do[0])
    src = src.to(torch.float64).log_().add_(run[1:])  # log scale |q_t| |dO_t| + sum of l_u for u <= t
    # log of the sum over t' >= t: E'(p) = exp(behind[p] - run[start])
    behind = _token_scan(src.flip(0), log=True).flip(0)
    starts, ends, chunks, seg_of, c = _segment_chunks(seg_cu, num_chunks)
    S = chunks.shape[0]
    p = starts.index_select(0, seg_of) + 64 * c  # each chunk's first token
    log_e = behind.index_select(0, p) - run.index_select(0, starts).index_select(0, seg_of)
    # the walk covers every chunk up to the last boundary where the bound fails (NaN fails), none where none does
    fails = ~(log_e < NEGLIGIBLE_LOG_NORM)
    where = torch.where(fails, c.unsqueeze(-1).expand(-1, Hv) + 1, torch.zeros_like(c).unsqueeze(-1).expand(-1, Hv))
    cover = torch.zeros((S, Hv), dtype=torch.int64, device=c.device)
    cover.scatter_reduce_(0, seg_of.unsqueeze(-1).expand(-1, Hv), where, "amax")
    if out is None:
        return cover.to(torch.int32)
    return out.copy_(cover)
