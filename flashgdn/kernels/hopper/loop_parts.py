"""Pieces shared by the warp-specialised chunk loops (``chunk_forward_rs``, ``chunk_forward_uw``) and the
backward's state-gradient walk (``state_grad_walk``): each a TileLang macro, inlined where it is called.

* ``load_state`` / ``store_state``: a state warpgroup's 64 rows of S^T from / to the initial / final state, in
  either state layout (K-major ``[.., K, V]`` or V-major ``[.., V, K]``);
* ``store_output``: O^T of a state warpgroup, transposed through shared memory and stored by one TMA copy per
  chunk (a masked copy for a sequence's last, partial chunk);
* ``masked_p``: P = scale Gam ⊙ Q K^T (lower, diagonal included) in a register fragment (``gate_qk`` its element-wise
  part, for a Q K^T made elsewhere); ``gate_p`` / ``gate_decays``:
  what the gate warpgroup makes one chunk ahead, P into shared memory and the per-token factors
  gamma_i = exp(g~_i), d_i = exp(g~_last - g~_i);
* ``decay_state_once`` / ``column_factors``: a state path's gamma_C scaling with exp(g~_last) taken once, and its
  column factors gamma_j and d_j read once per chunk into registers (the trimmed builds: rso's ``lean_output`` and
  ``lean_state``, the rs loop's and the walk's ``lean``);
* ``zero_tail``: o = 0 on the padded tokens after the last sequence.
"""
from types import SimpleNamespace

from .common import LOG2E


def make_loop_parts(C: int, K: int, V: int, io_dtype: str, has_initial_state: bool = True,
                    store_final_state: bool = True, state_v_first: bool = False):
    """The macros for one configuration (chunk C, head dims K and V, the io dtype, the state flags)."""
    import tilelang.language as T

    HV2 = V // 2

    @T.macro
    def load_state(st_f, h0, n, h, c0):
        if has_initial_state:
            if state_v_first:
                for i, j in T.Parallel(HV2, K):
                    st_f[i, j] = h0[n, h, c0 + i, j]
            else:
                for i, j in T.Parallel(HV2, K):
                    st_f[i, j] = h0[n, h, j, c0 + i]
        else:
            T.clear(st_f)

    @T.macro
    def store_state(st_f, ht, n, h, c0):
        if store_final_state:
            if state_v_first:
                for i, j in T.Parallel(HV2, K):
                    ht[n, h, c0 + i, j] = st_f[i, j]
            else:
                for i, j in T.Parallel(HV2, K):
                    ht[n, h, j, c0 + i] = st_f[i, j]

    @T.macro
    def store_output(o_f, o_s, o, w, t0, n_rows, h, c0):
        # O^T -> O through shared memory (transposed there), then one TMA store for a whole chunk
        for i, j in T.Parallel(HV2, C):
            o_s[w, j, i] = o_f[i, j]
        T.fence_proxy_async()
        if n_rows == C:
            T.copy(o_s[w, :, :], o[0, t0:t0 + C, h, c0:c0 + HV2])
        else:
            for j, i in T.Parallel(C, HV2):
                if j < n_rows:
                    o[0, t0 + j, h, c0 + i] = o_s[w, j, i]

    @T.macro
    def gate_qk(gc_s, p_f, st, scale):
        # Q K^T (in p_f) -> P = scale Gam ⊙ Q K^T, lower with the diagonal
        for i, j in T.Parallel(C, C):
            p_f[i, j] = T.if_then_else(
                i >= j, p_f[i, j] * scale * T.exp2((gc_s[st, i] - gc_s[st, j]) * LOG2E), 0.0
            )

    @T.macro
    def masked_p(q_s, k_s, gc_s, p_f, st, scale):
        T.gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)
        gate_qk(gc_s, p_f, st, scale)

    @T.macro
    def gate_p(q_s, k_s, gc_s, p_f, p_s, st, scale):
        masked_p(q_s, k_s, gc_s, p_f, st, scale)
        T.copy(p_f, p_s[st, :, :])

    @T.macro
    def gate_decays(gc_s, gam_s, dec_s, st):
        for i in T.Parallel(C):
            gam_s[st, i] = T.exp2(gc_s[st, i] * LOG2E)
            dec_s[st, i] = T.exp2((gc_s[st, C - 1] - gc_s[st, i]) * LOG2E)

    @T.macro
    def decay_state_once(st_f, gc_s, st, gl):
        # S^T *= gamma_C with exp(g~_last) taken once into ``gl`` (one float32 local) instead of once per element
        gl[0] = T.exp2(gc_s[st, C - 1] * LOG2E)
        for i, j in T.Parallel(HV2, K):
            st_f[i, j] = st_f[i, j] * gl[0]

    @T.macro
    def column_factors(gam_s, dec_s, gcol_f, dcol_f, st):
        # gamma_j and d_j into [C] fragments, once per chunk: used beside a state path's [64, C] accumulator, each
        # holds only the thread's 16 columns (its layout is inferred from that use)
        for j in T.Parallel(C):
            gcol_f[j] = gam_s[st, j]
            dcol_f[j] = dec_s[st, j]

    @T.macro
    def decay_columns(u_f, dcol_f, dec_s, st, lean):
        # a state path's [64, C] accumulator times d_j per column: from the thread's column fragment (``lean``, read
        # once per chunk by ``column_factors``; None otherwise) or from shared memory per element
        if lean:
            for i, j in T.Parallel(HV2, C):
                u_f[i, j] = u_f[i, j] * dcol_f[j]
        else:
            for i, j in T.Parallel(HV2, C):
                u_f[i, j] = u_f[i, j] * dec_s[st, j]

    @T.macro
    def zero_tail(o, n, h, eos, num_seqs, num_tokens):
        if n == num_seqs - 1:
            for c in T.serial(T.ceildiv(num_tokens - eos, C)):
                for i, j in T.Parallel(C, V):
                    if eos + c * C + i < num_tokens:
                        o[0, eos + c * C + i, h, j] = T.cast(0, io_dtype)

    return SimpleNamespace(load_state=load_state, store_state=store_state, store_output=store_output,
                           masked_p=masked_p, gate_qk=gate_qk, gate_p=gate_p, gate_decays=gate_decays,
                           decay_state_once=decay_state_once, column_factors=column_factors, decay_columns=decay_columns,
                           zero_tail=zero_tail)
