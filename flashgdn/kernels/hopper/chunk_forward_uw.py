"""Stage 2 of the Hopper forward with the state chain shortened to two GEMMs per chunk ("uw" chunk loop).

Same math as ``chunk_forward_rs.py`` (DESIGN.md §2, transposed state S^T [V, K]), but the new values are formed
from two products that do not depend on the state, made by the gate warpgroup one chunk ahead:

    U^T   = V^T Ag^T                                       (gate: A = V^T (tile), B = Ag (tile))
    Wk    = (Ag diag(gamma)) K                             (gate: A = Ag diag(gamma) (regs), B = K (tile))
    Vn^T  = U^T - S^T Wk^T                                 (state: A = S^T (regs), B = Wk (shared))
    O^T   = scale (S^T Q^T) diag(gamma) + Vn^T P^T         (state: register A operands, as in "rs")
    S'^T  = gamma_C S^T + (Vn^T diag(exp(g~_last - g~))) K

so the chain from one chunk's state to the next is S^T Wk^T, one subtraction, Vn^T K: two GEMMs instead of the
rs loop's three (S^T K^T, W^T Ag^T, Vn^T K) and one elementwise pass fewer. It is the WY form's
``Vn = U - W S`` (as in FLA's chunked delta rule), except that U and Wk never leave the SM: they are made per
chunk in shared memory, which the gate warpgroup's idle tensor time pays for. U and Wk are rounded to the io
dtype once each (the rs loop rounds W^T instead); ``benchmarks/numerics_study.py`` puts the two within a few
percent of each other against float64.

PyTorch counterparts: ``flashgdn.reference.chunked.new_values``, ``chunk_states``, ``chunk_outputs``.

Roles (one CTA = one sequence x one value head, 512 threads):

* warpgroups 0 and 1, the **state paths**: each owns 64 rows of S^T in registers and runs the chunk for them,
  output included (O^T is transposed into shared memory and leaves by one TMA store per chunk).
* warpgroup 2, the **gate path**, one chunk ahead: P = scale Gam ⊙ Q K^T (masked), gamma and the decays,
  Wk and U^T, into shared memory.
* warpgroup 3, the **producer** (``ring_producer.py``): q, k, v, Ag and g~ into a two-stage ring.

Hand-offs: full (producer -> all), p_ready (gate -> state), empty (all -> producer), one mbarrier per stage.
"""

from .common import CHUNK, LOG2E, TARGET, kernel_cache, pass_configs
from .loop_parts import make_loop_parts
from .ring_producer import make_ring_producer

# setmaxnreg per role: 2 x state + gate + producer = 512 (the register file at 512 threads). The state paths
# hold what the rs loop's do; the gate path one 64 x 64 float32 accumulator at a time.
STATE_REGS, GATE_REGS, PRODUCER_REGS = 192, 88, 40


@kernel_cache
def build_chunk_forward_uw(
    Hqk: int,
    Hv: int,
    K: int,
    V: int,
    io_dtype: str,
    has_initial_state: bool,
    store_final_state: bool,
    state_v_first: bool,
    with_output: bool = True,
):
    """Compile (or load) the uw chunk loop. Same arguments as ``build_chunk_forward_rs``'s kernel; with
    ``with_output=False`` it is the state-only pass (no q, P or O)."""
    import tilelang
    import tilelang.language as T

    C = CHUNK
    group = Hv // Hqk
    HV2 = V // 2  # rows of S^T per state warpgroup
    UPAD = 8  # U^T rows padded: the state paths read it row-wise, 8 rows at a time, without bank conflicts
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")
    slot_rows = T.dynamic("slot_rows")
    n_h0 = T.dynamic("n_h0")
    n_ht = T.dynamic("n_ht")
    o_tokens = num_tokens if with_output else T.dynamic("o_tokens")
    acc = "float32"
    state_shape_h0 = (n_h0, Hv, V, K) if state_v_first else (n_h0, Hv, K, V)
    state_shape_ht = (n_ht, Hv, V, K) if state_v_first else (n_ht, Hv, K, V)

    parts = make_loop_parts(C, K, V, io_dtype, has_initial_state, store_final_state, state_v_first)

    @T.macro
    def state_path(w, n, h, bos, eos, n_chunks, h0, ht, o, scale, q_s, k_s, gc_s, p_s, gam_s, dec_s, wk_s, ut_s,
                   o_s, full, empty, p_ready):
        c0 = w * HV2
        st_f = T.alloc_fragment((HV2, K), acc)  # S^T rows c0 .. c0 + 63
        sb_f = T.alloc_fragment((HV2, K), io_dtype)
        u_f = T.alloc_fragment((HV2, C), acc)  # Vn^T
        ub_f = T.alloc_fragment((HV2, C), io_dtype)
        if with_output:
            o_f = T.alloc_fragment((HV2, C), acc)  # O^T
        parts.load_state(st_f, h0, n, h, c0)

        for c in T.serial(n_chunks):
            st = c % 2
            t0 = bos + c * C
            n_rows = T.min(eos - t0, C)
            T.barrier_wait(full[st], (c // 2) % 2)
            T.copy(st_f, sb_f)
            if with_output:  # needs only the inputs: under way while the gate path finishes this chunk
                T.gemm(sb_f, q_s[st, :, :], o_f, transpose_B=True, clear_accum=True)
            T.barrier_wait(p_ready[st], (c // 2) % 2)
            # Vn^T = U^T - S^T Wk^T
            T.gemm(sb_f, wk_s[st, :, :], u_f, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(HV2, C):
                u_f[i, j] = ut_s[st, c0 + i, j] - u_f[i, j]
            T.copy(u_f, ub_f)
            if with_output:
                # O^T = scale (S^T Q^T) diag(gamma) + Vn^T P^T
                for i, j in T.Parallel(HV2, C):
                    o_f[i, j] = o_f[i, j] * (scale * gam_s[st, j])
                T.gemm(ub_f, p_s[st, :, :], o_f, transpose_B=True)
            # S'^T = gamma_C S^T + (Vn^T diag(exp(g~_last - g~))) K ; rows past the end have Vn = 0
            for i, j in T.Parallel(HV2, C):
                ub_f[i, j] = u_f[i, j] * dec_s[st, j]
            for i, j in T.Parallel(HV2, K):
                st_f[i, j] = st_f[i, j] * T.exp2(gc_s[st, C - 1] * LOG2E)
            T.gemm(ub_f, k_s[st, :, :], st_f)
            T.barrier_arrive(empty[st])
            if with_output:
                parts.store_output(o_f, o_s, o, w, t0, n_rows, h, c0)

        parts.store_state(st_f, ht, n, h, c0)

    producer = make_ring_producer(C, K, V, io_dtype, first_warp=384, load_q=with_output)

    @T.prim_func
    def chunk_forward_uw_kernel(
        q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
        gcum: T.Tensor((Hv, slot_rows), "float32"),
        Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        first_slot: T.Tensor((num_seqs,), "int32"),
        h0: T.Tensor(state_shape_h0, "float32"),
        scale: T.float32,
        o: T.Tensor((1, o_tokens, Hv, V), io_dtype),
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
            # gate path -> state paths, per ring stage
            p_s = T.alloc_shared((2, C, C), io_dtype)
            gam_s = T.alloc_shared((2, C), acc)
            dec_s = T.alloc_shared((2, C), acc)
            wk_s = T.alloc_shared((2, C, K), io_dtype)
            ut_s = T.alloc_shared((2, V, C + UPAD), io_dtype)
            o_s = T.alloc_shared((2, C, HV2), io_dtype)  # O of each state path, for the TMA store

            full = T.alloc_barrier(arrive_count=[96] * 2)  # producer warps 0..2 -> consumers
            empty = T.alloc_barrier(arrive_count=[384] * 2)  # consumers -> producer
            p_ready = T.alloc_barrier(arrive_count=[128] * 2)

            tx = T.get_thread_binding()

            if tx < 128:
                T.set_max_nreg(STATE_REGS, 1)
                state_path(0, n, h, bos, eos, n_chunks, h0, ht, o, scale, q_s, k_s, gc_s, p_s, gam_s, dec_s, wk_s,
                           ut_s, o_s, full, empty, p_ready)
            elif tx < 256:
                T.set_max_nreg(STATE_REGS, 1)
                state_path(1, n, h, bos, eos, n_chunks, h0, ht, o, scale, q_s, k_s, gc_s, p_s, gam_s, dec_s, wk_s,
                           ut_s, o_s, full, empty, p_ready)
            elif tx < 384:
                # ---------------- gate path
                T.set_max_nreg(GATE_REGS, 0)
                if with_output:
                    p_f = T.alloc_fragment((C, C), acc)
                ag_f = T.alloc_fragment((C, C), io_dtype)
                # Wk and U^T in 64-column / 64-row halves: one 64 x 64 accumulator at a time
                wk_f = T.alloc_fragment((C, K // 2), acc)
                ut_f = T.alloc_fragment((V // 2, C), acc)
                for c in T.serial(n_chunks):
                    st = c % 2
                    T.barrier_wait(full[st], (c // 2) % 2)
                    if with_output:
                        parts.gate_p(q_s, k_s, gc_s, p_f, p_s, st, scale)
                    parts.gate_decays(gc_s, gam_s, dec_s, st)
                    # Wk = (Ag diag(gamma)) K
                    for i, j in T.Parallel(C, C):
                        ag_f[i, j] = T.cast(T.cast(a_s[st, i, j], acc) * T.exp2(gc_s[st, j] * LOG2E), io_dtype)
                    for half in T.unroll(2):
                        T.gemm(ag_f, k_s[st, :, half * (K // 2):(half + 1) * (K // 2)], wk_f, clear_accum=True)
                        T.copy(wk_f, wk_s[st, :, half * (K // 2):(half + 1) * (K // 2)])
                    # U^T = V^T Ag^T
                    for half in T.unroll(2):
                        T.gemm(v_s[st, :, half * (V // 2):(half + 1) * (V // 2)], a_s[st, :, :], ut_f,
                               transpose_A=True, transpose_B=True, clear_accum=True)
                        T.copy(ut_f, ut_s[st, half * (V // 2):(half + 1) * (V // 2), 0:C])
                    T.fence_proxy_async()
                    T.barrier_arrive(p_ready[st])
                    T.barrier_arrive(empty[st])
                if with_output:  # padded tail after the last sequence: zeros
                    parts.zero_tail(o, n, h, eos, num_seqs, num_tokens)
            else:
                # ---------------- producer
                T.set_max_nreg(PRODUCER_REGS, 0)
                producer(tx, n, h, hq, bos, eos, n_chunks, q, k, v, gcum, Ag, first_slot, q_s, k_s, v_s, a_s, gc_s,
                         full, empty)

    return tilelang.compile(
        chunk_forward_uw_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs()
    )
