"""Stage 1 of the Hopper backward: the state gradients, one reverse walk per (sequence, value head).

Math (``reference/chunked_backward.py``, step 1), per chunk walked from its end, dS' the state gradient there:

    X   = diag(d) K dS' + P^T dO                 (= dVn)
    Y   = Ag^T X                                  (= dW = dV)
    dS  = gamma_C dS' - K^T diag(gamma) Y + scale Q^T diag(gamma) dO

i.e. ``dS = M^T dS' + E^T dO``, the forward's transition transposed. It is written for dS^T [V, K], so that, as in
the forward's rs loop (``chunk_forward_rs.py``), every GEMM on the chain takes its left operand from registers:

    X^T  = (dS'^T K^T) diag(d) + dO^T P           A = dS'^T (regs), B = K (tile);  A = dO^T (tile), B = P
    Y^T  = X^T Ag                                 A = X^T (regs),   B = Ag (tile)
    dS^T = gamma_C dS'^T - (Y^T diag(gamma)) K + dO^T Qg,   Qg = scale diag(gamma) Q
                                                  A = regs, B = K (tile);  A = dO^T (tile), B = Qg (shared)

Neither v nor the initial state enters: only q, k, dO, stage 1's Ag and g~ (``kkt_inverse``) and the final
state's gradient. Outputs: the state gradient at the end of every chunk (what the per-chunk gradients need) and
at every sequence's start (d initial state). With ``staged_stores`` (an A/B, ``backward.STAGED_STATE_STORES``)
each state warpgroup writes its 64 rows of dS'^T to shared memory and sends them with one TMA store per chunk,
instead of element-wise stores from its registers.

With ``precise`` (bfloat16 only; the forward's precise mode, ``forward.PRECISE``) every register operand (dS'^T,
X^T, -Y^T diag(gamma)) goes to the tensor cores as three bf16 terms, hi + mid + lo (a float32's 24 bits), three
wgmma per GEMM on the chain, as in the rs loop's state-only passes in their precise mode: the walk's result then depends on the rounding of its tiles (K, P, Ag, Qg, dO) only, which
are the same values with and without context parallelism, so the two runs agree far below bf16's rounding (what
exact context parallelism at g = 0 needs, ``docs/context-parallel.md``).

Roles (one CTA = one sequence x one value head, 512 threads), as in the forward's rs loop:
* warpgroups 0 and 1: each owns 64 rows of dS^T in registers and walks the chunks last to first;
* warpgroup 2, one chunk ahead: P = scale Gam ⊙ Q K^T (masked), Qg, gamma and the decays d;
* warpgroup 3: the producer of the forward loops (``ring_producer.py``) walking backwards, with dO in v's place.

PyTorch counterpart: ``flashgdn.reference.chunked_backward.chunk_state_gradients_reference``.
"""

from .common import CHUNK, LOG2E, TARGET, kernel_cache, pass_configs
from .loop_parts import make_loop_parts
from .ring_producer import make_ring_producer

STATE_REGS, GATE_REGS, PRODUCER_REGS = 192, 72, 56
#: the precise mode keeps the second and third terms of X^T and Y^T live on the state path
PRECISE_REGS = (200, 72, 40)


@kernel_cache
def build_state_grad_walk(Hqk: int, Hv: int, K: int, V: int, io_dtype: str, has_final_grad: bool,
                          staged_stores: bool = False, precise: bool = False, lean: bool = False,
                          starts_only: bool = False, early_stop: bool = False):
    """Compile (or load) the walk. Arguments of the returned kernel, in order:

      q, k      [1, T, Hqk, K]   io dtype (normalised as the forward used them)
      do        [1, T, Hv, V]    io dtype
      gcum      [Hv, 64 S]       float32, stage 1's per-slot cumsum
      Ag        [S, Hv, 64, 64]  io dtype, stage 1's per-slot gated inverse
      cu_seqlens [N + 1] int32, first_slot [N] int32 (``forward.chunk_plan``)
      dht       [n, Hv, K, V]    float32, the final state's gradient (K-major; read only if has_final_grad)
      scale     float32
      ds_end    [S, Hv, V, K]    io dtype, written: dS^T at the end of every chunk slot (V-major; the rounding
                                 the GEMMs here and in ``chunk_grad`` read it with, at half float32's memory)
      dh0       [N, Hv, K, V]    float32, written: the gradient at every sequence's start (K-major)
    
    ``lean`` (an A/B, ``forward.LEAN_STATE_PASSES``): the state paths read d_j and gamma_j once per chunk into fragments
    of the thread's 16 columns, and exp(g~_last) once, instead of once per element; the same bits.

    ``starts_only`` (``backward.WALK_STARTS_ONLY``, on by default): the walk that context parallelism runs on every
    segment from a zero end gradient needs only the gradient at the segment's start (its D,
    ``flashgdn.cp.backward``), yet the build above stores dS'^T at the end of every chunk too, 32 KB a chunk and value
    head that nothing reads: cast, staged, sent by TMA and waited for by one thread of each state warpgroup before the
    chunk's first GEMM, on the chain. This build has no ``ds_end`` argument and makes none of that. ``dh0`` gets the
    same values (the stores only read the registers the walk goes on with), so the same bits.

    ``early_stop`` (with ``starts_only``; an A/B, ``backward.WALK_EARLY_STOP``) adds a last argument ``walk_chunks
    [sequences, Hv]`` int32 (``flashgdn.cp.bounds.walk_stop_chunks``): the item walks only the first ``walk_chunks[n,
    h]`` chunks of its sequence (segment), from zero at the last of them, the later tokens owing its start gradient
    less than float32's smallest normal number. Those chunks are walked as the build without it walks them.
    """
    import tilelang
    import tilelang.language as T

    if precise and io_dtype != "bfloat16":
        raise ValueError("the precise mode is bfloat16 only, as the forward's (forward.PRECISE)")
    if early_stop and not starts_only:
        raise ValueError("early_stop is built beside starts_only (the walk from zero that keeps its start gradients)")
    C = CHUNK
    group = Hv // Hqk
    state_regs, gate_regs, producer_regs = PRECISE_REGS if precise else (STATE_REGS, GATE_REGS, PRODUCER_REGS)
    HV2 = V // 2
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")
    slot_rows = T.dynamic("slot_rows")
    n_dht = T.dynamic("n_dht")
    acc = "float32"

    parts = make_loop_parts(C, K, V, io_dtype)

    @T.macro
    def state_path(w, n, h, n_chunks, first_slot, dht, ds_end, dh0, k_s, do_s, a_s, gc_s, p_s, qg_s, gam_s,
                   dec_s, full, empty, p_ready):
        c0 = w * HV2
        st_f = T.alloc_fragment((HV2, K), acc)  # dS^T rows c0 .. c0 + 63
        sb_f = T.alloc_fragment((HV2, K), io_dtype)
        if staged_stores and not starts_only:  # this warpgroup's dS^T rows, for the TMA store
            dss_s = T.alloc_shared((HV2, K), io_dtype)
        u_f = T.alloc_fragment((HV2, C), acc)  # X^T, then Y^T
        ub_f = T.alloc_fragment((HV2, C), io_dtype)
        if precise:  # second terms of X^T and -Y^T diag(gamma) (then the latter's third), X^T's third
            lb_f = T.alloc_fragment((HV2, C), io_dtype)
            xb_f = T.alloc_fragment((HV2, C), io_dtype)
        if lean:  # d_j and gamma_j per column of the thread's [64, C] accumulator, gamma_C
            dcol_f = T.alloc_fragment((C,), acc)
            gcol_f = T.alloc_fragment((C,), acc)
            gl = T.alloc_local((1,), acc)
        if has_final_grad:
            for i, j in T.Parallel(HV2, K):
                st_f[i, j] = dht[n, h, j, c0 + i]
        else:
            T.clear(st_f)

        for c in T.serial(n_chunks):
            st = c % 2
            slot = first_slot[n] + (n_chunks - 1 - c)
            # the gradient at this chunk's end, for the per-chunk gradients
            if starts_only:
                pass
            elif staged_stores:
                for i, j in T.Parallel(HV2, K):
                    dss_s[i, j] = T.cast(st_f[i, j], io_dtype)
                T.fence_proxy_async()
                T.copy(dss_s, ds_end[slot, h, c0:c0 + HV2, :])
            else:
                for i, j in T.Parallel(HV2, K):
                    ds_end[slot, h, c0 + i, j] = T.cast(st_f[i, j], io_dtype)
            T.barrier_wait(full[st], (c // 2) % 2)
            T.copy(st_f, sb_f)
            T.gemm(sb_f, k_s[st, :, :], u_f, transpose_B=True, clear_accum=True)  # dS'^T K^T
            if precise:  # the second and third terms of dS'^T, in the same registers
                for i, j in T.Parallel(HV2, K):
                    sb_f[i, j] = st_f[i, j] - sb_f[i, j]
                T.gemm(sb_f, k_s[st, :, :], u_f, transpose_B=True)
                for i, j in T.Parallel(HV2, K):
                    sb_f[i, j] = st_f[i, j] - T.cast(T.cast(st_f[i, j], io_dtype), acc) - sb_f[i, j]
                T.gemm(sb_f, k_s[st, :, :], u_f, transpose_B=True)
            T.barrier_wait(p_ready[st], (c // 2) % 2)
            if lean:
                parts.column_factors(gam_s, dec_s, gcol_f, dcol_f, st)
            parts.decay_columns(u_f, dcol_f if lean else None, dec_s, st, lean)
            T.gemm(do_s[st, :, c0:c0 + HV2], p_s[st, :, :], u_f, transpose_A=True)  # + dO^T P
            T.copy(u_f, ub_f)
            if precise:  # all three terms first: this GEMM overwrites X^T
                for i, j in T.Parallel(HV2, C):
                    lb_f[i, j] = u_f[i, j] - ub_f[i, j]
                for i, j in T.Parallel(HV2, C):
                    xb_f[i, j] = u_f[i, j] - ub_f[i, j] - lb_f[i, j]
            T.gemm(ub_f, a_s[st, :, :], u_f, clear_accum=True)  # Y^T = X^T Ag
            if precise:
                T.gemm(lb_f, a_s[st, :, :], u_f)
                T.gemm(xb_f, a_s[st, :, :], u_f)
            if lean:
                for i, j in T.Parallel(HV2, C):
                    ub_f[i, j] = -u_f[i, j] * gcol_f[j]
                if precise:
                    for i, j in T.Parallel(HV2, C):
                        lb_f[i, j] = -u_f[i, j] * gcol_f[j] - ub_f[i, j]
                parts.decay_state_once(st_f, gc_s, st, gl)
            else:
                for i, j in T.Parallel(HV2, C):
                    ub_f[i, j] = -u_f[i, j] * gam_s[st, j]
                if precise:
                    for i, j in T.Parallel(HV2, C):
                        lb_f[i, j] = -u_f[i, j] * gam_s[st, j] - ub_f[i, j]
                for i, j in T.Parallel(HV2, K):
                    st_f[i, j] = st_f[i, j] * T.exp2(gc_s[st, C - 1] * LOG2E)
            T.gemm(ub_f, k_s[st, :, :], st_f)  # - (Y^T diag(gamma)) K
            if precise:
                T.gemm(lb_f, k_s[st, :, :], st_f)
                for i, j in T.Parallel(HV2, C):
                    lb_f[i, j] = -u_f[i, j] * (gcol_f[j] if lean else gam_s[st, j]) - ub_f[i, j] - lb_f[i, j]
                T.gemm(lb_f, k_s[st, :, :], st_f)
            T.gemm(do_s[st, :, c0:c0 + HV2], qg_s[st, :, :], st_f, transpose_A=True)  # + dO^T Qg
            T.barrier_arrive(empty[st])

        for i, j in T.Parallel(HV2, K):
            dh0[n, h, j, c0 + i] = st_f[i, j]

    producer = make_ring_producer(C, K, V, io_dtype, first_warp=384, load_q=True, reverse=True)

    @T.macro
    def walk_body(q, k, do, gcum, Ag, cu_seqlens, first_slot, dht, scale, ds_end, dh0, walk_chunks=None):
        with T.Kernel(Hv, num_seqs, threads=512) as (h, n):
            hq = h // group
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            n_chunks = T.ceildiv(eos - bos, C)
            if early_stop:  # the chunks before the bound's stop only, the last of them now the walk's first
                n_chunks = T.min(n_chunks, walk_chunks[n, h])
                eos = T.min(eos, bos + n_chunks * C)

            q_s = T.alloc_shared((2, C, K), io_dtype)
            k_s = T.alloc_shared((2, C, K), io_dtype)
            do_s = T.alloc_shared((2, C, V), io_dtype)
            a_s = T.alloc_shared((2, C, C), io_dtype)
            gc_s = T.alloc_shared((2, C), acc)
            p_s = T.alloc_shared((2, C, C), io_dtype)
            qg_s = T.alloc_shared((2, C, K), io_dtype)
            gam_s = T.alloc_shared((2, C), acc)
            dec_s = T.alloc_shared((2, C), acc)

            full = T.alloc_barrier(arrive_count=[96] * 2)
            empty = T.alloc_barrier(arrive_count=[384] * 2)
            p_ready = T.alloc_barrier(arrive_count=[128] * 2)

            tx = T.get_thread_binding()

            if tx < 128:
                T.set_max_nreg(state_regs, 1)
                state_path(0, n, h, n_chunks, first_slot, dht, ds_end, dh0, k_s, do_s, a_s, gc_s, p_s, qg_s,
                           gam_s, dec_s, full, empty, p_ready)
            elif tx < 256:
                T.set_max_nreg(state_regs, 1)
                state_path(1, n, h, n_chunks, first_slot, dht, ds_end, dh0, k_s, do_s, a_s, gc_s, p_s, qg_s,
                           gam_s, dec_s, full, empty, p_ready)
            elif tx < 384:
                # ---------------- gate path, one chunk ahead
                T.set_max_nreg(gate_regs, 0)
                p_f = T.alloc_fragment((C, C), acc)
                for c in T.serial(n_chunks):
                    st = c % 2
                    T.barrier_wait(full[st], (c // 2) % 2)
                    parts.gate_p(q_s, k_s, gc_s, p_f, p_s, st, scale)
                    for i, j in T.Parallel(C, K):
                        qg_s[st, i, j] = T.cast(
                            T.cast(q_s[st, i, j], acc) * scale * T.exp2(gc_s[st, i] * LOG2E), io_dtype)
                    parts.gate_decays(gc_s, gam_s, dec_s, st)
                    T.fence_proxy_async()
                    T.barrier_arrive(p_ready[st])
                    T.barrier_arrive(empty[st])
            else:
                # ---------------- producer, last chunk first
                T.set_max_nreg(producer_regs, 0)
                producer(tx, n, h, hq, bos, eos, n_chunks, q, k, do, gcum, Ag, first_slot, q_s, k_s, do_s, a_s,
                         gc_s, full, empty)


    # (TileLang reads a kernel's parameters from its signature, so the build without ds_end has its own)
    if early_stop:
        @T.prim_func
        def state_grad_walk_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            first_slot: T.Tensor((num_seqs,), "int32"),
            dht: T.Tensor((n_dht, Hv, K, V), "float32"),
            scale: T.float32,
            dh0: T.Tensor((num_seqs, Hv, K, V), "float32"),
            walk_chunks: T.Tensor((num_seqs, Hv), "int32"),
        ):
            walk_body(q, k, do, gcum, Ag, cu_seqlens, first_slot, dht, scale, None, dh0, walk_chunks)
    elif starts_only:
        @T.prim_func
        def state_grad_walk_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            first_slot: T.Tensor((num_seqs,), "int32"),
            dht: T.Tensor((n_dht, Hv, K, V), "float32"),
            scale: T.float32,
            dh0: T.Tensor((num_seqs, Hv, K, V), "float32"),
        ):
            walk_body(q, k, do, gcum, Ag, cu_seqlens, first_slot, dht, scale, None, dh0)
    else:
        @T.prim_func
        def state_grad_walk_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            first_slot: T.Tensor((num_seqs,), "int32"),
            dht: T.Tensor((n_dht, Hv, K, V), "float32"),
            scale: T.float32,
            ds_end: T.Tensor((num_slots, Hv, V, K), io_dtype),
            dh0: T.Tensor((num_seqs, Hv, K, V), "float32"),
        ):
            walk_body(q, k, do, gcum, Ag, cu_seqlens, first_slot, dht, scale, ds_end, dh0)

    return tilelang.compile(state_grad_walk_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())
