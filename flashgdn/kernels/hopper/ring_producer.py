"""The producer warpgroup shared by the warp-specialised chunk loops (``chunk_forward_ws``, ``chunk_forward_rs``).

It walks a sequence's chunks and fills a two-stage ring for one value head: warp 0 loads q (when the loop uses
it) and k, warp 1 v, warp 2 stage 1's per-slot tiles of Ag and g~. Whole chunks arrive by TMA; the last, partial
chunk of a sequence by masked plain loads (a row at a time, within the producer's small register budget), so rows
of the next sequence never enter and the tile is zero past the sequence's end. Ag and g~ tiles are zero / flat
past the end already (stage 1), so they are always one TMA box. Each of the three warps arrives on ``full[stage]``
(96 arrivals); a stage is refilled after ``empty[stage]`` completes.
"""


def make_ring_producer(C: int, K: int, V: int, io_dtype: str, first_warp: int, load_q: bool = True,
                       reverse: bool = False, paired: bool = False, gate_rows: bool = False):
    """The producer as a TileLang macro; ``first_warp`` is the thread index of the producer warpgroup's start.
    ``reverse`` walks a sequence's chunks last to first (the backward's state-gradient walk); ``v`` is then
    whatever value-head tensor the consumer needs (dO). ``paired``: the CTA's head h is one of a pair of the
    context-parallel transition pass, both on value head h // 2 (its Ag, g~ and qk head): h even loads v,
    h odd gets zeros (v's tile is zeroed once per ring stage and never written again). ``gate_rows``: the third
    warp loads the chunk's rows of g and beta for value head h (plain loads, zero past the sequence's end) into
    ``g_s`` and ``b_s`` instead of stage 1's Ag and g~ tiles (the loop that makes them itself). The macro's
    ``slot_shift``: the CTA's item starts that many chunks into the sequence whose slots begin at ``first_slot[n]``
    (``bos`` is its first token then; the transition pass's ``late_b``)."""
    import tilelang.language as T

    @T.macro
    def ring_producer(tx, n, h, hq, bos, eos, n_chunks, q, k, v, gcum, Ag, first_slot, q_s, k_s, v_s, a_s, gc_s,
                      full, empty, g=None, beta=None, g_s=None, b_s=None, slot_shift=None):
        for c in T.serial(n_chunks):
            st = c % 2
            if reverse:  # ring step c holds chunk n_chunks - 1 - c
                t0 = bos + (n_chunks - 1 - c) * C
            else:
                t0 = bos + c * C
            n_rows = T.min(eos - t0, C)
            T.barrier_wait(empty[st], (c // 2 + 1) % 2)
            if tx < first_warp + 32:
                if n_rows == C:
                    if load_q:
                        T.tma_copy(q[0, t0:t0 + C, hq, 0:K], q_s[st, :, :], barrier=full[st])
                    T.tma_copy(k[0, t0:t0 + C, hq, 0:K], k_s[st, :, :], barrier=full[st])
                else:
                    for i in T.serial(C):
                        for j in T.Parallel(K):
                            if load_q:
                                q_s[st, i, j] = T.if_then_else(i < n_rows, q[0, t0 + i, hq, j], T.cast(0, io_dtype))
                            k_s[st, i, j] = T.if_then_else(i < n_rows, k[0, t0 + i, hq, j], T.cast(0, io_dtype))
                    T.fence_proxy_async()
                T.barrier_arrive(full[st])
            elif tx < first_warp + 64:
                if paired:
                    if h % 2 == 0:
                        if n_rows == C:
                            T.tma_copy(v[0, t0:t0 + C, h // 2, 0:V], v_s[st, :, :], barrier=full[st])
                        else:
                            for i in T.serial(C):
                                for j in T.Parallel(V):
                                    v_s[st, i, j] = T.if_then_else(i < n_rows, v[0, t0 + i, h // 2, j],
                                                                   T.cast(0, io_dtype))
                            T.fence_proxy_async()
                    elif c < 2:
                        for i in T.serial(C):
                            for j in T.Parallel(V):
                                v_s[st, i, j] = T.cast(0, io_dtype)
                        T.fence_proxy_async()
                else:
                    if n_rows == C:
                        T.tma_copy(v[0, t0:t0 + C, h, 0:V], v_s[st, :, :], barrier=full[st])
                    else:
                        for i in T.serial(C):
                            for j in T.Parallel(V):
                                v_s[st, i, j] = T.if_then_else(i < n_rows, v[0, t0 + i, h, j], T.cast(0, io_dtype))
                        T.fence_proxy_async()
                T.barrier_arrive(full[st])
            elif tx < first_warp + 96:
                if gate_rows:
                    for i in T.Parallel(C):
                        g_s[st, i] = T.if_then_else(i < n_rows, g[0, t0 + i, h], 0.0)
                        b_s[st, i] = T.if_then_else(i < n_rows, beta[0, t0 + i, h], 0.0)
                else:
                    if reverse:
                        slot = first_slot[n] + (n_chunks - 1 - c)
                    elif slot_shift is not None:  # the item starts slot_shift chunks into its sequence (bos with it)
                        slot = first_slot[n] + slot_shift + c
                    else:
                        slot = first_slot[n] + c
                    if paired:
                        T.tma_copy(Ag[slot, h // 2, 0:C, 0:C], a_s[st, :, :], barrier=full[st])
                        T.tma_copy(gcum[h // 2, slot * C:slot * C + C], gc_s[st, :], barrier=full[st])
                    else:
                        T.tma_copy(Ag[slot, h, 0:C, 0:C], a_s[st, :, :], barrier=full[st])
                        T.tma_copy(gcum[h, slot * C:slot * C + C], gc_s[st, :], barrier=full[st])
                T.barrier_arrive(full[st])

    return ring_producer
