"""Warp-level log-sum-exp pieces shared by the kernels that make context parallelism's bounds.

Stage 1's injection terms (``kkt_inverse``'s ``chunk_injects``) and the emission pass (``chunk_emits.py``) each sum
64 terms per value head, two a lane, into a log-sum-exp; the transition pass's b start (``chunk_forward_rs``'s
``chunk_late_b``) and the walks' covers (``chunk_emits.build_walk_covers``) scan the running log-sum-exp over a
segment's chunks, 32 a round, carrying it from round to round. A log-sum-exp is kept as (max, sum of exponentials
below it), -inf max for an empty one; a NaN term is tracked by a flag beside it (1.0 once a NaN was seen), since
max() would drop it. The pieces work on a thread's local array ``lj`` at the indices given, so each kernel keeps its
own register layout.

PyTorch counterparts: ``torch.logsumexp`` and ``torch.logcumsumexp`` in ``flashgdn.cp.bounds``.
"""
import functools


@functools.lru_cache(maxsize=None)
def warp_lse_macros():
    """``(pair_logsumexp, lse_scan, lse_merge)``, TileLang macros over a local float32 array ``lj``:

    - ``pair_logsumexp(lj, a, b, flag, mx, sm)``: over the warp's 64 terms ``lj[a]``, ``lj[b]`` of every lane, the
      NaN flag into ``lj[flag]``, the max into ``lj[mx]`` and the sum of exponentials below it into ``lj[sm]``, on
      every lane;
    - ``lse_scan(lj, lane, flag, mx, sm, t, u)``: the inclusive scan over the lanes of (NaN flag, max, sum), each lane
      starting from its own (``lj[sm]`` 1 for a finite max, else 0); ``lj[t]``, ``lj[u]`` scratch;
    - ``lse_merge(lj, mx, sm, mx2, sm2)``: (``lj[mx]``, ``lj[sm]``) merged with (``lj[mx2]``, ``lj[sm2]``), the
      latter skipped while its max is -inf."""
    import tilelang.language as T

    acc = "float32"

    @T.macro
    def pair_logsumexp(lj, a, b, flag, mx, sm):
        lj[flag] = T.warp_reduce_max(T.if_then_else(T.Or(T.isnan(lj[a]), T.isnan(lj[b])), T.float32(1),
                                                    T.float32(0)))
        lj[mx] = T.warp_reduce_max(T.max(lj[a], lj[b]))
        lj[sm] = T.warp_reduce_sum(
            T.if_then_else(lj[a] > -T.infinity(acc), T.exp(lj[a] - lj[mx]), T.float32(0))
            + T.if_then_else(lj[b] > -T.infinity(acc), T.exp(lj[b] - lj[mx]), T.float32(0)))

    @T.macro
    def lse_scan(lj, lane, flag, mx, sm, t, u):
        for d in T.unroll(5):
            lj[t] = T.shfl_up(lj[flag], 1 << d)
            if lane >= (1 << d):
                lj[flag] = T.max(lj[flag], lj[t])
            lj[t] = T.shfl_up(lj[mx], 1 << d)
            lj[u] = T.shfl_up(lj[sm], 1 << d)
            if T.And(lane >= (1 << d), lj[t] > -T.infinity(acc)):
                lj[sm] = T.if_then_else(
                    lj[t] > lj[mx], lj[u] + lj[sm] * T.exp(lj[mx] - lj[t]),
                    lj[sm] + lj[u] * T.exp(lj[t] - lj[mx]))
                lj[mx] = T.max(lj[mx], lj[t])

    @T.macro
    def lse_merge(lj, mx, sm, mx2, sm2):
        if lj[mx2] > -T.infinity(acc):
            lj[sm] = T.if_then_else(
                lj[mx2] > lj[mx], lj[sm2] + lj[sm] * T.exp(lj[mx] - lj[mx2]),
                lj[sm] + lj[sm2] * T.exp(lj[mx2] - lj[mx]))
            lj[mx] = T.max(lj[mx], lj[mx2])

    return pair_logsumexp, lse_scan, lse_merge
