"""Stage 2 of the Hopper forward, warp-specialised with the state transposed in registers ("rs" chunk loop).

Same math as ``chunk_forward.py`` (DESIGN.md §2), written for the transposed state S^T [V, K], so that every
GEMM on the state's chain takes its left operand from registers (wgmma with a register A operand) and its right
operand straight from the TMA-filled input tiles:

    W^T   = V^T - (S^T K^T) diag(gamma)                    S^T K^T      : A = S^T (regs),  B = K   (tile)
    O^T   = scale (S^T Q^T) diag(gamma)                    S^T Q^T      : A = S^T (regs),  B = Q   (tile)
    Vn^T  = W^T Ag^T                                       W^T Ag^T     : A = W^T (regs),  B = Ag  (tile)
    O^T  += Vn^T P^T,    P = scale Gam ⊙ Q K^T             Vn^T P^T     : A = Vn^T (regs), B = P   (shared)
    S'^T  = gamma_C S^T + (Vn^T diag(exp(g~_last - g~))) K                : A = regs,        B = K   (tile)

No intermediate (W, Vn, S) makes a round trip through shared memory: the accumulator of one GEMM, rounded to
bf16, is the next GEMM's register operand (the accumulator and operand layouts of wgmma agree per thread, the
observation FlashAttention-3 builds on). Ag and g~ come from stage 1 (``kkt_inverse``).

PyTorch counterparts: ``flashgdn.reference.chunked.new_values``, ``chunk_states``, ``chunk_outputs``.

Roles (one CTA = one sequence x one value head, 512 threads):

* warpgroups 0 and 1, the **state paths**: each owns 64 rows of S^T (64 of the V columns of S) in registers and
  runs the whole chunk for them, output included (O^T is transposed into shared memory and leaves by one TMA
  store per chunk); the two are independent, so one's elementwise work overlaps the other's tensor-core work.
* warpgroup 2, the **gate path**: one chunk ahead, P = scale Gam ⊙ Q K^T (masked) and the per-token factors
  gamma_j = exp(g~_j) and exp(g~_last - g~_j), into shared memory.
* warpgroup 3, the **producer**: TMA loads of q, k, v, Ag and g~ into a two-stage ring. Ag and g~ are stage 1's
  per-chunk-slot tiles (zero / flat past a sequence's end), always one TMA box each; q, k and v of the last,
  partial chunk of a sequence are loaded by masked plain loads, so rows of the next sequence never enter.

Hand-offs are three mbarrier pairs: full (producer -> all), p_ready (gate -> state), empty (all -> producer);
with ``decayed_k`` a fourth, a_ready (gate -> state: gamma and Ag, before P and Kd).
"""
from typing import Optional

from ...cp.bounds import NEGLIGIBLE_LOG_NORM, SEGMENT_SUM_ABS, SEGMENT_SUM_REL
from .common import CHUNK, LOG2E, TARGET, kernel_cache, pass_configs
from .gate_inverse import make_gate_inverse
from .warp_bounds import warp_lse_macros
from .loop_parts import make_loop_parts
from .ring_producer import make_ring_producer

# Registers per thread of each warpgroup after setmaxnreg (2 x state + gate + producer = 512, the whole register
# file at 512 threads). ptxas ignores every setmaxnreg when a role's code needs more than its share, and
# serialises wgmma when a state path keeps too much live across one in flight (why the GEMMs here wait).
STATE_REGS, GATE_REGS, PRODUCER_REGS = 192, 72, 56
#: the precise mode keeps two more bf16 operand halves live on the state path; its state-only passes, which split
#: in three, one more (and have no output to make: a lighter gate role)
PRECISE_REGS = (200, 72, 40)
PRECISE_STATE_ONLY_REGS = (208, 64, 32)
#: the gate warpgroup holds a column of the inverse's diagonal block (32 values) when stage 1 is in the loop
INVERSE_IN_LOOP_REGS = (192, 96, 32)
#: the "fused" loop's trace build (``trace=True``, ``benchmarks/fused_trace.py``) records the SM's cycle counter at
#: these points of each role's chunk (state path 0, state path 1, gate path), for the first TRACE_CHUNKS chunks of
#: the CTA of value head 0 and sequence 0; the gate's inverse phases (points 3-6) only with ``register_inverse``
TRACE_CHUNKS = 32
_STATE_POINTS = ("chunk begins", "inputs ready", "gamma and Ag ready", "P and Kd ready", "stage released")
TRACE_POINTS_OF = (
    _STATE_POINTS,
    _STATE_POINTS,
    ("chunk begins", "inputs ready", "g~ made", "K K^T stored", "16x16 blocks made", "16 -> 32 merged",
     "32 -> 64 merged", "Ag and gamma handed over", "P made", "Kd made, stage released"),
)
TRACE_POINTS = max(len(p) for p in TRACE_POINTS_OF)


@kernel_cache
def build_chunk_forward_rs(
    Hqk: int,
    Hv: int,
    K: int,
    V: int,
    io_dtype: str,
    has_initial_state: bool,
    store_final_state: bool,
    state_v_first: bool,
    with_output: bool = True,
    precise: bool = False,
    store_chunk_states: bool = False,
    transition_pairs: bool = False,
    staged_stores: bool = False,
    decayed_k: bool = False,
    inverse_in_loop: bool = False,
    register_inverse: bool = False,
    state_p: bool = False,
    skip_unread: str = "",
    swizzled_v: Optional[bool] = None,
    lean: bool = False,
    starts_from_h0: bool = False,
    first_apart: bool = False,
    negligible_m: bool = False,
    late_b: bool = False,
    chunk_bounds: bool = False,
    chunk_late_b: bool = False,
    trace: bool = False,
):
    """Compile (or load) the register-operand chunk loop. Same arguments as ``build_chunk_forward``'s kernel.

    ``with_output=False`` is the state-only pass (context parallelism's b and M passes): no q, no P, no O; the
    ``o`` argument is then not touched and may be any ``[1, *, Hv, V]`` tensor.

    ``precise=True`` gives every register operand (S^T, W^T, Vn^T) as a bf16 hi + lo pair, two wgmma per GEMM on
    the state path: the state's error no longer depends on their rounding, only on the tiles' (Ag, P), so runs
    with and without context parallelism agree to ~1e-5 instead of ~4e-3 (``benchmarks/numerics_study.py``).
    A state-only pass (``with_output=False``: CP's transitions, the backward's states pass) splits them in three,
    hi + mid + lo (a float32's 24 bits), three wgmma per GEMM: with two, the last bits of the state still set the
    backward's CP agreement at g = 0 to ~1.5e-3 (``benchmarks/numerics_backward.py --precise``).
    bfloat16 only: with float16 operands it spills at this register budget.

    ``store_chunk_states=True`` (state-only, no final state) is the backward's recompute of the forward states:
    ``ht`` is then ``[S, Hv, V, K]`` and receives S^T at the start of every chunk slot (V-major), in the io dtype:
    the rounding this loop's own GEMMs read it with, at half float32's memory. ``staged_stores=True`` writes each
    state warpgroup's 64 rows to shared memory and sends them with one TMA store per chunk (as O leaves), instead
    of element-wise stores from the registers (an A/B: ``backward.STAGED_STATE_STORES``). With ``precise`` the stored
    S^T is the bf16 rounding of a state that no longer depends on the register operands' rounding, so it is the same
    bits with and without context parallelism but where the two float32 states straddle a rounding boundary.

    ``transition_pairs=True`` (state-only, initial and final state, K-major) is context parallelism's transition
    pass with stage 1 shared: 2 Hv CTAs per sequence, head 2h running value head h from ``h0[:, 2h]`` (b) and head
    2h + 1 running it with v = 0 from ``h0[:, 2h + 1]`` (the identity: M), both reading value head h's Ag, g~, v;
    ``h0`` and ``ht`` are ``[n, 2 Hv, K, V]``, the other tensors as without it.

    ``skip_unread="forward"`` or ``"backward"`` (with ``transition_pairs``) adds three last arguments, the segments'
    index tensors ``seg_seq [segments]``, ``first [sequences]`` and ``count [sequences]`` (int64,
    ``flashgdn.cp.SegmentIndex``), and walks no chunk for the items that context parallelism's splices never read
    (docs/context-parallel.md): b of a sequence's last segment, M of its first, and with ``"forward"`` M of its last.
    ``"m_only"``: every b as well (the backward whose segments start from the forward's segment starts, gathered:
    it reads only M, in its reverse splice). Such a CTA stores its start state as its end state.

    ``starts_from_h0=True`` (with ``skip_unread``) makes the transition pass's start states in the kernel instead of
    reading them: ``h0`` is then the sequences' initial states ``[sequences, Hv, K, V]``, and head 2h of segment n
    starts from ``h0[seq_seq[n], h]`` where n is its sequence's first segment and from zero elsewhere, head 2h + 1
    from the identity. This spares the host's [S, 2 Hv, K, V] start tensor: four small kernels (two fills, a scatter
    of h0, the identity's copy) and its reads, per pass.

    ``negligible_m=True`` (with ``starts_from_h0``) adds a last argument ``m_bound [segments, Hv]`` float32, the log
    of a bound on each segment's ||M||_2 (``flashgdn.cp.bounds.transition_log_bounds``): an M item whose bound is
    below ``NEGLIGIBLE_LOG_NORM`` walks no chunk and stores zero, the float32 value of an M that small (an A/B,
    ``backend.CP_NEGLIGIBLE_M``). The other items, and every item of a build without it, are unchanged.

    ``chunk_bounds=True`` (with ``negligible_m``, not with ``late_b``) takes, instead of ``m_bound``, a last argument
    ``chunk_bound [Hv, S]`` float32, stage 1's per-chunk bound (``kkt_inverse``'s ``chunk_bounds``), and makes each
    M item's bound in the kernel: the first warp sums the segment's chunks (lane j chunks j, j + 32, ...), the CTA
    the 32 partial sums in one order on every thread, so all take the same decision, and the sum is rounded up by
    ``(chunks + 64) x 2^-23`` of the sum of magnitudes and one more nat before the comparison (PyTorch counterpart:
    ``flashgdn.cp.bounds.segment_log_bounds``). No pass over k or PyTorch op is left between stage 1 and this pass
    (an A/B, ``backend.CP_NEGLIGIBLE_M_IN_KERNEL``). A second last argument ``m_zero [segments, Hv]`` int32 is written
    by every M item: 1 where it stored zero that way, else 0, so the splice can leave that M's product out
    (``splice.py``'s ``m_zero`` builds).

    ``late_b=True`` (with ``negligible_m``) adds a last argument ``b_start [segments, Hv]`` int32
    (``flashgdn.cp.bounds.b_start_chunks``): the b item of segment n and value head h leaves out the segment's first
    ``b_start[n, h]`` chunks and walks the rest from zero (from h0 only where it leaves out none), the tokens left out
    owing b less than float32's smallest normal number (an A/B, ``backend.CP_LATE_B``). Its chunks are those of the
    build without it from that chunk on: the same tiles, slots and arithmetic.

    ``chunk_late_b=True`` (with ``chunk_bounds``, not with ``late_b``) starts b late as ``late_b`` does, from a count
    made here instead of read: two more last arguments, stage 1's ``chunk_inject [Hv, S]`` (``kkt_inverse``'s
    ``chunk_injects``) and ``h0_log_norm [sequences, Hv]`` float32 (log of each initial state's Frobenius norm, -inf
    for none). A b item sums its segment's chunk bounds as an M item does (the same rounding margin), then its first
    warp takes its chunks 32 at a time, a lane each: the running log-sum-exp of ``chunk_inject - (the chunk bounds
    so far)`` by shuffle scans (with the h0 term on a sequence's first segment), and the count of leading chunks while
    that bound on what they owe b, plus the margin, stays below ``NEGLIGIBLE_LOG_NORM`` (PyTorch counterpart:
    ``flashgdn.cp.bounds.segment_b_starts``). No pass over v or PyTorch op sits between stage 1 and this pass (an A/B,
    notes v0.36f, v0.36h).

    ``decayed_k=True`` (not with ``precise``) moves the decay of the state update from Vn to K: the gate warpgroup
    writes Kd = diag(exp(g~_last - g~)) K (bf16) one chunk ahead, beside P, so that Vn^T is converted once and is
    the register operand of both O^T += Vn^T P^T and S'^T += Vn^T Kd. GEMMs that read the same ready operands are
    then issued together and waited on once: S^T K^T with S^T Q^T, and Vn^T P^T with Vn^T Kd (three waits per chunk
    instead of five, one element-wise pass and one conversion fewer on the chain). gamma_C S^T is scaled while
    S^T K^T and S^T Q^T run. The rounding moves from Vn^T diag(d) to diag(d) K: other bits, the same error.
    The gate warpgroup signals gamma (and, with ``inverse_in_loop``, Ag) on a barrier of their own, a_ready, before
    it makes P and Kd, so that the state paths' W^T and Vn^T wait on those alone. Measured: 1.06x-1.26x rs's time
    with an output, the state-only pass within 1-4% of rs's (``stages-hopper-v0.10a/b/d.json``); not the default.
    32 KB more shared memory (Kd's two ring stages).

    ``inverse_in_loop=True`` (with ``decayed_k``, an output, no precise mode; loop "fused") takes stage 1 into the
    loop: the gate warpgroup makes g~ and Ag of each chunk itself, one chunk ahead, into the ring stage's tiles
    (``gate_inverse.py``), from g and beta rows that the producer's third warp loads beside q, k, v. The kernel's
    arguments are then ``q, k, v, g [1, T, Hv], beta [1, T, Hv] (float32), cu_seqlens, h0, scale, o, ht``: no chunk
    plan, no ``kkt_inverse`` launch, no Ag or g~ round trip through HBM. Registers 192/96/32.
    ``register_inverse=True`` (with ``inverse_in_loop``; an A/B, ``forward.FUSED_REGISTER_INVERSE``) makes that inverse
    by stage 1's register-level pieces (``gate_inverse``'s ``registers``) instead of the 16-row substitution.
    ``state_p=True`` (with ``inverse_in_loop``, instead of ``decayed_k``; an A/B, ``forward.FUSED_STATE_P``) takes P
    and Kd off the gate warpgroup, whose chunk is the fused loop's (notes "v0.39a traced": P 3600-4700 and Kd ~900 of
    its ~10700 cycles, while the state paths wait for Ag): each state path makes Q K^T's columns w 32 .. w 32 + 31
    (issued while the gate still makes Ag), gates them once g~ is there and stores them into P's tile, and the two
    meet on p_ready (256 arrivals) before O^T += Vn^T P^T. The update's decay goes back on Vn^T (rs's order, no Kd
    tile: 32 KB less shared memory), its bf16 copy made while O^T's GEMM runs so both GEMMs are waited on once.
    Its gate makes g~ by a shuffle scan on one warp (``gate_inverse``'s ``chunk_cumsum_scan``; ~700 cycles by one
    thread a row in "v0.39a traced"). Registers 192/96/32, as without it: ptxas keeps 4 bytes of spills there, every
    other split tried spills more. Measured: the loop 0.86x-0.92x the fused loop's time without it, but its gate's
    inverse 1.55x slower while the state paths work beside it, so the chunk fell by about the work removed, not by
    what left the gate's path (notes "v0.41a measured").
    ``trace`` (a diagnostic, with ``inverse_in_loop``) adds a last argument ``tr [3, TRACE_CHUNKS, TRACE_POINTS]``
    int64: the SM's cycle counter at ``TRACE_POINTS_OF``'s points of each role's chunk, by the role's first thread,
    in the CTA of value head 0 and sequence 0 (``benchmarks/fused_trace.py``). The same outputs as the build without
    it.

    ``first_apart=True`` (with ``store_chunk_states``) keeps every sequence's first chunk state out of ``ht``, for
    the fused backward (``fused_backward.py``, its option of the same name): two last arguments, ``first_states
    [N, Hv, 2 V, K]`` in the io dtype, whose rows 0..V-1 of [n, h] take sequence n's first S^T (the initial state's
    rounding, or zero), and ``shift`` (int32, 0 or 1): chunk c >= 1 of sequence n goes to ``ht[first_slot[n] + c -
    shift (n + 1)]``, so with shift 1 (no sequence empty) ``ht`` needs S - N rows, with 0 it keeps S and leaves the
    first slots unwritten. ``first_states`` is the fused kernel's d(initial state) buffer ``[N, Hv, K, V]`` float32
    seen as 2-byte values: the fused kernel reads sequence n's first S^T there in its last chunk step, before it
    writes that sequence's gradient over it, so the first states take no memory of their own (one [Hv, V, K] tile
    per sequence off the backward's peak).

    ``swizzled_v``: v's ring tiles in the 128-byte swizzle, so that the state paths' element-wise reads of V^T are
    free of bank conflicts (``chunk_forward_rso.py``'s ``swizzled_v``); the same bits. Measured on the state-only
    pass (context parallelism's transitions, the backward's states pass): 0.72x-0.82x its unswizzled time
    (``stages-hopper-v0.12b.json``). The default (None) swizzles every build but the precise mode's with an
    output and the "fused" A/B (``inverse_in_loop``), where ptxas then spills 12 and 16 bytes (neither is a
    default path: the forward runs rso, the precise mode is opt-in).
    ``lean`` (an A/B, ``forward.LEAN_STATE_PASSES``; not with ``decayed_k``): the state paths read gamma_j and d_j once per chunk
    into fragments of the thread's 16 columns, and exp(g~_last) once, instead of once per element, as the rso loop's
    trimmed paths do (``chunk_forward_rso.py``); O^T's scale x gamma_j too. The same products, so the same bits.
    """
    import tilelang
    import tilelang.language as T

    if swizzled_v is None:
        swizzled_v = not ((precise and with_output) or inverse_in_loop)
    C = CHUNK
    group = Hv // Hqk
    HV2 = V // 2  # rows of S^T per state warpgroup
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")
    slot_rows = T.dynamic("slot_rows")
    n_h0 = T.dynamic("n_h0")
    n_ht = T.dynamic("n_ht")
    o_tokens = num_tokens if with_output else T.dynamic("o_tokens")
    acc = "float32"
    _, lse_scan, lse_merge = warp_lse_macros()
    state_regs, gate_regs, producer_regs = ((PRECISE_REGS if with_output else PRECISE_STATE_ONLY_REGS) if precise
                                            else INVERSE_IN_LOOP_REGS if inverse_in_loop
                                            else (STATE_REGS, GATE_REGS, PRODUCER_REGS))
    # state-only passes in the precise mode split their register operands in three (hi + mid + lo, 24 bits): what
    # the backward's exact CP at g = 0 needs (docs/context-parallel.md); the loop with an output keeps two
    third = precise and not with_output
    state_shape_h0 = (n_h0, Hv, V, K) if state_v_first else (n_h0, Hv, K, V)
    state_shape_ht = (n_ht, Hv, V, K) if state_v_first else (n_ht, Hv, K, V)
    heads = Hv  # CTAs per sequence, and heads of h0 / ht
    if transition_pairs:
        if with_output or not (has_initial_state and store_final_state) or state_v_first or store_chunk_states:
            raise ValueError("transition_pairs is a state-only pass from K-major initial to final states")
        heads = 2 * Hv
        state_shape_h0 = (n_h0, heads, K, V)
        state_shape_ht = (n_ht, heads, K, V)
    if skip_unread not in ("", "forward", "backward", "m_only") or skip_unread and not transition_pairs:
        raise ValueError(f"skip_unread must be '', 'forward', 'backward' or 'm_only' (with transition_pairs), "
                         f"got {skip_unread!r}")
    skipping, forward_skips = skip_unread != "", skip_unread == "forward"
    if starts_from_h0:
        if not skipping:
            raise ValueError("starts_from_h0 is an option of the transition pass with skip_unread (its segment index)")
        state_shape_h0 = (n_h0, Hv, K, V)
    if negligible_m and not starts_from_h0:
        raise ValueError("negligible_m is an option of the transition pass that makes its start states (starts_from_h0)")
    if chunk_bounds and (late_b or not negligible_m):
        raise ValueError("chunk_bounds is a source of negligible_m's bound, without late_b")
    if chunk_late_b and (late_b or not chunk_bounds):
        raise ValueError("chunk_late_b makes late_b's count from chunk_bounds' terms: with chunk_bounds, not late_b")
    if late_b and not negligible_m:
        raise ValueError("late_b is built beside negligible_m (the transition pass that takes the bounds)")
    if inverse_in_loop and not ((decayed_k or state_p) and with_output) or inverse_in_loop and (
            store_chunk_states or transition_pairs):
        raise ValueError("inverse_in_loop is a mode of the decayed_k (or state_p) loop with an output")
    if trace and not inverse_in_loop:
        raise ValueError("trace stamps the fused loop's roles (inverse_in_loop)")
    if state_p and (decayed_k or not inverse_in_loop):
        raise ValueError("state_p is a form of the fused loop (inverse_in_loop) with the update's decay on Vn^T, "
                         "not decayed_k")
    if register_inverse and not inverse_in_loop:
        raise ValueError("register_inverse is a way of making inverse_in_loop's inverse: it needs inverse_in_loop")
    if decayed_k and precise:
        raise ValueError("decayed_k has no precise mode (its Kd tile is one more bf16 rounding of the state's update)")
    if lean and decayed_k:
        raise ValueError("lean is an option of the loop without decayed_k")
    if staged_stores and not store_chunk_states:
        raise ValueError("staged_stores is an option of store_chunk_states")
    if store_chunk_states:
        if with_output or store_final_state:
            raise ValueError("store_chunk_states is a state-only pass without a final state")
        state_shape_ht = (n_ht, Hv, V, K)  # one S^T per chunk slot
    if first_apart and not store_chunk_states:
        raise ValueError("first_apart is an option of store_chunk_states")
    # chunk states are stored as the GEMMs here and in the backward read them: rounded to the io dtype
    ht_dtype = io_dtype if store_chunk_states else "float32"
    # the gate signals gamma (and the fused loop's Ag) on a barrier of their own, before P: W^T waits on them alone
    early_a = decayed_k or state_p
    HC = C // 2  # P's columns each state path makes with state_p

    parts = make_loop_parts(C, K, V, io_dtype, has_initial_state, store_final_state, state_v_first)

    @T.macro
    def stamp(tr, role, point, c, h, n):
        # trace builds only: the SM's cycle counter at ``point`` of chunk c, by the role's first thread
        if trace:
            if h == 0 and n == 0 and c < TRACE_CHUNKS and T.get_thread_binding() % 128 == 0:
                tr[role, c, point] = T.call_extern("int64", "clock64")

    @T.macro
    def state_path(w, n, h, bos, eos, n_chunks, h0, ht, o, scale, q_s, k_s, v_s, gc_s, a_s, p_s, gam_s, dec_s,
                   o_s, full, empty, p_ready, first_slot, kd_s, a_ready, seq=None, is_first=None, first_states=None,
                   shift=None, m_gone=None, tr=None):
        c0 = w * HV2
        st_f = T.alloc_fragment((HV2, K), acc)  # S^T rows c0 .. c0 + 63
        sb_f = T.alloc_fragment((HV2, K), io_dtype)
        if staged_stores:  # this warpgroup's S^T rows, for the TMA store
            hs_s = T.alloc_shared((HV2, K), io_dtype)
        u_f = T.alloc_fragment((HV2, C), acc)  # W^T, then Vn^T
        ub_f = T.alloc_fragment((HV2, C), io_dtype)
        if precise:
            lb_f = T.alloc_fragment((HV2, C), io_dtype)  # second terms of W^T and Vn^T (then Vn^T's third)
        if third:
            xb_f = T.alloc_fragment((HV2, C), io_dtype)  # W^T's third term (its GEMM overwrites W^T)
        if with_output:
            o_f = T.alloc_fragment((HV2, C), acc)  # O^T
        if state_p:  # this path's half of P's columns, then Vn^T diag(d)'s bf16 copy (ub_f is in flight then)
            ph_f = T.alloc_fragment((C, HC), acc)
            vd_f = T.alloc_fragment((HV2, C), io_dtype)
        if lean:  # gamma_j and d_j per column of the thread's [64, C] accumulators, gamma_C
            gcol_f = T.alloc_fragment((C,), acc)
            dcol_f = T.alloc_fragment((C,), acc)
            gl = T.alloc_local((1,), acc)
        if starts_from_h0:
            if h % 2 == 1:  # M's pass: from the identity (st_f is S^T: S[j, c0 + i]); zero where negligible
                if negligible_m:
                    for i, j in T.Parallel(HV2, K):
                        st_f[i, j] = T.if_then_else(m_gone, T.float32(0),
                                                    T.if_then_else(c0 + i == j, T.float32(1), T.float32(0)))
                else:
                    for i, j in T.Parallel(HV2, K):
                        st_f[i, j] = T.if_then_else(c0 + i == j, T.float32(1), T.float32(0))
            elif is_first:  # b's pass on a sequence's first segment: from the sequence's initial state
                for i, j in T.Parallel(HV2, K):
                    st_f[i, j] = h0[seq, h // 2, j, c0 + i]
            else:
                T.clear(st_f)
        else:
            parts.load_state(st_f, h0, n, h, c0)

        for c in T.serial(n_chunks):
            st = c % 2
            t0 = bos + c * C
            n_rows = T.min(eos - t0, C)
            if store_chunk_states:
                if first_apart:
                    if staged_stores:
                        for i, j in T.Parallel(HV2, K):
                            hs_s[i, j] = T.cast(st_f[i, j], io_dtype)
                        T.fence_proxy_async()
                        if c == 0:
                            T.copy(hs_s, first_states[n, h, c0:c0 + HV2, :])
                        else:
                            T.copy(hs_s, ht[first_slot[n] + c - shift * (n + 1), h, c0:c0 + HV2, :])
                    else:
                        if c == 0:
                            for i, j in T.Parallel(HV2, K):
                                first_states[n, h, c0 + i, j] = T.cast(st_f[i, j], io_dtype)
                        else:
                            for i, j in T.Parallel(HV2, K):
                                ht[first_slot[n] + c - shift * (n + 1), h, c0 + i, j] = T.cast(st_f[i, j], io_dtype)
                elif staged_stores:
                    for i, j in T.Parallel(HV2, K):
                        hs_s[i, j] = T.cast(st_f[i, j], io_dtype)
                    T.fence_proxy_async()
                    T.copy(hs_s, ht[first_slot[n] + c, h, c0:c0 + HV2, :])
                else:
                    for i, j in T.Parallel(HV2, K):
                        ht[first_slot[n] + c, h, c0 + i, j] = T.cast(st_f[i, j], io_dtype)
            stamp(tr, w, 0, c, h, n)
            T.barrier_wait(full[st], (c // 2) % 2)
            stamp(tr, w, 1, c, h, n)
            T.copy(st_f, sb_f)
            # S^T K^T and S^T Q^T, register A operand
            if early_a:  # both in flight at once, gamma_C S^T meanwhile (S^T itself is not an operand)
                T.wgmma_gemm(sb_f, k_s[st, :, :], u_f, transpose_B=True, clear_accum=True)
                if with_output:
                    T.wgmma_gemm(sb_f, q_s[st, :, :], o_f, transpose_B=True, clear_accum=True)
                if not inverse_in_loop:  # g~ came with the tiles
                    for i, j in T.Parallel(HV2, K):
                        st_f[i, j] = st_f[i, j] * T.exp2(gc_s[st, C - 1] * LOG2E)
                T.wait_wgmma(0)
                if state_p:  # Q K^T's columns w HC .. w HC + HC - 1, in flight while the gate makes Ag
                    T.wgmma_gemm(q_s[st, :, :], k_s[st, w * HC:w * HC + HC, :], ph_f, transpose_B=True,
                                 clear_accum=True)
            else:
                T.gemm(sb_f, k_s[st, :, :], u_f, transpose_B=True, clear_accum=True)
                if with_output:
                    T.gemm(sb_f, q_s[st, :, :], o_f, transpose_B=True, clear_accum=True)
            if precise:  # the low half of S^T, in the same registers
                for i, j in T.Parallel(HV2, K):
                    sb_f[i, j] = st_f[i, j] - sb_f[i, j]
                T.gemm(sb_f, k_s[st, :, :], u_f, transpose_B=True)
                if with_output:
                    T.gemm(sb_f, q_s[st, :, :], o_f, transpose_B=True)
            if third:  # S^T - hi - mid, hi made again from S^T
                for i, j in T.Parallel(HV2, K):
                    sb_f[i, j] = st_f[i, j] - T.cast(T.cast(st_f[i, j], io_dtype), acc) - sb_f[i, j]
                T.gemm(sb_f, k_s[st, :, :], u_f, transpose_B=True)
            # (decayed_k: what W^T and Vn^T need, gamma and Ag, comes before P and Kd)
            T.barrier_wait(a_ready[st] if early_a else p_ready[st], (c // 2) % 2)
            stamp(tr, w, 2, c, h, n)
            if state_p:  # P = scale Gam ⊙ Q K^T on this path's columns, for both paths' O^T
                T.wait_wgmma(0)
                for i, j in T.Parallel(C, HC):
                    ph_f[i, j] = T.if_then_else(
                        i >= j + w * HC,
                        ph_f[i, j] * scale * T.exp2((gc_s[st, i] - gc_s[st, j + w * HC]) * LOG2E), 0.0)
                T.copy(ph_f, p_s[st, :, w * HC:w * HC + HC])
                T.fence_proxy_async()
                T.barrier_arrive(p_ready[st])
            if inverse_in_loop:  # gamma_C = exp(g~_last), which the gate warpgroup made
                for i, j in T.Parallel(HV2, K):
                    st_f[i, j] = st_f[i, j] * gam_s[st, C - 1]
            # W^T = V^T - (S^T K^T) diag(gamma) ;  O^T = scale (S^T Q^T) diag(gamma), in one pass over the tile
            if lean:
                parts.column_factors(gam_s, dec_s, gcol_f, dcol_f, st)
                if with_output:
                    for i, j in T.Parallel(HV2, C):
                        u_f[i, j] = v_s[st, j, c0 + i] - u_f[i, j] * gcol_f[j]
                        o_f[i, j] = o_f[i, j] * (scale * gcol_f[j])
                else:
                    for i, j in T.Parallel(HV2, C):
                        u_f[i, j] = v_s[st, j, c0 + i] - u_f[i, j] * gcol_f[j]
            elif with_output:
                for i, j in T.Parallel(HV2, C):
                    u_f[i, j] = v_s[st, j, c0 + i] - u_f[i, j] * gam_s[st, j]
                    o_f[i, j] = o_f[i, j] * (scale * gam_s[st, j])
            else:
                for i, j in T.Parallel(HV2, C):
                    u_f[i, j] = v_s[st, j, c0 + i] - u_f[i, j] * gam_s[st, j]
            T.copy(u_f, ub_f)
            if precise:
                for i, j in T.Parallel(HV2, C):
                    lb_f[i, j] = u_f[i, j] - ub_f[i, j]
            if third:
                for i, j in T.Parallel(HV2, C):
                    xb_f[i, j] = u_f[i, j] - ub_f[i, j] - lb_f[i, j]
            # Vn^T = W^T Ag^T
            T.gemm(ub_f, a_s[st, :, :], u_f, transpose_B=True, clear_accum=True)
            if precise:
                T.gemm(lb_f, a_s[st, :, :], u_f, transpose_B=True)
            if third:
                T.gemm(xb_f, a_s[st, :, :], u_f, transpose_B=True)
            T.copy(u_f, ub_f)
            if decayed_k:
                T.barrier_wait(p_ready[st], (c // 2) % 2)
                stamp(tr, w, 3, c, h, n)
                # O^T += Vn^T P^T and S'^T = gamma_C S^T + Vn^T Kd together (rows past the end have Vn = 0)
                if with_output:
                    T.wgmma_gemm(ub_f, p_s[st, :, :], o_f, transpose_B=True)
                T.wgmma_gemm(ub_f, kd_s[st, :, :], st_f)
                T.wait_wgmma(0)
                T.barrier_arrive(empty[st])
                stamp(tr, w, 4, c, h, n)
                if with_output:
                    parts.store_output(o_f, o_s, o, w, t0, n_rows, h, c0)
            elif state_p:
                T.barrier_wait(p_ready[st], (c // 2) % 2)
                stamp(tr, w, 3, c, h, n)
                # O^T += Vn^T P^T in flight while Vn^T diag(d) is made; then S'^T = gamma_C S^T + (Vn^T diag(d)) K
                T.wgmma_gemm(ub_f, p_s[st, :, :], o_f, transpose_B=True)
                for i, j in T.Parallel(HV2, C):
                    vd_f[i, j] = T.cast(u_f[i, j] * dec_s[st, j], io_dtype)
                T.wgmma_gemm(vd_f, k_s[st, :, :], st_f)
                T.wait_wgmma(0)
                T.barrier_arrive(empty[st])
                stamp(tr, w, 4, c, h, n)
                parts.store_output(o_f, o_s, o, w, t0, n_rows, h, c0)
            else:
                if precise:
                    for i, j in T.Parallel(HV2, C):
                        lb_f[i, j] = u_f[i, j] - ub_f[i, j]
                # O^T += Vn^T P^T
                if with_output:
                    T.gemm(ub_f, p_s[st, :, :], o_f, transpose_B=True)
                    if precise:
                        T.gemm(lb_f, p_s[st, :, :], o_f, transpose_B=True)
                # S'^T = gamma_C S^T + (Vn^T diag(exp(g~_last - g~))) K ; rows past the end have Vn = 0
                parts.decay_columns(u_f, dcol_f if lean else None, dec_s, st, lean)
                T.copy(u_f, ub_f)
                if precise:
                    for i, j in T.Parallel(HV2, C):
                        lb_f[i, j] = u_f[i, j] - ub_f[i, j]
                if lean:
                    parts.decay_state_once(st_f, gc_s, st, gl)
                else:
                    for i, j in T.Parallel(HV2, K):
                        st_f[i, j] = st_f[i, j] * T.exp2(gc_s[st, C - 1] * LOG2E)
                T.gemm(ub_f, k_s[st, :, :], st_f)
                if precise:
                    T.gemm(lb_f, k_s[st, :, :], st_f)
                if third:  # Vn^T diag(d) - hi - mid, in the second term's registers
                    for i, j in T.Parallel(HV2, C):
                        lb_f[i, j] = u_f[i, j] - ub_f[i, j] - lb_f[i, j]
                    T.gemm(lb_f, k_s[st, :, :], st_f)
                T.barrier_arrive(empty[st])
                if with_output:
                    parts.store_output(o_f, o_s, o, w, t0, n_rows, h, c0)

        parts.store_state(st_f, ht, n, h, c0)

    producer = make_ring_producer(C, K, V, io_dtype, first_warp=384, load_q=with_output, paired=transition_pairs,
                                  gate_rows=inverse_in_loop)
    gi = make_gate_inverse(C, K, io_dtype, first_thread=256, registers=register_inverse)

    @T.macro
    def kernel_body(q, k, v, gcum, Ag, g, beta, cu_seqlens, first_slot, h0, scale, o, ht, seg_seq=None, first=None,
                    count=None, first_states=None, shift=None, m_bound=None, b_start=None, chunk_bound=None,
                    m_zero=None, chunk_inject=None, h0_log_norm=None, tr=None):
        with T.Kernel(heads, num_seqs, threads=512) as (h, n):
            if transition_pairs:
                hq = (h // 2) // group
            else:
                hq = h // group
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            n_chunks = T.ceildiv(eos - bos, C)
            if skipping:
                seq = seg_seq[n]
                is_first = T.cast(n, "int64") == first[seq]
                is_last = T.cast(n, "int64") == first[seq] + count[seq] - 1
                # head 2h: b (never read for a last segment; with "m_only" for none); 2h + 1: M (never for a
                # first one, in the forward not for a last one either)
                unread_m = T.Or(is_first, is_last) if forward_skips else is_first
                unread = T.if_then_else(h % 2 == 0, True if skip_unread == "m_only" else is_last, unread_m)
                n_chunks = T.if_then_else(unread, 0, n_chunks)
                if negligible_m and chunk_bounds:  # the same, the bound summed here from stage 1's chunks
                    red_s = T.alloc_shared((64,), acc)  # the first warp's partial sums, then their magnitudes
                    lb = T.alloc_local((2,), acc)
                    tb = T.get_thread_binding()
                    if chunk_late_b:  # b items sum their chunks as well (for their start)
                        walk_m = n_chunks  # (0 where unread)
                    else:
                        walk_m = T.if_then_else(h % 2 == 1, n_chunks, 0)  # (0 where unread)
                    if tb < 32:
                        lb[0] = 0.0
                        lb[1] = 0.0
                        for i in T.serial(T.ceildiv(walk_m, 32)):
                            if tb + 32 * i < walk_m:
                                lb[0] = lb[0] + chunk_bound[h // 2, first_slot[n] + tb + 32 * i]
                                lb[1] = lb[1] + T.abs(chunk_bound[h // 2, first_slot[n] + tb + 32 * i])
                        red_s[tb] = lb[0]
                        red_s[32 + tb] = lb[1]
                    T.sync_threads()
                    lb[0] = 0.0
                    lb[1] = 0.0
                    for i in T.unroll(32):
                        lb[0] = lb[0] + red_s[i]
                        lb[1] = lb[1] + red_s[32 + i]
                    T.sync_threads()  # every read of red_s done: its space is the input ring's, the producer's next
                    rounded = lb[0] + lb[1] * T.cast(walk_m + 64, acc) * T.float32(SEGMENT_SUM_REL) + T.float32(
                        SEGMENT_SUM_ABS)
                    m_gone = T.And(walk_m > 0, rounded < T.float32(NEGLIGIBLE_LOG_NORM))
                    if chunk_late_b:
                        m_gone = T.And(h % 2 == 1, m_gone)
                        # b: the chunks from the start while what they owe b stays below the threshold
                        # (flashgdn.cp.bounds.segment_b_starts), by the first warp 32 chunks a round: a lane's chunk
                        # c, the bounds' prefix sum P_c by a scan, the running log-sum-exp of J_c - P_c by a scan
                        # of (max, sum of exponentials), the first chunk whose bound fails; the count shared
                        # through red_s. lj: the carried prefix, max and sum; this lane's P and max; a NaN flag (a
                        # NaN term fails its chunk and every later one); the h0 term; the margin; this lane's sum;
                        # two of a neighbour's
                        lj = T.alloc_local((11,), acc)
                        nb = T.alloc_local((3,), "int32")  # the count, still counting, the round's first failure
                        if tb < 32:
                            lj[0] = 0.0
                            lj[1] = -T.infinity(acc)
                            lj[2] = 0.0
                            nb[0] = 0
                            nb[1] = T.if_then_else(h % 2 == 0, 1, 0)
                            # the h0 term (a sequence's first segment): log |h0| + the segment's bound
                            lj[6] = T.if_then_else(is_first, h0_log_norm[seq, h // 2] + lb[0], -T.infinity(acc))
                            lj[7] = rounded - lb[0]  # the margin (NaN where a chunk bound is not finite: no count)
                            for r in T.serial(T.ceildiv(walk_m, 32)):
                                if nb[1] == 1:  # (the same on every lane)
                                    c = 32 * r + tb
                                    lj[3] = T.if_then_else(c < walk_m, chunk_bound[h // 2, first_slot[n] + c],
                                                           T.float32(0))
                                    lj[8] = T.if_then_else(c < walk_m, chunk_inject[h // 2, first_slot[n] + c],
                                                           -T.infinity(acc))
                                    for d in T.unroll(5):  # inclusive prefix sum of the bounds over the lanes
                                        lj[9] = T.shfl_up(lj[3], 1 << d)
                                        if tb >= (1 << d):
                                            lj[3] = lj[3] + lj[9]
                                    lj[3] = lj[3] + lj[0]
                                    lj[8] = lj[8] - lj[3]  # this chunk's term J_c - P_c
                                    lj[5] = T.if_then_else(T.isnan(lj[8]), T.float32(1), T.float32(0))
                                    lj[4] = T.if_then_else(lj[5] > 0, -T.infinity(acc), lj[8])
                                    lj[8] = T.if_then_else(lj[4] > -T.infinity(acc), T.float32(1), T.float32(0))
                                    lse_scan(lj, tb, 5, 4, 8, 9, 10)  # inclusive (max, sum) scan, NaN flag's
                                    lse_merge(lj, 4, 8, 1, 2)  # with the rounds before (max lj[1], sum lj[2])
                                    # the bound on what chunks 0..c owe b: lb[0] + lse, beside the h0 term
                                    lj[9] = T.if_then_else(lj[4] == -T.infinity(acc), lj[4],
                                                           lb[0] + lj[4] + T.log(lj[8]))
                                    lj[9] = T.if_then_else(
                                        lj[6] == -T.infinity(acc), lj[9], T.if_then_else(
                                            lj[6] > lj[9], lj[6] + T.log(1.0 + T.exp(lj[9] - lj[6])),
                                            lj[9] + T.log(1.0 + T.exp(lj[6] - lj[9]))))
                                    # the round's first chunk that fails (past the segment: none)
                                    # (a NaN fails: "not below" is spelled out, as TileLang rewrites Not(a < b)
                                    # to b <= a, which a NaN passes: a chunk bound that is not finite makes the
                                    # margin NaN, and must leave out nothing)
                                    lj[9] = lj[9] + lj[7]
                                    nb[2] = T.warp_reduce_min(T.if_then_else(
                                        T.And(c < walk_m, T.Or(T.Or(lj[5] > 0, T.isnan(lj[9])),
                                                               lj[9] >= T.float32(NEGLIGIBLE_LOG_NORM))), c, 1 << 30))
                                    if nb[2] < (1 << 30):
                                        nb[0] = nb[2]
                                        nb[1] = 0
                                    else:
                                        nb[0] = T.min(32 * r + 32, walk_m)
                                        # carried to the next round: the last lane's prefix and (max, sum)
                                        lj[0] = T.shfl_sync(lj[3], 31)
                                        lj[1] = T.shfl_sync(lj[4], 31)
                                        lj[2] = T.shfl_sync(lj[8], 31)
                            if tb == 0:
                                red_s[0] = T.cast(nb[0], acc)
                        T.sync_threads()
                        b_skip = T.if_then_else(h % 2 == 0, T.cast(red_s[0], "int32"), 0)
                        T.sync_threads()  # red_s's space is the input ring's
                    n_chunks = T.if_then_else(m_gone, 0, n_chunks)
                    if tb == 0 and h % 2 == 1:  # the splice's hint: this M is stored as zero
                        m_zero[n, h // 2] = T.if_then_else(m_gone, 1, 0)
                elif negligible_m:  # an M below float32's range: no walk, zero stored (flashgdn.cp.bounds)
                    m_gone = T.And(h % 2 == 1, m_bound[n, h // 2] < T.float32(NEGLIGIBLE_LOG_NORM))
                    n_chunks = T.if_then_else(m_gone, 0, n_chunks)
                if late_b or chunk_late_b:  # b from its first chunk that float32 can see on, from zero
                    if late_b:  # (flashgdn.cp.bounds.b_start_chunks)
                        b_skip = T.if_then_else(h % 2 == 0, b_start[n, h // 2], 0)
                    bos = bos + b_skip * C
                    n_chunks = T.max(n_chunks - b_skip, 0)
                    is_first = T.And(is_first, b_skip == 0)

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
            o_s = T.alloc_shared((2, C, HV2), io_dtype)  # O of each state path, for the TMA store
            # (None where unused: an alias would rename the buffer in the kernel's script, and so its cache key)
            kd_s = T.alloc_shared((2, C, K), io_dtype) if decayed_k else None  # Kd = diag(d) K, per ring stage
            g_s = T.alloc_shared((2, C), acc) if inverse_in_loop else None  # g and beta rows, from the producer
            b_s = T.alloc_shared((2, C), acc) if inverse_in_loop else None

            full = T.alloc_barrier(arrive_count=[96] * 2)  # producer warps 0..2 -> consumers
            empty = T.alloc_barrier(arrive_count=[384] * 2)  # consumers -> producer
            # P from the gate, or (state_p) from both state paths, a half each
            p_ready = T.alloc_barrier(arrive_count=[256 if state_p else 128] * 2)
            a_ready = T.alloc_barrier(arrive_count=[128] * 2) if early_a else None  # gate -> state, before P

            if swizzled_v:
                T.annotate_layout({v_s: tilelang.layout.make_swizzled_layout(v_s)})

            tx = T.get_thread_binding()

            if tx < 128:
                T.set_max_nreg(state_regs, 1)
                # (seq and is_first passed only where used: passing them to every skipping build changes the
                # generated code of the measured ones, and so their cache entries)
                if negligible_m:
                    state_path(0, n, h, bos, eos, n_chunks, h0, ht, o, scale, q_s, k_s, v_s, gc_s, a_s, p_s, gam_s,
                               dec_s, o_s, full, empty, p_ready, first_slot, kd_s, a_ready, seq, is_first,
                               m_gone=m_gone, tr=tr)
                elif starts_from_h0:
                    state_path(0, n, h, bos, eos, n_chunks, h0, ht, o, scale, q_s, k_s, v_s, gc_s, a_s, p_s, gam_s,
                               dec_s, o_s, full, empty, p_ready, first_slot, kd_s, a_ready, seq, is_first, tr=tr)
                else:  # (first_states and shift None but with first_apart)
                    state_path(0, n, h, bos, eos, n_chunks, h0, ht, o, scale, q_s, k_s, v_s, gc_s, a_s, p_s, gam_s,
                               dec_s, o_s, full, empty, p_ready, first_slot, kd_s, a_ready,
                               first_states=first_states, shift=shift, tr=tr)
            elif tx < 256:
                T.set_max_nreg(state_regs, 1)
                if negligible_m:
                    state_path(1, n, h, bos, eos, n_chunks, h0, ht, o, scale, q_s, k_s, v_s, gc_s, a_s, p_s, gam_s,
                               dec_s, o_s, full, empty, p_ready, first_slot, kd_s, a_ready, seq, is_first,
                               m_gone=m_gone, tr=tr)
                elif starts_from_h0:
                    state_path(1, n, h, bos, eos, n_chunks, h0, ht, o, scale, q_s, k_s, v_s, gc_s, a_s, p_s, gam_s,
                               dec_s, o_s, full, empty, p_ready, first_slot, kd_s, a_ready, seq, is_first, tr=tr)
                else:  # (first_states and shift None but with first_apart)
                    state_path(1, n, h, bos, eos, n_chunks, h0, ht, o, scale, q_s, k_s, v_s, gc_s, a_s, p_s, gam_s,
                               dec_s, o_s, full, empty, p_ready, first_slot, kd_s, a_ready,
                               first_states=first_states, shift=shift, tr=tr)
            elif tx < 384:
                # ---------------- gate path
                T.set_max_nreg(gate_regs, 0)
                if not state_p:
                    p_f = T.alloc_fragment((C, C), acc)
                if inverse_in_loop:
                    gb = gi.buffers()
                for c in T.serial(n_chunks):
                    st = c % 2
                    stamp(tr, 2, 0, c, h, n)
                    T.barrier_wait(full[st], (c // 2) % 2)
                    stamp(tr, 2, 1, c, h, n)
                    if inverse_in_loop:  # g~ and Ag of this chunk, into the ring stage
                        if state_p:
                            gi.chunk_cumsum_scan(tx, g_s, gc_s, st, gb.run)
                        else:
                            gi.chunk_cumsum(tx, g_s, gc_s, st, gb.run)
                        stamp(tr, 2, 2, c, h, n)
                        if register_inverse:
                            gi.gated_inverse_registers(tx, k_s, b_s, gc_s, a_s, st, gb,
                                                       (lambda p: stamp(tr, 2, p, c, h, n)) if trace else None)
                        else:
                            gi.gated_inverse(tx, k_s, b_s, gc_s, a_s, st, gb.kk_f, gb.kk_s, gb.d_s, gb.l21_s, gb.t_s,
                                             gb.m_f, gb.x, gb.part, gb.s16_s, gb.t16_s, gb.m16_f)
                    if early_a:  # gamma (and Ag) first: the state paths' W^T and Vn^T wait on them alone
                        parts.gate_decays(gc_s, gam_s, dec_s, st)
                        T.fence_proxy_async()
                        T.barrier_arrive(a_ready[st])
                        stamp(tr, 2, 7, c, h, n)
                    if state_p:  # P is the state paths' to make, the decay of the update theirs too
                        T.barrier_arrive(empty[st])
                        stamp(tr, 2, 8, c, h, n)
                        stamp(tr, 2, 9, c, h, n)
                    else:
                        if with_output:
                            parts.gate_p(q_s, k_s, gc_s, p_f, p_s, st, scale)
                            stamp(tr, 2, 8, c, h, n)
                        if not decayed_k:
                            parts.gate_decays(gc_s, gam_s, dec_s, st)
                        if decayed_k:  # the factor again from g~ (dec_s is another thread's write)
                            for i, j in T.Parallel(C, K):
                                kd_s[st, i, j] = T.cast(
                                    T.cast(k_s[st, i, j], acc) * T.exp2((gc_s[st, C - 1] - gc_s[st, i]) * LOG2E),
                                    io_dtype)
                        T.fence_proxy_async()
                        T.barrier_arrive(p_ready[st])
                        T.barrier_arrive(empty[st])
                        stamp(tr, 2, 9, c, h, n)
                if with_output:  # padded tail after the last sequence: zeros
                    parts.zero_tail(o, n, h, eos, num_seqs, num_tokens)
            else:
                # ---------------- producer
                T.set_max_nreg(producer_regs, 0)
                if late_b or chunk_late_b:  # its slots from the first chunk it walks
                    producer(tx, n, h, hq, bos, eos, n_chunks, q, k, v, gcum, Ag, first_slot, q_s, k_s, v_s, a_s,
                             gc_s, full, empty, g, beta, g_s, b_s, slot_shift=b_skip)
                else:
                    producer(tx, n, h, hq, bos, eos, n_chunks, q, k, v, gcum, Ag, first_slot, q_s, k_s, v_s, a_s,
                             gc_s, full, empty, g, beta, g_s, b_s)

    if inverse_in_loop and trace:

        @T.prim_func
        def chunk_forward_rs_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            g: T.Tensor((1, num_tokens, Hv), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            h0: T.Tensor(state_shape_h0, "float32"),
            scale: T.float32,
            o: T.Tensor((1, o_tokens, Hv, V), io_dtype),
            ht: T.Tensor(state_shape_ht, ht_dtype),
            tr: T.Tensor((3, TRACE_CHUNKS, TRACE_POINTS), "int64"),
        ):
            kernel_body(q, k, v, None, None, g, beta, cu_seqlens, None, h0, scale, o, ht, tr=tr)

    elif inverse_in_loop:

        @T.prim_func
        def chunk_forward_rs_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            g: T.Tensor((1, num_tokens, Hv), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            h0: T.Tensor(state_shape_h0, "float32"),
            scale: T.float32,
            o: T.Tensor((1, o_tokens, Hv, V), io_dtype),
            ht: T.Tensor(state_shape_ht, ht_dtype),
        ):
            kernel_body(q, k, v, None, None, g, beta, cu_seqlens, None, h0, scale, o, ht)

    elif late_b:
        n_cp_seqs = T.dynamic("n_cp_seqs")

        @T.prim_func
        def chunk_forward_rs_kernel(
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
            ht: T.Tensor(state_shape_ht, ht_dtype),
            seg_seq: T.Tensor((num_seqs,), "int64"),
            first: T.Tensor((n_cp_seqs,), "int64"),
            count: T.Tensor((n_cp_seqs,), "int64"),
            m_bound: T.Tensor((num_seqs, Hv), "float32"),
            b_start: T.Tensor((num_seqs, Hv), "int32"),
        ):
            kernel_body(q, k, v, gcum, Ag, None, None, cu_seqlens, first_slot, h0, scale, o, ht, seg_seq, first, count,
                        m_bound=m_bound, b_start=b_start)

    elif chunk_late_b:
        n_cp_seqs = T.dynamic("n_cp_seqs")

        @T.prim_func
        def chunk_forward_rs_kernel(
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
            ht: T.Tensor(state_shape_ht, ht_dtype),
            seg_seq: T.Tensor((num_seqs,), "int64"),
            first: T.Tensor((n_cp_seqs,), "int64"),
            count: T.Tensor((n_cp_seqs,), "int64"),
            chunk_bound: T.Tensor((Hv, num_slots), "float32"),
            m_zero: T.Tensor((num_seqs, Hv), "int32"),
            chunk_inject: T.Tensor((Hv, num_slots), "float32"),
            h0_log_norm: T.Tensor((n_cp_seqs, Hv), "float32"),
        ):
            kernel_body(q, k, v, gcum, Ag, None, None, cu_seqlens, first_slot, h0, scale, o, ht, seg_seq, first, count,
                        chunk_bound=chunk_bound, m_zero=m_zero, chunk_inject=chunk_inject, h0_log_norm=h0_log_norm)

    elif chunk_bounds:
        n_cp_seqs = T.dynamic("n_cp_seqs")

        @T.prim_func
        def chunk_forward_rs_kernel(
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
            ht: T.Tensor(state_shape_ht, ht_dtype),
            seg_seq: T.Tensor((num_seqs,), "int64"),
            first: T.Tensor((n_cp_seqs,), "int64"),
            count: T.Tensor((n_cp_seqs,), "int64"),
            chunk_bound: T.Tensor((Hv, num_slots), "float32"),
            m_zero: T.Tensor((num_seqs, Hv), "int32"),
        ):
            kernel_body(q, k, v, gcum, Ag, None, None, cu_seqlens, first_slot, h0, scale, o, ht, seg_seq, first, count,
                        chunk_bound=chunk_bound, m_zero=m_zero)

    elif negligible_m:
        n_cp_seqs = T.dynamic("n_cp_seqs")

        @T.prim_func
        def chunk_forward_rs_kernel(
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
            ht: T.Tensor(state_shape_ht, ht_dtype),
            seg_seq: T.Tensor((num_seqs,), "int64"),
            first: T.Tensor((n_cp_seqs,), "int64"),
            count: T.Tensor((n_cp_seqs,), "int64"),
            m_bound: T.Tensor((num_seqs, Hv), "float32"),
        ):
            kernel_body(q, k, v, gcum, Ag, None, None, cu_seqlens, first_slot, h0, scale, o, ht, seg_seq, first, count,
                        m_bound=m_bound)

    elif skipping:
        n_cp_seqs = T.dynamic("n_cp_seqs")

        @T.prim_func
        def chunk_forward_rs_kernel(
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
            ht: T.Tensor(state_shape_ht, ht_dtype),
            seg_seq: T.Tensor((num_seqs,), "int64"),
            first: T.Tensor((n_cp_seqs,), "int64"),
            count: T.Tensor((n_cp_seqs,), "int64"),
        ):
            kernel_body(q, k, v, gcum, Ag, None, None, cu_seqlens, first_slot, h0, scale, o, ht, seg_seq, first, count)

    elif first_apart:

        @T.prim_func
        def chunk_forward_rs_kernel(
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
            ht: T.Tensor(state_shape_ht, ht_dtype),
            first_states: T.Tensor((num_seqs, Hv, 2 * V, K), io_dtype),
            shift: T.int32,
        ):
            kernel_body(q, k, v, gcum, Ag, None, None, cu_seqlens, first_slot, h0, scale, o, ht,
                        first_states=first_states, shift=shift)

    else:

        @T.prim_func
        def chunk_forward_rs_kernel(
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
            ht: T.Tensor(state_shape_ht, ht_dtype),
        ):
            kernel_body(q, k, v, gcum, Ag, None, None, cu_seqlens, first_slot, h0, scale, o, ht)

    return tilelang.compile(
        chunk_forward_rs_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs()
    )
