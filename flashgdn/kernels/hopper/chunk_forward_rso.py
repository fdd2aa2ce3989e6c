"""Stage 2 of the Hopper forward: the rs loop's state chain with the output on a warpgroup of its own ("rso" loop).

Same math as ``chunk_forward_rs.py`` (DESIGN.md §2), split by what depends on what. The chain from one chunk's
state to the next needs only

    W^T  = V^T - (S^T K^T) diag(gamma)          Vn^T = W^T Ag^T
    S'^T = gamma_C S^T + (Vn^T diag(exp(g~_last - g~))) K

and the output is a side branch that reads S and Vn and feeds nothing back:

    O = scale diag(gamma) Q S + P Vn,     P = scale Gam ⊙ Q K^T (lower, diagonal included)

The rs loop runs both on its two state warpgroups, so every chunk's S^T Q^T, Vn^T P^T, O's scaling and O's store sit
between one state and the next; its state-only pass (the chain alone) takes 0.55x-0.6x its time
(``stages-hopper-v0.10a.json``). Here the state warpgroups run the chain alone, as in the state-only pass, and hand
S^T and Vn^T (bf16, the rounding their own GEMMs read them with) to the third warpgroup through shared memory, which
makes P = scale Gam ⊙ Q K^T itself, then O = Q S (operands in shared memory) and O += P Vn (P as the register
operand), and stores O by TMA. The decays move to the producer warpgroup's fourth warp, which issued no loads.
FlashQLA's Hopper kernel splits its roles the same way (state owner, V path, O path); what is kept from rs is the
chain's register operands (no W, Vn or S round trip through shared memory on it). Measured: 0.91x-0.94x rs's loop
time, 0.92x-0.96x the op's, the same bits (``docs/hopper-notes.md``, v0.11e); the default chunk loop.

PyTorch counterparts: ``flashgdn.reference.chunked.new_values``, ``chunk_states``, ``chunk_outputs``.

Roles (one CTA = one sequence x one value head, 512 threads):

* warpgroups 0 and 1, the **state paths**: 64 rows of S^T each in registers (float32), the chain above with
  register A operands; S^T goes to the output path while S^T K^T runs, Vn^T once it is made.
* warpgroup 2, the **output path**: P, O = Q S, its scaling, O += P Vn and O's store, for the chunk handed over. It
  was the longer of the two chains (``docs/hopper-notes.md``, v0.11a; since v0.13's trims the state chain sets the
  chunk and this path is ~300 cycles a chunk short of it, v0.20c), so its steps overlap where they can: Q K^T and
  Q S are issued together and P's element-wise pass runs while Q S is on the tensor cores, and O's TMA store is
  waited for only when the next chunk's O is about to overwrite its staging tile (0.95x-0.98x the serial order's
  loop time on most shapes, the same bits: ``docs/hopper-notes.md``, v0.12a).
* warpgroup 3: warps 0-2 the **producer** (``ring_producer.py``: q, k, v, Ag, g~ into a two-stage ring), warp 3 the
  **decays** of each ring stage, gamma_i = exp(g~_i) and d_i = exp(g~_last - g~_i), into shared memory.

Hand-offs (mbarriers): full (producer -> all), d_ready (decays -> state and output paths), s_ready / s_free (S^T,
double-buffered by ring stage), vn_ready / vn_free (Vn^T), empty (state and output paths -> producer; the output
path releases a stage once it has made Q S, before it waits for Vn).
"""

from .common import CHUNK, LOG2E, TARGET, kernel_cache, pass_configs
from .loop_parts import make_loop_parts
from .ring_producer import make_ring_producer

#: registers per thread after setmaxnreg: two state paths, output path, producer (sums to 512: the whole register
#: file at 512 threads). The output path holds P and O = Q S at once while Q S runs: 160 is the least at which ptxas
#: fits it without spills (176/128 and 168/144 spill), and the state paths still fit at 160.
STATE_REGS, OUTPUT_REGS, PRODUCER_REGS = 160, 160, 32
#: named barrier of the output warpgroup's own syncs around O's staging tile (ids below it are TileLang's)
OUTPUT_BARRIER = 12

#: a trace build (``trace=True``) records the SM's cycle counter at these many points of each role's chunk, for the
#: first TRACE_CHUNKS chunks of one CTA (value head 0 of sequence 0; ``benchmarks/rso_trace.py`` reads it): which
#: role's chain, and which of its waits, sets the chunk. The point numbers of each role are in ``TRACE_POINTS_OF``.
TRACE_CHUNKS, TRACE_POINTS = 32, 12
#: what each trace point of each role (state path 0, state path 1, output path, decay warp) marks
_STATE_POINTS = ('chunk begins', 'inputs ready', 'S^T K^T issued', 'S^T buffer free', 'S^T handed over',
                 'S^T K^T done', 'decays ready', 'W^T made', 'Vn^T = W^T Ag^T done', 'Vn^T buffer free',
                 'Vn^T handed over', "S'^T done, stage released")
TRACE_POINTS_OF = (
    _STATE_POINTS,
    _STATE_POINTS,
    ('chunk begins', 'inputs ready', 'S^T ready', 'Q K^T and Q S issued', 'Q K^T done', 'P made', 'Q S done',
     'decays ready', 'O scaled, stage released', 'Vn^T ready', 'O += P Vn done', 'O staged, its store issued'),
    ('chunk begins', 'inputs ready', 'decays made'),
)


@kernel_cache
def build_chunk_forward_rso(
    Hqk: int,
    Hv: int,
    K: int,
    V: int,
    io_dtype: str,
    has_initial_state: bool,
    store_final_state: bool,
    state_v_first: bool,
    regs: tuple = (STATE_REGS, OUTPUT_REGS, PRODUCER_REGS),
    swizzled_v: bool = True,
    lean_output: bool = True,
    lean_state: bool = False,
    trace: bool = False,
):
    """Compile (or load) the loop. Same kernel arguments as ``build_chunk_forward_rs``'s with an output:
    ``q, k, v, gcum, Ag, cu_seqlens, first_slot, h0, scale, o, ht``. ``regs``: setmaxnreg of the state paths, the
    output path and the producer warpgroup (2 x state + output + producer = 512).

    ``swizzled_v`` (default) gives v's ring tiles the 128-byte swizzle (TMA writes them so). The state paths read
    V^T element by element in the accumulator's layout: a warp's lanes read rows 0, 2, 4 and 6 of a column, 256
    bytes apart, all in one bank, a 4-way conflict on each of their 64 loads per thread and chunk (~23% of the
    loop's shared-memory wavefronts at an L1/TEX throughput of ~80%: ``profiles/forward-v0.12-*``). The swizzle puts
    those rows' 16-byte pieces in four different banks. The same values are read, so the same bits out. Measured:
    0.85x-0.98x the loop's time unswizzled, the op 0.85x-0.94x (``stages-hopper-v0.12b.json``). The producer
    warpgroup (32 registers) then keeps two values on the stack, 8 bytes reloaded once per chunk: v's TMA load is
    two 64-column boxes.

    ``lean_output`` (default) trims the element-wise work of the output path, the warpgroup that sets the chunk
    (``docs/hopper-notes.md``, v0.13a-c): its per-row factors scale x gamma_i (O's scaling) and g~_i (P's gating) are
    made once per chunk into two-element register fragments, and g~_j into a fragment of the thread's 16 columns,
    instead of read from shared memory once per element; O goes to its staging tile by stmatrix (8 instructions per
    thread instead of 32 two-element stores); the state paths' exp(g~_last) is taken once per chunk. The same
    products of the same values and the same values stored, so the same bits. Measured: the op 0.94x-0.97x with the
    row factors alone and 0.98x more with the rest on one-wave shapes, within the power cap's drift on full ones
    (``stages-hopper-v0.13b*.json``, ``-v0.13c*.json``). ptxas then keeps 16 bytes of the producer's address
    arithmetic on the stack instead of 8.

    ``lean_state`` (an A/B) does the same for the state paths' column factors gamma_j (W^T) and d_j (Vn^T's decay):
    read once per chunk into fragments of the thread's 16 columns instead of once per element.

    ``trace`` (a diagnostic) adds a last argument ``tr [4, TRACE_CHUNKS, TRACE_POINTS]`` int64 that receives the SM's
    cycle counter at the points of ``TRACE_POINTS_OF``, stamped by one thread of each role in the CTA of value head 0
    and sequence 0 for its first TRACE_CHUNKS chunks; the same outputs as the build without it."""
    import tilelang
    import tilelang.language as T

    state_regs, output_regs, producer_regs = regs
    if 2 * state_regs + output_regs + producer_regs != 512:
        raise ValueError(f"regs must share 512 registers per thread slot, got {regs}")
    C = CHUNK
    group = Hv // Hqk
    HV2 = V // 2  # rows of S^T per state warpgroup
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")
    slot_rows = T.dynamic("slot_rows")
    n_h0 = T.dynamic("n_h0")
    n_ht = T.dynamic("n_ht")
    acc = "float32"
    state_shape_h0 = (n_h0, Hv, V, K) if state_v_first else (n_h0, Hv, K, V)
    state_shape_ht = (n_ht, Hv, V, K) if state_v_first else (n_ht, Hv, K, V)

    parts = make_loop_parts(C, K, V, io_dtype, has_initial_state, store_final_state, state_v_first)

    @T.macro
    def stamp(tr, role, point, c, tx, h, n):
        # trace builds only: the SM's cycle counter at ``point`` of chunk c, by one thread of the role (the first of
        # its warpgroup; the decay warp's first), in the CTA of value head 0 and sequence 0
        if trace:
            if h == 0 and n == 0 and c < TRACE_CHUNKS and tx % (32 if role == 3 else 128) == 0:
                tr[role, c, point] = T.call_extern("int64", "clock64")

    @T.macro
    def state_path(w, n, h, n_chunks, h0, ht, k_s, v_s, gc_s, a_s, gam_s, dec_s, s_s, vn_s,
                   full, empty, d_ready, s_ready, s_free, vn_ready, vn_free, tr, tx):
        c0 = w * HV2
        st_f = T.alloc_fragment((HV2, K), acc)  # S^T rows c0 .. c0 + 63
        sb_f = T.alloc_fragment((HV2, K), io_dtype)
        u_f = T.alloc_fragment((HV2, C), acc)  # W^T, then Vn^T
        ub_f = T.alloc_fragment((HV2, C), io_dtype)
        if lean_output:
            gl = T.alloc_local((1,), acc)  # gamma_C of the chunk
        if lean_state:  # gamma_j and d_j per column of the thread's [64, C] accumulator
            gcol_f = T.alloc_fragment((C,), acc)
            dcol_f = T.alloc_fragment((C,), acc)
        parts.load_state(st_f, h0, n, h, c0)

        for c in T.serial(n_chunks):
            st = c % 2
            stamp(tr, w, 0, c, tx, h, n)
            T.barrier_wait(full[st], (c // 2) % 2)
            stamp(tr, w, 1, c, tx, h, n)
            T.copy(st_f, sb_f)
            # S^T K^T in flight while S^T goes to the output path and gamma_C S^T is formed
            T.wgmma_gemm(sb_f, k_s[st, :, :], u_f, transpose_B=True, clear_accum=True)
            stamp(tr, w, 2, c, tx, h, n)
            T.barrier_wait(s_free[st], (c // 2 + 1) % 2)  # the output path is done with the chunk two back
            stamp(tr, w, 3, c, tx, h, n)
            for i, j in T.Parallel(HV2, K):
                s_s[st, c0 + i, j] = sb_f[i, j]
            T.fence_proxy_async()
            T.barrier_arrive(s_ready[st])
            stamp(tr, w, 4, c, tx, h, n)
            if lean_output:
                parts.decay_state_once(st_f, gc_s, st, gl)
            else:
                for i, j in T.Parallel(HV2, K):
                    st_f[i, j] = st_f[i, j] * T.exp2(gc_s[st, C - 1] * LOG2E)
            T.wait_wgmma(0)
            stamp(tr, w, 5, c, tx, h, n)
            # W^T = V^T - (S^T K^T) diag(gamma)
            T.barrier_wait(d_ready[st], (c // 2) % 2)
            stamp(tr, w, 6, c, tx, h, n)
            if lean_state:  # gamma_j and d_j of the thread's columns, once per chunk
                parts.column_factors(gam_s, dec_s, gcol_f, dcol_f, st)
                for i, j in T.Parallel(HV2, C):
                    u_f[i, j] = v_s[st, j, c0 + i] - u_f[i, j] * gcol_f[j]
            else:
                for i, j in T.Parallel(HV2, C):
                    u_f[i, j] = v_s[st, j, c0 + i] - u_f[i, j] * gam_s[st, j]
            T.copy(u_f, ub_f)
            stamp(tr, w, 7, c, tx, h, n)
            # Vn^T = W^T Ag^T
            T.gemm(ub_f, a_s[st, :, :], u_f, transpose_B=True, clear_accum=True)
            stamp(tr, w, 8, c, tx, h, n)
            T.copy(u_f, ub_f)
            T.barrier_wait(vn_free, (c + 1) % 2)
            stamp(tr, w, 9, c, tx, h, n)
            for i, j in T.Parallel(HV2, C):
                vn_s[c0 + i, j] = ub_f[i, j]
            T.fence_proxy_async()
            T.barrier_arrive(vn_ready)
            stamp(tr, w, 10, c, tx, h, n)
            # S'^T = gamma_C S^T + (Vn^T diag(exp(g~_last - g~))) K ; rows past the end have Vn = 0
            parts.decay_columns(u_f, dcol_f if lean_state else None, dec_s, st, lean_state)
            T.copy(u_f, ub_f)
            T.gemm(ub_f, k_s[st, :, :], st_f)
            T.barrier_arrive(empty[st])
            stamp(tr, w, 11, c, tx, h, n)

        parts.store_state(st_f, ht, n, h, c0)

    @T.macro
    def output_path(n, h, bos, eos, n_chunks, o, scale, q_s, k_s, gc_s, gam_s, s_s, vn_s, o_s,
                    full, empty, d_ready, s_ready, s_free, vn_ready, vn_free, tr, tx):
        p_f = T.alloc_fragment((C, C), acc)
        pb_f = T.alloc_fragment((C, C), io_dtype)
        o_f = T.alloc_fragment((C, V), acc)
        if lean_output:  # per row of P and of O: g~_i, scale x gamma_i; per column of P: g~_j
            gr_f = T.alloc_fragment((C,), acc)
            sg_f = T.alloc_fragment((C,), acc)
            gcol_f = T.alloc_fragment((C,), acc)
        for c in T.serial(n_chunks):
            st = c % 2
            t0 = bos + c * C
            n_rows = T.min(eos - t0, C)
            stamp(tr, 2, 0, c, tx, h, n)
            T.barrier_wait(full[st], (c // 2) % 2)
            stamp(tr, 2, 1, c, tx, h, n)
            # Q K^T and O = Q S issued together (S^T is handed over at the start of the state chain's chunk, long
            # before this path gets to it); P = scale Gam ⊙ Q K^T (lower with the diagonal, kept in registers as the
            # A operand of P Vn) is made while Q S runs. S^T is the B operand: [V, K], K contiguous.
            T.barrier_wait(s_ready[st], (c // 2) % 2)
            stamp(tr, 2, 2, c, tx, h, n)
            T.wgmma_gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(q_s[st, :, :], s_s[st, :, :], o_f, transpose_B=True, clear_accum=True)
            stamp(tr, 2, 3, c, tx, h, n)
            T.wait_wgmma(1)
            stamp(tr, 2, 4, c, tx, h, n)
            if lean_output:
                for i in T.Parallel(C):
                    gr_f[i] = gc_s[st, i]
                for j in T.Parallel(C):
                    gcol_f[j] = gc_s[st, j]
                for i, j in T.Parallel(C, C):
                    p_f[i, j] = T.if_then_else(
                        i >= j, p_f[i, j] * scale * T.exp2((gr_f[i] - gcol_f[j]) * LOG2E), 0.0)
            else:
                parts.gate_qk(gc_s, p_f, st, scale)
            T.copy(p_f, pb_f)
            stamp(tr, 2, 5, c, tx, h, n)
            T.wait_wgmma(0)
            stamp(tr, 2, 6, c, tx, h, n)
            T.barrier_arrive(s_free[st])
            T.barrier_wait(d_ready[st], (c // 2) % 2)
            stamp(tr, 2, 7, c, tx, h, n)
            if lean_output:
                for i in T.Parallel(C):
                    sg_f[i] = scale * gam_s[st, i]
                for i, j in T.Parallel(C, V):
                    o_f[i, j] = o_f[i, j] * sg_f[i]
            else:
                for i, j in T.Parallel(C, V):
                    o_f[i, j] = o_f[i, j] * (scale * gam_s[st, i])
            # done with this ring stage (q, k, g~, gamma): released before the wait for Vn
            T.barrier_arrive(empty[st])
            stamp(tr, 2, 8, c, tx, h, n)
            # O += P Vn  (Vn^T as the B operand: [V, C], C contiguous)
            T.barrier_wait(vn_ready, c % 2)
            stamp(tr, 2, 9, c, tx, h, n)
            T.gemm(pb_f, vn_s, o_f, transpose_B=True)
            T.barrier_arrive(vn_free)
            stamp(tr, 2, 10, c, tx, h, n)
            # the previous chunk's TMA store must have read o_s; it had this whole chunk to do so. The thread that
            # issued it waits: shuffle_elect(128) elects the same one as the store's (and, unlike a test of tx,
            # keeps the warp converged for its elect.sync)
            if T.shuffle_elect(128):
                T.tma_store_wait(0)
            T.sync_threads(OUTPUT_BARRIER, 128)
            if lean_output:
                T.copy(o_f, o_s)
            else:
                for i, j in T.Parallel(C, V):
                    o_s[i, j] = o_f[i, j]
            T.fence_proxy_async()
            T.sync_threads(OUTPUT_BARRIER, 128)
            if n_rows == C:
                T.tma_copy(o_s, o[0, t0:t0 + C, h, 0:V])  # not waited for here
            else:
                for i, j in T.Parallel(C, V):
                    if i < n_rows:
                        o[0, t0 + i, h, j] = o_s[i, j]
            stamp(tr, 2, 11, c, tx, h, n)
        if T.shuffle_elect(128):
            T.tma_store_wait(0)

    producer = make_ring_producer(C, K, V, io_dtype, first_warp=384, load_q=True)

    @T.macro
    def rso_body(q, k, v, gcum, Ag, cu_seqlens, first_slot, h0, scale, o, ht, tr):
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
            gam_s = T.alloc_shared((2, C), acc)  # per ring stage, from the decay warp
            dec_s = T.alloc_shared((2, C), acc)
            # state paths -> output path
            s_s = T.alloc_shared((2, V, K), io_dtype)  # S^T, one per ring stage
            vn_s = T.alloc_shared((V, C), io_dtype)  # Vn^T
            o_s = T.alloc_shared((C, V), io_dtype)  # O, for the TMA store

            full = T.alloc_barrier(arrive_count=[96] * 2)  # producer warps 0..2 -> consumers
            empty = T.alloc_barrier(arrive_count=[384] * 2)  # state and output paths -> producer
            d_ready = T.alloc_barrier(arrive_count=[32] * 2)  # decay warp -> state and output paths
            s_ready = T.alloc_barrier(arrive_count=[256] * 2)
            s_free = T.alloc_barrier(arrive_count=[128] * 2)
            vn_ready = T.alloc_barrier(arrive_count=256)
            vn_free = T.alloc_barrier(arrive_count=128)

            if swizzled_v:
                T.annotate_layout({v_s: tilelang.layout.make_swizzled_layout(v_s)})

            tx = T.get_thread_binding()

            if tx < 128:
                T.set_max_nreg(state_regs, 1)
                state_path(0, n, h, n_chunks, h0, ht, k_s, v_s, gc_s, a_s, gam_s, dec_s, s_s, vn_s,
                           full, empty, d_ready, s_ready, s_free, vn_ready, vn_free, tr, tx)
            elif tx < 256:
                T.set_max_nreg(state_regs, 1)
                state_path(1, n, h, n_chunks, h0, ht, k_s, v_s, gc_s, a_s, gam_s, dec_s, s_s, vn_s,
                           full, empty, d_ready, s_ready, s_free, vn_ready, vn_free, tr, tx)
            elif tx < 384:
                T.set_max_nreg(output_regs, 1 if output_regs > 128 else 0)  # 128 at launch (512 threads)
                output_path(n, h, bos, eos, n_chunks, o, scale, q_s, k_s, gc_s, gam_s, s_s, vn_s, o_s,
                            full, empty, d_ready, s_ready, s_free, vn_ready, vn_free, tr, tx)
                parts.zero_tail(o, n, h, eos, num_seqs, num_tokens)  # padded tail after the last sequence
            else:
                T.set_max_nreg(producer_regs, 0)
                if tx < 480:
                    producer(tx, n, h, hq, bos, eos, n_chunks, q, k, v, gcum, Ag, first_slot, q_s, k_s, v_s, a_s,
                             gc_s, full, empty)
                else:  # the decays of each ring stage, once its g~ has arrived
                    for c in T.serial(n_chunks):
                        st = c % 2
                        stamp(tr, 3, 0, c, tx, h, n)
                        T.barrier_wait(full[st], (c // 2) % 2)
                        stamp(tr, 3, 1, c, tx, h, n)
                        parts.gate_decays(gc_s, gam_s, dec_s, st)
                        T.barrier_arrive(d_ready[st])
                        stamp(tr, 3, 2, c, tx, h, n)


    # a prim_func's parameters are its source's: the trace build's extra argument needs a signature of its own
    if trace:
        @T.prim_func
        def chunk_forward_rso_kernel(
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
            tr: T.Tensor((4, TRACE_CHUNKS, TRACE_POINTS), "int64"),
        ):
            rso_body(q, k, v, gcum, Ag, cu_seqlens, first_slot, h0, scale, o, ht, tr)
    else:
        @T.prim_func
        def chunk_forward_rso_kernel(
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
            rso_body(q, k, v, gcum, Ag, cu_seqlens, first_slot, h0, scale, o, ht, None)

    return tilelang.compile(
        chunk_forward_rso_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs()
    )
