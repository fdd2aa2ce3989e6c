"""Stage 2 of the Hopper forward: the chunk loop of one (sequence, value head, V block), state in registers.

Math (DESIGN.md §2), for each chunk of C = 64 rows with S the state [K, BV] at its start, g~ the chunk-local
cumsum and Ag the gated inverse from stage 1 (``kkt_inverse``):

    Gam_ij = exp(g~_i - g~_j)  (i >= j, else 0)        gamma_i = exp(g~_i)       gamma_C = exp(g~_last)
    Ag     = Gam ⊙ A ⊙ (1 beta^T)                         (stage 1)
    W      = V - diag(gamma) K S                          (one GEMM, K S)
    Vn     = Ag W                                         ("new values")
    O      = scale * (diag(gamma) Q S + (Gam ⊙ Q K^T) Vn)
    S'     = gamma_C S + K^T diag(exp(g~_last - g~)) Vn

Every gate factor is the exp of a difference <= 0, so nothing overflows under strong decay. Rows of a
partial last chunk are zero-filled on load and their decay factor is 0, so they leave the state alone;
``g~_last`` is the cumsum at the chunk's last *real* row.

PyTorch counterparts: ``flashgdn.reference.chunked.new_values`` (Vn),
``chunk_states`` (S at chunk starts and the final state) and ``chunk_outputs`` (O).

One CTA walks one sequence for one value head and one block of V columns; sequence bounds are read on
the device from ``cu_seqlens``, so any mix of lengths runs on one compile with no host synchronisation.
The CTA of the last sequence also writes the zeros of the padded tail after ``cu_seqlens[-1]``.
"""

from .common import CHUNK, LOG2E, TARGET, kernel_cache, pass_configs


@kernel_cache
def build_chunk_forward(
    Hqk: int,
    Hv: int,
    K: int,
    V: int,
    BV: int,
    io_dtype: str,
    has_initial_state: bool,
    store_final_state: bool,
    state_v_first: bool,
    threads: int = 256,
):
    """Compile (or load from the cache) the chunk-loop kernel for one configuration.

    Arguments of the returned kernel, in order:
      q, k       [1, T, Hqk, K]  io dtype
      v          [1, T, Hv, V]   io dtype
      gcum       [Hv, 64 S]      float32 (stage 1, per chunk slot)
      Ag         [S, Hv, 64, 64] io dtype (stage 1, per chunk slot)
      cu_seqlens [N + 1]         int32
      first_slot [N]             int32: chunk slot of each sequence's first chunk
      h0         [N0, Hv, K, V]  float32 ([N0, Hv, V, K] when state_v_first); N0 = N, or 1 when unused
      scale      float32 scalar
      o          [1, T, Hv, V]   io dtype, written (zeros after cu_seqlens[-1])
      ht         [N1, Hv, K, V]  float32, written when store_final_state; N1 = N, or 1 when unused
    """
    import tilelang
    import tilelang.language as T

    C = CHUNK
    group = Hv // Hqk
    assert V % BV == 0
    n_vblocks = V // BV
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")
    slot_rows = T.dynamic("slot_rows")
    n_h0 = T.dynamic("n_h0")
    n_ht = T.dynamic("n_ht")
    acc = "float32"
    state_shape_h0 = (n_h0, Hv, V, K) if state_v_first else (n_h0, Hv, K, V)
    state_shape_ht = (n_ht, Hv, V, K) if state_v_first else (n_ht, Hv, K, V)

    @T.prim_func
    def chunk_forward_kernel(
        q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
        gcum: T.Tensor((Hv, slot_rows), "float32"),
        Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        first_slot: T.Tensor((num_seqs,), "int32"),
        h0: T.Tensor(state_shape_h0, "float32"),
        scale: T.float32,
        o: T.Tensor((1, num_tokens, Hv, V), io_dtype),
        ht: T.Tensor(state_shape_ht, "float32"),
    ):
        with T.Kernel(Hv * n_vblocks, num_seqs, threads=threads) as (hv, n):
            h = hv // n_vblocks
            v0 = (hv % n_vblocks) * BV
            hq = h // group
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            n_chunks = T.ceildiv(eos - bos, C)

            q_s = T.alloc_shared((C, K), io_dtype)
            k_s = T.alloc_shared((C, K), io_dtype)
            v_s = T.alloc_shared((C, BV), io_dtype)
            s_s = T.alloc_shared((K, BV), io_dtype)
            p_s = T.alloc_shared((C, C), io_dtype)
            ag_s = T.alloc_shared((C, C), io_dtype)
            w_s = T.alloc_shared((C, BV), io_dtype)
            vn_s = T.alloc_shared((C, BV), io_dtype)
            o_s = T.alloc_shared((C, BV), io_dtype)
            gc_s = T.alloc_shared((C,), acc)

            s_f = T.alloc_fragment((K, BV), acc)
            u_f = T.alloc_fragment((C, BV), acc)
            o_f = T.alloc_fragment((C, BV), acc)
            p_f = T.alloc_fragment((C, C), acc)
            g_last = T.alloc_var(acc)

            if has_initial_state:
                if state_v_first:
                    for i, j in T.Parallel(K, BV):
                        s_f[i, j] = h0[n, h, v0 + j, i]
                else:
                    for i, j in T.Parallel(K, BV):
                        s_f[i, j] = h0[n, h, i, v0 + j]
            else:
                T.clear(s_f)
            T.copy(s_f, s_s)

            for c in T.serial(n_chunks):
                t0 = bos + c * C
                n_rows = T.min(eos - t0, C)
                for i, j in T.Parallel(C, K):
                    q_s[i, j] = T.if_then_else(i < n_rows, q[0, t0 + i, hq, j], T.cast(0, io_dtype))
                    k_s[i, j] = T.if_then_else(i < n_rows, k[0, t0 + i, hq, j], T.cast(0, io_dtype))
                for i, j in T.Parallel(C, BV):
                    v_s[i, j] = T.if_then_else(i < n_rows, v[0, t0 + i, h, v0 + j], T.cast(0, io_dtype))
                # stage 1's tiles are zero (Ag) and flat (g~: no decay, no update) past the sequence's end
                slot = first_slot[n] + c
                for i, j in T.Parallel(C, C):
                    ag_s[i, j] = Ag[slot, h, i, j]
                for i in T.Parallel(C):
                    gc_s[i] = gcum[h, slot * C + i]
                g_last = gcum[h, slot * C + C - 1]
                T.fence_proxy_async()

                # state-independent: masked, gated Q K^T
                T.gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    p_f[i, j] = T.if_then_else(
                        i >= j, p_f[i, j] * scale * T.exp2((gc_s[i] - gc_s[j]) * LOG2E), 0.0
                    )
                T.copy(p_f, p_s)
                T.fence_proxy_async()

                # W = V - diag(gamma) K S ;  O = scale diag(gamma) Q S
                T.gemm(k_s, s_s, u_f, clear_accum=True)
                T.gemm(q_s, s_s, o_f, clear_accum=True)
                for i, j in T.Parallel(C, BV):
                    u_f[i, j] = v_s[i, j] - T.exp2(gc_s[i] * LOG2E) * u_f[i, j]
                    o_f[i, j] = o_f[i, j] * scale * T.exp2(gc_s[i] * LOG2E)
                T.copy(u_f, w_s)
                T.fence_proxy_async()

                # Vn = Ag W ;  O += (scale Gam ⊙ Q K^T) Vn
                T.gemm(ag_s, w_s, u_f, clear_accum=True)
                T.copy(u_f, vn_s)
                T.fence_proxy_async()
                T.gemm(p_s, vn_s, o_f)
                T.copy(o_f, o_s)

                # S' = gamma_C S + K^T diag(exp(g~_last - g~)) Vn
                for i, j in T.Parallel(C, BV):
                    u_f[i, j] = T.if_then_else(
                        i < n_rows, u_f[i, j] * T.exp2((g_last - gc_s[i]) * LOG2E), 0.0
                    )
                T.copy(u_f, w_s)
                T.fence_proxy_async()
                for i, j in T.Parallel(K, BV):
                    s_f[i, j] = s_f[i, j] * T.exp2(g_last * LOG2E)
                T.gemm(k_s, w_s, s_f, transpose_A=True)
                T.copy(s_f, s_s)

                for i, j in T.Parallel(C, BV):
                    if i < n_rows:
                        o[0, t0 + i, h, v0 + j] = o_s[i, j]

            if store_final_state:
                if state_v_first:
                    for i, j in T.Parallel(K, BV):
                        ht[n, h, v0 + j, i] = s_f[i, j]
                else:
                    for i, j in T.Parallel(K, BV):
                        ht[n, h, i, v0 + j] = s_f[i, j]

            # padded tail after the last sequence: zeros, written by the last sequence's CTAs
            if n == num_seqs - 1:
                for c in T.serial(T.ceildiv(num_tokens - eos, C)):
                    for i, j in T.Parallel(C, BV):
                        if eos + c * C + i < num_tokens:
                            o[0, eos + c * C + i, h, v0 + j] = T.cast(0, io_dtype)

    return tilelang.compile(
        chunk_forward_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs()
    )
