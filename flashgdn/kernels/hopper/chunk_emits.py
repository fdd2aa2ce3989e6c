"""Per-chunk emission bounds for the backward's walks from zero, per (chunk, qk head): where such a walk may stop.

Math (context parallelism's backward, ``flashgdn.cp.backward`` step 2; notes v0.36i and v0.36j). A walk from a zero
end gradient over a segment gives the segment's start gradient D. What chunk c's outputs add to a state gradient,
carried back to the chunk's start by its own transposed transitions, is at most exp(J'_c) in every entry, with

    l_u   = g_u + log max(1, |1 - beta_u |k_u|^2|)                      (the per-token log bound of a transition)
    J'_c  = log sum_{t in c} scale |q_t| |dO_t| exp(sum_{c's first row <= u <= t} l_u)
            + (sum_{u in c} |g_u| + growth_u) CHUNK_BOUND_REL + CHUNK_BOUND_ABS      (rounded up as chunk bounds are)

per value head (q and k of its qk head). With stage 1's chunk bounds (``kkt_inverse``'s ``chunk_bounds``) the tokens
from chunk boundary p on owe D at most ``logsumexp over c >= p of (J'_c + the chunk bounds before c)``
(``flashgdn.cp.bounds.segment_walk_stops``): once that is below float32's range at every later boundary, the walk
can start at that boundary instead of the segment's end, and D comes out the same up to entries below float32's
smallest normal number.

One CTA takes one chunk slot of one qk head, 128 threads. Each row's |q|^2 and |k|^2, and per value head of the group
|dO|^2, are taken by two threads (half a row each, 16-byte vector loads) into registers and summed in float32; the
rows' factors l_u get an inclusive cumsum; one warp per value head makes the log-sum-exp of its 64 terms and the sum
of the magnitudes by shuffles. A NaN anywhere in a chunk's terms makes its J' NaN (a walk then covers everything
before it); an idle slot (no rows) and a zero scale give -inf. A separate pass rather than more of stage 1: stage 1
is on the path of everything after it, while this runs on the walks' stream beside the chunk states pass, and only
where segments are long enough to gain (``backward.WALK_STOP_IN_KERNEL``).

``build_walk_covers`` then makes each walk's cover from these and stage 1's chunk bounds, one warp per (segment,
value head): the count the walk's ``early_stop`` build takes.

PyTorch counterparts: ``flashgdn.cp.bounds.chunk_log_emits`` (same terms; float32 sums in another order) and
``segment_walk_stops`` (float64 there; the margin covers float32's sums here).
"""

from ...cp.bounds import CHUNK_BOUND_ABS, CHUNK_BOUND_REL, NEGLIGIBLE_LOG_NORM, SEGMENT_SUM_ABS, SEGMENT_SUM_REL
from .common import CHUNK, TARGET, kernel_cache, pass_configs
from .warp_bounds import warp_lse_macros


@kernel_cache
def build_chunk_emits(Hqk: int, Hv: int, K: int, V: int, io_dtype: str):
    """The kernel ``(q, k [1, T, Hqk, K], g, beta [1, T, Hv] float32, do [1, T, Hv, V], bounds [S, 2] int32 (the
    chunk slots: first token and length), scale (float), chunk_emit [Hv, S] float32 (out))``; T and S dynamic."""
    if Hv % Hqk:
        raise ValueError(f"Hv ({Hv}) must be a multiple of Hqk ({Hqk})")
    if K % 16 or V % 16:
        raise ValueError(f"K and V must be multiples of 16, got {K} and {V}")
    import tilelang
    import tilelang.language as T

    C = CHUNK
    group = Hv // Hqk
    pair_logsumexp, _, _ = warp_lse_macros()
    num_tokens = T.dynamic("num_tokens")
    num_slots = T.dynamic("num_slots")
    acc = "float32"

    @T.macro
    def half_row_squares(x, t, head, width, part, xr, lj, out):
        # the sum of squares of half of row t of x[0, t, head, :] (part 0 or 1), in 16-byte vectors, into lj[out]
        lj[out] = 0.0
        for c in T.unroll(width // 16):
            for e in T.vectorized(8):
                xr[e] = x[0, t, head, part * (width // 2) + 8 * c + e]
            for e in T.unroll(8):
                lj[5] = T.cast(xr[e], acc)
                lj[out] = lj[out] + lj[5] * lj[5]

    @T.prim_func
    def chunk_emits_kernel(
        q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        g: T.Tensor((1, num_tokens, Hv), "float32"),
        beta: T.Tensor((1, num_tokens, Hv), "float32"),
        do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
        bounds: T.Tensor((num_slots, 2), "int32"),
        scale: T.float32,
        chunk_emit: T.Tensor((Hv, num_slots), "float32"),
    ):
        with T.Kernel(num_slots, Hqk, threads=128) as (slot, hq):
            t0 = bounds[slot, 0]
            n_rows = bounds[slot, 1]
            qn_s = T.alloc_shared((2, C), acc)  # |q|^2 by halves of the row
            kn_s = T.alloc_shared((2, C), acc)
            dn_s = T.alloc_shared((group, 2, C), acc)  # |dO|^2 by halves, per value head
            lu_s = T.alloc_shared((group, C), acc)  # per row: l_u, then (lc_s) its inclusive cumsum
            lc_s = T.alloc_shared((group, C), acc)
            em_s = T.alloc_shared((group, C), acc)  # per row: log scale |q_t| |dO_t| (-inf past the rows)
            mg_s = T.alloc_shared((group, C), acc)  # per row: |g_u| + growth_u
            lj = T.alloc_local((8,), acc)
            xr = T.alloc_local((8,), io_dtype)
            tx = T.get_thread_binding()

            row = tx // 2
            part = tx % 2
            if row < n_rows:
                half_row_squares(q, t0 + row, hq, K, part, xr, lj, 0)
                half_row_squares(k, t0 + row, hq, K, part, xr, lj, 1)
            else:
                lj[0] = 0.0
                lj[1] = 0.0
            qn_s[part, row] = lj[0]
            kn_s[part, row] = lj[1]
            for p in T.unroll(group):  # (unrolled: every head's loads in flight at once)
                if row < n_rows:
                    half_row_squares(do, t0 + row, hq * group + p, V, part, xr, lj, 2)
                else:
                    lj[2] = 0.0
                dn_s[p, part, row] = lj[2]
            T.sync_threads()
            for p, i in T.Parallel(group, C):
                # log |1 - beta |k|^2|, clamped at 0 from below; NaN passes (NaN < 0 is false); rows past the chunk's
                # length have g = beta = 0, so l_u = 0 there
                gi = T.if_then_else(i < n_rows, g[0, t0 + i, hq * group + p], T.float32(0))
                lt = T.log(T.abs(1.0 - T.if_then_else(i < n_rows, beta[0, t0 + i, hq * group + p], T.float32(0))
                                 * (kn_s[0, i] + kn_s[1, i])))
                lu_s[p, i] = gi + T.if_then_else(lt < 0.0, T.float32(0), lt)
                mg_s[p, i] = T.abs(gi) + T.if_then_else(lt < 0.0, T.float32(0), lt)
                em_s[p, i] = T.if_then_else(
                    i < n_rows,
                    T.log(T.abs(scale)) + 0.5 * T.log((qn_s[0, i] + qn_s[1, i]) * (dn_s[p, 0, i] + dn_s[p, 1, i])),
                    -T.infinity(acc))
            T.sync_threads()
            T.cumsum(lu_s, lc_s, dim=1)
            T.sync_threads()
            # the 64 terms' log-sum-exp by a warp a head, two terms a lane: the largest, then the sum of exponentials
            # below it; a NaN term makes it NaN
            for w in T.serial(T.ceildiv(group, 4)):
                if w * 4 + tx // 32 < group:  # (a whole warp's branch: the shuffles below need every lane)
                    p = w * 4 + tx // 32
                    lane = tx % 32
                    lj[0] = em_s[p, lane] + lc_s[p, lane]
                    lj[1] = em_s[p, lane + 32] + lc_s[p, lane + 32]
                    pair_logsumexp(lj, 0, 1, 2, 3, 4)
                    lj[6] = T.warp_reduce_sum(mg_s[p, lane] + mg_s[p, lane + 32])
                    if lane == 0:
                        # rounded up as the chunk's bound is
                        chunk_emit[hq * group + p, slot] = T.if_then_else(
                            T.Or(lj[2] > 0, T.isnan(lj[6])), T.float32(float("nan")), T.if_then_else(
                                lj[3] > -T.infinity(acc),
                                lj[3] + T.log(lj[4]) + lj[6] * T.float32(CHUNK_BOUND_REL) + T.float32(CHUNK_BOUND_ABS),
                                lj[3]))

    return tilelang.compile(chunk_emits_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())


@kernel_cache
def build_walk_covers(Hv: int):
    """The kernel ``(chunk_bound [Hv, S], chunk_emit [Hv, S] float32, cu_seqlens [N + 1] int32, first_slot [N] int32,
    walk_chunks [N, Hv] int32 (out))``: per segment (sequence of ``cu_seqlens``) and value head the chunks its walk
    from zero covers, from its start, as ``flashgdn.cp.bounds.segment_walk_stops`` makes them.

    One warp per item. It sums the item's chunk bounds (their total, and with their magnitudes the margin
    ``SEGMENT_SUM_REL`` x (chunks + 64) x sum |bound| + ``SEGMENT_SUM_ABS``), then goes over its chunks from the last,
    32 a round: shuffle scans over the lanes give the bounds from each chunk c to the end (so the bounds before c) and
    the running log-sum-exp, as (max, sum of exponentials), of ``chunk_emit[c] + the bounds before c``, which bounds
    what the chunks from c on owe the walk's start gradient. The first chunk from the end whose bound with the margin
    is not below ``NEGLIGIBLE_LOG_NORM`` is the last one walked (cover = its number + 1; none: 0). A NaN term fails its
    chunk and so every earlier one; a chunk bound that is not finite makes the margin (or the terms) NaN or infinite,
    and every chunk is walked."""
    import tilelang
    import tilelang.language as T

    C = CHUNK
    _, lse_scan, lse_merge = warp_lse_macros()
    num_slots = T.dynamic("num_slots")
    num_seqs = T.dynamic("num_seqs")
    acc = "float32"

    @T.prim_func
    def walk_covers_kernel(
        chunk_bound: T.Tensor((Hv, num_slots), "float32"),
        chunk_emit: T.Tensor((Hv, num_slots), "float32"),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        first_slot: T.Tensor((num_seqs,), "int32"),
        walk_chunks: T.Tensor((num_seqs, Hv), "int32"),
    ):
        with T.Kernel(Hv, num_seqs, threads=32) as (h, n):
            # lj: the total, the magnitudes, the margin; carried: the suffix sum, (max, sum), the NaN flag; this
            # lane's suffix sum, a neighbour's value, this lane's term (then max), NaN flag, sum, and a neighbour's sum
            lj = T.alloc_local((13,), acc)
            nb = T.alloc_local((3,), "int32")  # the cover, still counting, the round's first failure
            lane = T.get_thread_binding()
            fs = first_slot[n]
            n_chunks = T.ceildiv(cu_seqlens[n + 1] - cu_seqlens[n], C)
            lj[0] = 0.0
            lj[1] = 0.0
            for i in T.serial(T.ceildiv(n_chunks, 32)):
                if lane + 32 * i < n_chunks:
                    lj[0] = lj[0] + chunk_bound[h, fs + lane + 32 * i]
                    lj[1] = lj[1] + T.abs(chunk_bound[h, fs + lane + 32 * i])
            lj[0] = T.warp_reduce_sum(lj[0])
            lj[1] = T.warp_reduce_sum(lj[1])
            lj[2] = lj[1] * T.cast(n_chunks + 64, acc) * T.float32(SEGMENT_SUM_REL) + T.float32(SEGMENT_SUM_ABS)
            lj[3] = 0.0
            lj[4] = -T.infinity(acc)
            lj[5] = 0.0
            lj[6] = 0.0
            nb[0] = 0
            nb[1] = 1
            for r in T.serial(T.ceildiv(n_chunks, 32)):
                if nb[1] == 1:  # (the same on every lane)
                    c = n_chunks - 1 - (32 * r + lane)  # this lane's chunk, from the last
                    lj[7] = T.if_then_else(c >= 0, chunk_bound[h, fs + c], T.float32(0))
                    lj[9] = T.if_then_else(c >= 0, chunk_emit[h, fs + c], -T.infinity(acc))
                    for d in T.unroll(5):  # the bounds from chunk c to the end: an inclusive scan over the lanes
                        lj[8] = T.shfl_up(lj[7], 1 << d)
                        if lane >= (1 << d):
                            lj[7] = lj[7] + lj[8]
                    lj[7] = lj[7] + lj[3]
                    lj[9] = lj[9] + (lj[0] - lj[7])  # J_c + the bounds before c
                    lj[10] = T.if_then_else(T.isnan(lj[9]), T.float32(1), T.float32(0))
                    lj[9] = T.if_then_else(lj[10] > 0, -T.infinity(acc), lj[9])
                    lj[11] = T.if_then_else(lj[9] > -T.infinity(acc), T.float32(1), T.float32(0))
                    lse_scan(lj, lane, 10, 9, 11, 8, 12)  # inclusive (max, sum) scan, and the NaN flag's
                    # with the rounds before
                    lj[10] = T.max(lj[10], lj[6])
                    lse_merge(lj, 9, 11, 4, 5)
                    # what the chunks from c on owe the start gradient, with the margin; a NaN fails ("not below"
                    # spelled out: TileLang rewrites Not(a < b) to b <= a, which a NaN passes)
                    lj[12] = T.if_then_else(lj[9] == -T.infinity(acc), lj[9], lj[9] + T.log(lj[11])) + lj[2]
                    nb[2] = T.warp_reduce_min(T.if_then_else(
                        T.And(c >= 0, T.Or(T.Or(lj[10] > 0, T.isnan(lj[12])),
                                           lj[12] >= T.float32(NEGLIGIBLE_LOG_NORM))), 32 * r + lane, 1 << 30))
                    if nb[2] < (1 << 30):
                        nb[0] = n_chunks - nb[2]  # through the failing chunk
                        nb[1] = 0
                    else:  # carried to the next round: the last lane's
                        lj[3] = T.shfl_sync(lj[7], 31)
                        lj[4] = T.shfl_sync(lj[9], 31)
                        lj[5] = T.shfl_sync(lj[11], 31)
                        lj[6] = T.shfl_sync(lj[10], 31)
            if lane == 0:
                walk_chunks[n, h] = nb[0]

    return tilelang.compile(walk_covers_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())
