"""Stage 2 of the Hopper forward, warp-specialised: the same math as ``chunk_forward.py``, split over roles.

Math (DESIGN.md §2), per chunk with S the state at its start:

    W = V - diag(gamma) K S          Vn = Ag W          (Ag = Gam ⊙ A ⊙ (1 beta^T) from stage 1)
    O  = scale (diag(gamma) Q S + (Gam ⊙ Q K^T) Vn)
    S' = gamma_C S + K^T diag(exp(g~_last - g~)) Vn

PyTorch counterparts: ``flashgdn.reference.chunked.new_values``, ``chunk_states``, ``chunk_outputs``.

Roles (one CTA = one sequence x one value head, 512 threads):

* warpgroups 0 and 1, the **state path**: each owns half of the state's V columns (S is [K, 64] fp32 in its
  registers) and runs the dependent chain K S -> W -> Ag W -> K^T Vn. Splitting V between two warpgroups halves
  the width of every GEMM on the chain, which is what bounds a long sequence.
* warpgroup 2, the **output path**: the gated, masked Q K^T one chunk ahead, then Q S and (Gam ⊙ Q K^T) Vn
  for the output, stored straight from registers. None of it is on the chain, so it overlaps the next
  chunk's state work.
* warpgroup 3, the **producer**: TMA loads of q, k, v, Ag and g~ into a two-stage ring. Ag and g~ are stage 1's
  per-chunk-slot tiles (zero / flat past a sequence's end), so they are always one TMA box each; q, k and v of
  the last, partial chunk of a sequence are loaded by masked plain loads, so rows of the next sequence never
  enter.

Hand-offs are mbarriers; the state reaches the output path as bf16 in shared memory, double-buffered so the
state path can write S' while the output path still reads S.
"""

from .common import CHUNK, LOG2E, TARGET, kernel_cache, pass_configs
from .ring_producer import make_ring_producer


@kernel_cache
def build_chunk_forward_ws(
    Hqk: int,
    Hv: int,
    K: int,
    V: int,
    io_dtype: str,
    has_initial_state: bool,
    store_final_state: bool,
    state_v_first: bool,
):
    """Compile (or load) the warp-specialised chunk loop. Same arguments as ``build_chunk_forward``'s kernel."""
    import tilelang
    import tilelang.language as T

    C = CHUNK
    group = Hv // Hqk
    HV2 = V // 2  # V columns per state warpgroup
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")
    slot_rows = T.dynamic("slot_rows")
    n_h0 = T.dynamic("n_h0")
    n_ht = T.dynamic("n_ht")
    acc = "float32"
    state_shape_h0 = (n_h0, Hv, V, K) if state_v_first else (n_h0, Hv, K, V)
    state_shape_ht = (n_ht, Hv, V, K) if state_v_first else (n_ht, Hv, K, V)

    @T.macro
    def state_path(w, n, h, n_chunks, h0, ht, k_s, v_s, gc_s, a_s, s_half, vn_half, w_half,
                   full, empty, s_ready, s_free, vn_ready, vn_free):
        # S[:, w*HV2 : (w+1)*HV2] in registers, fp32
        s_f = T.alloc_fragment((K, HV2), acc)
        u_f = T.alloc_fragment((C, HV2), acc)
        c0 = w * HV2
        if has_initial_state:
            if state_v_first:
                for i, j in T.Parallel(K, HV2):
                    s_f[i, j] = h0[n, h, c0 + j, i]
            else:
                for i, j in T.Parallel(K, HV2):
                    s_f[i, j] = h0[n, h, i, c0 + j]
        else:
            T.clear(s_f)
        T.copy(s_f, s_half[0, :, :])
        T.fence_proxy_async()
        T.barrier_arrive(s_ready[0])

        for c in T.serial(n_chunks):
            st = c % 2
            T.barrier_wait(full[st], (c // 2) % 2)
            # W = V - diag(gamma) K S
            T.gemm(k_s[st, :, :], s_half[st, :, :], u_f, clear_accum=True)
            for i, j in T.Parallel(C, HV2):
                u_f[i, j] = v_s[st, i, c0 + j] - T.exp2(gc_s[st, i] * LOG2E) * u_f[i, j]
            T.copy(u_f, w_half)
            T.fence_proxy_async()
            # Vn = Ag W
            T.gemm(a_s[st, :, :], w_half, u_f, clear_accum=True)
            T.barrier_wait(vn_free, (c + 1) % 2)
            T.copy(u_f, vn_half)
            T.fence_proxy_async()
            T.barrier_arrive(vn_ready)
            # S' = gamma_C S + K^T diag(exp(g~_last - g~)) Vn ; rows past the end have factor 0
            for i, j in T.Parallel(C, HV2):
                u_f[i, j] = u_f[i, j] * T.exp2((gc_s[st, C - 1] - gc_s[st, i]) * LOG2E)
            T.copy(u_f, w_half)
            T.fence_proxy_async()
            for i, j in T.Parallel(K, HV2):
                s_f[i, j] = s_f[i, j] * T.exp2(gc_s[st, C - 1] * LOG2E)
            T.gemm(k_s[st, :, :], w_half, s_f, transpose_A=True)
            T.barrier_arrive(empty[st])
            # hand S' to the output path once it is done reading the buffer two chunks back
            T.barrier_wait(s_free[1 - st], ((c + 1) // 2 + 1) % 2)
            T.copy(s_f, s_half[1 - st, :, :])
            T.fence_proxy_async()
            T.barrier_arrive(s_ready[1 - st])

        if store_final_state:
            if state_v_first:
                for i, j in T.Parallel(K, HV2):
                    ht[n, h, c0 + j, i] = s_f[i, j]
            else:
                for i, j in T.Parallel(K, HV2):
                    ht[n, h, i, c0 + j] = s_f[i, j]

    @T.macro
    def output_prepare(cc, q_s, k_s, gc_s, p_s, p_f, full, scale):
        # P = scale Gam ⊙ Q K^T, masked, for the output of chunk cc
        sc = cc % 2
        T.barrier_wait(full[sc], (cc // 2) % 2)
        T.gemm(q_s[sc, :, :], k_s[sc, :, :], p_f, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(C, C):
            p_f[i, j] = T.if_then_else(
                i >= j, p_f[i, j] * scale * T.exp2((gc_s[sc, i] - gc_s[sc, j]) * LOG2E), 0.0
            )
        T.copy(p_f, p_s[sc, :, :])
        T.fence_proxy_async()

    producer = make_ring_producer(C, K, V, io_dtype, first_warp=384, load_q=True)

    @T.prim_func
    def chunk_forward_ws_kernel(
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
        with T.Kernel(Hv, num_seqs, threads=512) as (h, n):
            hq = h // group
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            n_chunks = T.ceildiv(eos - bos, C)

            # two-stage input ring
            q_s = T.alloc_shared((2, C, K), io_dtype)
            k_s = T.alloc_shared((2, C, K), io_dtype)
            v_s = T.alloc_shared((2, C, V), io_dtype)
            a_s = T.alloc_shared((2, C, C), io_dtype)
            gc_s = T.alloc_shared((2, C), acc)
            # hand-offs
            s0_s = T.alloc_shared((2, K, HV2), io_dtype)  # S halves (bf16): state path -> output path
            s1_s = T.alloc_shared((2, K, HV2), io_dtype)
            vn0_s = T.alloc_shared((C, HV2), io_dtype)  # Vn halves: state path -> output path
            vn1_s = T.alloc_shared((C, HV2), io_dtype)
            w0_s = T.alloc_shared((C, HV2), io_dtype)  # W, then the decayed Vn (state path, private)
            w1_s = T.alloc_shared((C, HV2), io_dtype)
            p_s = T.alloc_shared((2, C, C), io_dtype)  # scale Gam ⊙ Q K^T (output path, private, 2 chunks)

            full = T.alloc_barrier(arrive_count=[96] * 2)  # producer warps 0..2 -> consumers
            empty = T.alloc_barrier(arrive_count=[384] * 2)  # consumers -> producer
            s_ready = T.alloc_barrier(arrive_count=[256] * 2)
            s_free = T.alloc_barrier(arrive_count=[128] * 2)
            vn_ready = T.alloc_barrier(arrive_count=256)
            vn_free = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()

            if tx < 128:
                T.set_max_nreg(160, 1)
                state_path(0, n, h, n_chunks, h0, ht, k_s, v_s, gc_s, a_s, s0_s, vn0_s, w0_s,
                           full, empty, s_ready, s_free, vn_ready, vn_free)
            elif tx < 256:
                T.set_max_nreg(160, 1)
                state_path(1, n, h, n_chunks, h0, ht, k_s, v_s, gc_s, a_s, s1_s, vn1_s, w1_s,
                           full, empty, s_ready, s_free, vn_ready, vn_free)
            elif tx < 384:
                # ---------------- output path
                # Software-pipelined one chunk ahead: P of chunk c + 1 is made while the state path finishes
                # chunk c.
                T.set_max_nreg(136, 1)
                p_f = T.alloc_fragment((C, C), acc)
                o0_f = T.alloc_fragment((C, HV2), acc)
                o1_f = T.alloc_fragment((C, HV2), acc)
                if n_chunks > 0:
                    output_prepare(0, q_s, k_s, gc_s, p_s, p_f, full, scale)
                for c in T.serial(n_chunks):
                    st = c % 2
                    t0 = bos + c * C
                    n_rows = T.min(eos - t0, C)
                    # O = scale diag(gamma) Q S
                    T.barrier_wait(s_ready[st], (c // 2) % 2)
                    T.gemm(q_s[st, :, :], s0_s[st, :, :], o0_f, clear_accum=True)
                    T.gemm(q_s[st, :, :], s1_s[st, :, :], o1_f, clear_accum=True)
                    T.barrier_arrive(s_free[st])
                    for i, j in T.Parallel(C, HV2):
                        o0_f[i, j] = o0_f[i, j] * scale * T.exp2(gc_s[st, i] * LOG2E)
                        o1_f[i, j] = o1_f[i, j] * scale * T.exp2(gc_s[st, i] * LOG2E)
                    if c + 1 < n_chunks:
                        output_prepare(c + 1, q_s, k_s, gc_s, p_s, p_f, full, scale)
                    # O += (scale Gam ⊙ Q K^T) Vn
                    T.barrier_wait(vn_ready, c % 2)
                    T.gemm(p_s[st, :, :], vn0_s, o0_f)
                    T.gemm(p_s[st, :, :], vn1_s, o1_f)
                    T.barrier_arrive(vn_free)
                    T.barrier_arrive(empty[st])
                    for i, j in T.Parallel(C, HV2):
                        if i < n_rows:
                            o[0, t0 + i, h, j] = o0_f[i, j]
                            o[0, t0 + i, h, HV2 + j] = o1_f[i, j]
                # padded tail after the last sequence: zeros
                if n == num_seqs - 1:
                    for c in T.serial(T.ceildiv(num_tokens - eos, C)):
                        for i, j in T.Parallel(C, V):
                            if eos + c * C + i < num_tokens:
                                o[0, eos + c * C + i, h, j] = T.cast(0, io_dtype)
            else:
                # ---------------- producer
                T.set_max_nreg(56, 0)
                producer(tx, n, h, hq, bos, eos, n_chunks, q, k, v, gcum, Ag, first_slot, q_s, k_s, v_s, a_s, gc_s,
                         full, empty)

    return tilelang.compile(
        chunk_forward_ws_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs()
    )
