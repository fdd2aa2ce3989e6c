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
"""
from __future__ import annotations

from typing import Optional

import torch

#: log of the bound on ||M||_2 below which M is taken as zero: e^-88 = 6.1e-39, under float32's smallest normal
#: number (1.18e-38)
NEGLIGIBLE_LOG_NORM = -88.0


def token_log_growth(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Per token and value head, ``g_t + log max(1, |1 - beta_t |k_t|^2|)`` in float32 ``[T, Hv]``: the log of the
    bound on the norm of that token's transition. ``k [1, T, Hqk, K]`` (the keys the kernels read: normalised
    where the op normalises them), ``g`` and ``beta`` ``[1, T, Hv]``; value head h reads qk head ``h // (Hv // Hqk)``."""
    _, T, Hqk, _ = k.shape
    Hv = g.shape[2]
    if Hv % Hqk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of qk heads ({Hqk})")
    # |k|^2 in float32 from the stored values (bf16/fp16 keys: their rounding is what the kernels multiply)
    kk = torch.linalg.vector_norm(k[0], dim=-1, dtype=torch.float32).square_()  # [T, Hqk]
    x = beta[0].reshape(T, Hqk, Hv // Hqk).to(torch.float32) * kk.unsqueeze(-1)  # beta |k|^2 per value head
    # log max(1, |1 - x|) = max(0, log |1 - x|), then + g
    x = x.sub_(1).abs_().log_().clamp_(min=0).reshape(T, Hv)
    return x.add_(g[0].to(torch.float32))


def transition_log_bounds(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          seg_cu: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The log of an upper bound on every segment's ||M||_2, ``[S, Hv]`` float32, for the segments
    ``[seg_cu[s], seg_cu[s + 1])`` of the packed tokens (``seg_cu`` ``[S + 1]`` on the device, any integer dtype).
    Tokens outside every segment count in none; an empty segment gets 0 (its M is the identity). Non-finite gates
    give -inf or NaN, and a NaN bound is never below the threshold (nothing is skipped on it). ``out``: a float32
    ``[S, Hv]`` tensor to write them into (e.g. one allocated on the stream that will read them)."""
    per_token = token_log_growth(k, g, beta)
    # summed by differences of a float64 running sum: its rounding (~1e-16 relative to the largest partial sum)
    # stays far below the threshold's margin for any realistic length
    run = torch.nn.functional.pad(per_token.cumsum(0, dtype=torch.float64), (0, 0, 1, 0))  # [T + 1, Hv]
    at = run.index_select(0, seg_cu.to(torch.int64))
    if out is None:
        return (at[1:] - at[:-1]).to(torch.float32)
    return torch.sub(at[1:], at[:-1], out=out)
