"""Stage 1 of the Hopper forward: chunk-local gate cumsum and the gated inverse Ag, per (chunk, qk head).

Math (DESIGN.md §2, chunk size C = 64, rows i, j of one chunk of one value head h, qk head h // group):

    g~_i  = sum_{s <= i} g_s                                        (chunk-local cumsum)
    L     = StrictLower(diag(beta) K K^T)                           (L_ij = beta_i k_i.k_j for i > j)
    A     = (I + L)^{-1}                                            (unit lower triangular, no gate in it)
    Ag_ij = exp(g~_i - g~_j) A_ij beta_j   (j <= i, else 0)         (what the chunk loop multiplies by)

One CTA takes one chunk of one qk head: K K^T is formed once (wgmma) and kept in shared memory as fp32, then
the value heads of the group are inverted two at a time. The inverse is blocked in two 32x32 diagonal blocks:

* each diagonal block by forward substitution, one thread per column with the column in registers
  (x_r = -beta_r sum_{j<r} (K K^T)_rj x_j; every read of K K^T is a broadcast), so no partial result goes
  through shared memory;
* the off-diagonal block by ``A21 = -A22 (L21 A11)``, two 32x32 tf32 tensor-core products.

The default build (``diag16`` and ``mma32``) goes one level further down: the diagonal in 16x16 blocks by the same
substitution, each 32x32 diagonal block merged from its two by the same formula, and every merge's products as
per-warp ``mma.m16n8k8`` on fragments read from shared memory.

Ag is formed while it is written out, so the chunk loop needs neither A nor beta. Every gate factor is the
exp of a difference <= 0 and Ag has A's magnitude; storing Ag (one rounding to the io dtype) is as accurate as
storing A and gating it later.

Both outputs are laid out by chunk slot, not by token: ``Ag[slot, h]`` is one 64x64 tile and
``gcum[h, 64 slot : 64 slot + 64]`` one run of 64 values, so every chunk writes whole tiles with plain vector
stores and the chunk loop loads them with one TMA copy each, partial chunks included. Rows of a chunk past
its sequence's end are loaded as zeros (k, g, beta): their rows and columns of Ag come out zero and the
cumsum stays flat at its last real value, which is what the chunk loop wants there.

PyTorch counterparts: ``flashgdn.reference.chunked.chunk_local_cumsum``, ``kkt_inverse`` and
``gated_inverse`` (token-major; ``forward.slots_to_tokens`` maps the slot layout back).
"""


from ...cp.bounds import CHUNK_BOUND_ABS, CHUNK_BOUND_REL
from .common import CHUNK, LOG2E, TARGET, kernel_cache, pass_configs, tl_dtype  # noqa: F401
from .inverse_registers import make_register_inverse
from .warp_bounds import warp_lse_macros


#: what each of a trace build's stamps follows (``trace``); point 4 is the 16 -> 32 merges' end
TRACE_POINTS_OF = ("start", "k's tile and the gates loaded", "K K^T stored, g~ made and stored",
                   "16x16 diagonal blocks substituted", "16 -> 32 merges done", "32 -> 64 merge done",
                   "Ag gated and stored")
TRACE_POINTS = len(TRACE_POINTS_OF)


@kernel_cache
def build_kkt_inverse(Hqk: int, Hv: int, K: int, qk_dtype: str, a_dtype: str, blocks_per_sm: int = 4,
                      store_inverse: bool = False, async_loads: bool = False, triangle: bool = False,
                      diag16: bool = False, mma32: bool = False, chunk_bounds: bool = False,
                      chunk_injects: bool = False, trace: bool = False, registers16: bool = False,
                      merge16_registers: bool = False, merge32_registers: bool = False,
                      merge32_quadrants: bool = False, registers8: bool = False):
    """Compile (or load from the cache) the kernel for one configuration.

    Arguments of the returned kernel, in order:
      k        [1, T, Hqk, K]   qk dtype
      g        [1, T, Hv]       float32 per-token log decay
      beta     [1, T, Hv]       float32
      bounds   [S, 2]           int32: (first token, length) of every chunk slot; length 0 = idle slot
      gcum     [Hv, 64 S]       float32, written: head-major, 64 values per chunk slot
      Ag       [S, Hv, 64, 64]  a dtype, written: one tile per chunk slot and value head

    ``blocks_per_sm`` is the occupancy the kernel is built for. It is a chain of short dependent steps (loads,
    one small GEMM, a serial substitution, two 32x32 merges) on 4 warps, so its speed comes from how many CTAs
    hide each other's latency (4 by default; 5 is an A/B not yet timed: ptxas then fits it in 89-96 registers
    without spills, and each head's A21 is gated right after its merge from the merge's second tile, so that the
    inverse keeps two blocks per head and five CTAs' shared memory fits an SM: 20 warps per SM instead of 16; the
    same values, so the same bits). The inverse is kept as three 32x32 blocks that the merge GEMMs read in place, Ag
    is stored straight from the gating loops, buffers with disjoint lifetimes share shared memory (~51 KB) and
    registers are capped so that 4 (the default) or 3 CTAs fit an SM. (The earlier build, 101 KB and 2 CTAs per
    SM, gave bitwise the same outputs 1.5-1.6x slower: ``benchmarks/results/h200/stages-hopper-v0.3.json``.)

    An odd group's build inverts one head at a time, so it needs less shared memory (~29-31 KB with ``diag16`` and
    ``mma32``) and fits more CTAs per SM if registers allow: ``blocks_per_sm`` 6 or 7 caps them at 80 or 72. A group
    of one then compiles at 7 to the same instructions with no spills; a group of three at 6 spills 4-16 bytes.
    ``forward.KKT_ODD_GROUP_BLOCKS`` (the default) takes 7 for a group of one (notes v0.33c).

    ``store_inverse`` adds a last argument ``A [S, Hv, 64, 64]`` (a dtype) that receives the ungated inverse A as
    well: the backward needs it (dL = -A^T dA A^T), and it cannot be had back from Ag once the decay underflows.
    The backward's GEMMs read it in the io dtype anyway, and its elementwise uses lose nothing measurable to that
    rounding (``benchmarks/numerics_backward.py``).

    ``async_loads=True`` brings k's tile by cp.async (16 bytes per thread and instruction, zero-filled past the
    tensor's end; rows of the next sequence zeroed after the wait) instead of through registers: the register-staged
    load and its address arithmetic held ~22% of the stall samples (``profiles/forward-v0.9-kkt-*``). Same values in
    shared memory, so the same bits out. Measured: 0.92x-0.97x the time (``stages-hopper-v0.10e.json``); the
    default (``forward.KKT_ASYNC_LOADS``).

    ``triangle=True`` gives the substitution's warps columns by where their work lies: a diagonal block's columns
    0-15 need all 32 rows, columns 16-31 only rows 16-31 (above its diagonal a column is zero). Each of the pair's
    heads gets one warp for the first half of both its blocks (a half-warp per block) and one for the second half,
    which skips rows 0-15 and the products with them: 38% fewer of the substitution's FMAs and broadcast loads
    issued. The products skipped are exact zeros added to the same partial sums in the same order, so the bits are
    the same. Measured: the stage 0.933x-0.985x the time of the build without it (geometric mean 0.956x over eight
    shapes, ``forward/kkt-options-v0.21a.json``), the op 0.977x-1.003x (``forward/kkt-triangle-op-v0.21a.json``);
    the forward's default before ``diag16`` (``forward.KKT_TRIANGLE``, used when ``forward.KKT_DIAG16`` is off).

    ``diag16=True`` (the default, with ``mma32``) inverts the diagonal in 16x16 blocks instead: the substitution's
    chain is 16 rows long (at most 120 FMAs a thread instead of 496), one thread per column of each of the pair's
    eight 16x16 blocks (an odd group: one head's four on threads 0-63), and each 32x32 diagonal block is then merged
    from its two by the warp that holds them, ``A21' = -A22' (L21' A11')`` in seven tf32 ``mma.m16n8k8`` (the
    product with A11''s zero upper half skipped), before the 32x32 merge as above. Its 16x16 products are rounded to
    tf32 as the 32x32 merge's are, so the bits differ from the build without it.

    ``mma32=True`` (with ``diag16``) does the 32x32 merge the same way: both heads of the pair at once, two warps
    each, ``X = L21 A11`` (each warp 16 rows, the products with A11's zero upper right skipped: 10 mma) into a shared
    tile, then ``A21 = -A22 X`` (each warp 16 columns, the products with A22's zero upper right skipped: 12 mma)
    written over X, instead of L21 staged through shared memory and two ``T.gemm`` per head, one head after the
    other (2/4's build: 15 barriers instead of 18). The blocks and X keep the swizzled layout that ``T.gemm`` gave
    the blocks (annotated, since no ``T.gemm`` reads them any more): with the plain layout the fragments' element
    reads conflicted 4-8 ways, the gating read X one element at a time, and the stage was 1.13x slower than
    ``diag16`` alone (v0.24a). The same tf32 products in the same order, so the same bits as ``diag16``. Measured:
    the stage 0.885x ``diag16``'s time (0.917x with A stored), the op 0.977x on full and 0.986x on few-CTA
    canonical shapes (``forward/kkt-options-mma32-v0.24b.json``, ``forward/kkt-mma32-op-v0.24b.json``); the
    default (``forward.KKT_MMA32``).

    ``chunk_bounds=True`` adds a last argument ``chunk_bound [Hv, S]`` float32: per chunk slot and value head an upper
    bound on the log of the norm of the chunk's transition, ``sum_i g_i + log max(1, |1 - beta_i |k_i|^2|)`` over its
    rows (``flashgdn.cp.bounds.token_log_growth``, summed), with |k_i|^2 read off K K^T's diagonal here. It is
    rounded up by ``CHUNK_BOUND_REL`` of the sum of the terms' magnitudes and ``CHUNK_BOUND_ABS`` a chunk, far more
    than float32's rounding of 64 terms and of the diagonal, so it stays a bound as computed. Context parallelism's
    transition pass sums it over a segment's chunks (``chunk_forward_rs``'s ``chunk_bounds``) to drop an M below
    float32's range without reading k again (an A/B, ``backend.CP_NEGLIGIBLE_M_IN_KERNEL``). One thread per value
    head of the group sums its 64 rows; the other outputs are those of the build without it.

    ``chunk_injects=True`` (with ``chunk_bounds``) takes v ``[1, T, Hv, V]`` (qk dtype, V = K) after k's other
    inputs, before ``bounds``, and adds a last argument ``chunk_inject [Hv, S]`` float32: per chunk slot and value
    head the log of what the chunk's tokens inject into a state walked from zero at its start, carried to its end,
    ``log sum_t |beta_t| |k_t| |v_t| exp(sum over the rows u after t of g_u + log max(1, |1 - beta_u |k_u|^2|))``
    (PyTorch counterpart: ``flashgdn.cp.bounds.chunk_log_injects``), rounded up as ``chunk_bound`` is; -inf where
    nothing is injected. With ``chunk_bound`` it bounds, chunk by chunk, what a segment's early tokens owe its b
    (``flashgdn.cp.bounds.segment_b_starts``), so that the transition pass can start b late without a pass over v
    (notes v0.36f, v0.36h; an A/B). Each row's |v_t|^2 is taken by two threads straight from global memory into
    registers (a staged tile would have to outlive the loop over the group's heads, which the shared-memory merge
    does not see: v0.36f's bug); the suffix sums of the rows' log factors come from a cumsum; one warp per value head
    makes the log-sum-exp of its 64 terms by shuffles.

    ``registers16=True`` (with ``diag16``; an A/B) makes the 16x16 diagonal blocks by elimination in registers, a warp a
    block, instead of by substitution a thread a column: lane (g, t) = (lane / 4, lane % 4) of warp w holds rows g
    and g + 8 of block w at columns 2t, 2t + 1, 8 + 2t, 9 + 2t (the mma accumulator's layout), K K^T's values there
    read once from shared memory; then for j = 0..14, row j of the inverse, final by then, comes from lane 4 (j % 8)
    + t by shuffles, L's (row, j) from the quad's lane that holds it, and every row below j takes ``X_i -= beta_i (K
    K^T)_ij X_j``: a chain of 15 shuffle-and-multiply-add steps on all four warps (both heads of a pair at once,
    sharing K K^T's shuffles) where the substitution ran a 16-row chain of shared-memory reads on two of them in a
    group of one (~1950 cycles alone, notes "Stage 1's phases measured"). The lane mapping is checked on the CPU
    (``tests/test_kkt_registers16_model.py``). The same sums in another order: other bits, the same error.

    ``merge16_registers=True`` (with ``registers16``; an A/B) joins the 16x16 blocks into 32x32 ones with fp16
    ``mma.m16n8k16`` whose operands come from registers where they can: warp 2m + 1 of 32-block m makes X^T =
    D_2m^T L21'^T (D_2m, warp 2m's block, from shared memory; L21', its own rows' beta-scaled K K^T), then A21' =
    -D_2m+1 X with D_2m+1 the block it holds in registers from the elimination and X's B fragments the same lane's
    accumulators of X^T; every warp then stores (A21', or an even warp's zeros over zeros): four ``mma`` a head and
    one CTA barrier (before the store, after the reads), where the tf32 merge takes eight element-wise fragments from
    shared memory on each side of one. No shared-memory write inside the odd warps' branch, on purpose: TileLang
    answers a hazard there with a ``__syncthreads()`` inside the branch, which the even warps never reach. fp16
    operands keep tf32's 10 bits of mantissa, rounded to nearest (FlashInfer's merges are fp16,
    ``benchmarks/inverse_numerics.py``); other bits. The lane mapping of the fragments is emulated on the CPU
    (``tests/test_kkt_registers16_model.py``).

    ``merge32_registers=True`` (with ``merge16_registers`` and ``mma32``; an A/B) makes the 32 -> 64 merge the same way
    on warps 2 and 3, whose rows are L21's and A22's: X = L21 A11 (A: their rows' beta-scaled K K^T, columns 0-31;
    B: A11 from shared memory; the products with its zero upper right skipped: 6 ``mma`` a warp), X into ``x32_s``,
    then A21 = -A22 X with A22's rows from registers (warp 2: D_2; warp 3: the A21' it made in the merge before and
    D_3; 4 and 8 ``mma``), written over X once every warp has read it. The same three barriers as the tf32 merge.

    ``registers8=True`` (with ``registers16``; an A/B) makes each warp's 16x16 block from its two 8x8 diagonal blocks,
    eliminated at once in the same registers in 7 steps instead of 15 (FlashInfer's 8x8 blocks), then merged by two
    fp16 ``mma.m16n8k16`` (``merge8_in_registers``: D^T from the stored block, the second product's B from the first's
    accumulators in the same lane). Every warp runs both: no branch on the warp index.

    ``merge32_quadrants=True`` (with ``mma32`` and ``merge16_registers``, not with ``merge32_registers``; an A/B) makes the 32 -> 64 merge by
    fp16 ``mma.m16n8k16`` on all four warps, a 16x16 quadrant each (warp w: rows 16 (w / 2), columns 16 (w % 2)): X =
    L21 A11 (A: its rows' beta-scaled K K^T; B: A11 from shared memory), then after a barrier A21 = -A22 X (A: A22's
    rows from shared memory; B: X's other quadrants from x32_s), stored over X after the next. Two k-steps of two
    n-tiles a product and warp, the zero upper right blocks of A11 and A22 included, so that no warp branches: 8
    ``mma`` a warp and head, where ``merge32_registers`` chains 14 on warp 3 and the tf32 merge 16 on each of two warps.

    ``trace`` (a diagnostic, with ``diag16``, ``mma32`` and ``async_loads`` and no other output) adds a last argument ``tr [S, Hqk,
    TRACE_POINTS]`` int64: per CTA, the SM's cycle counter read by thread 0 after each of the barriers between the
    stage's phases (``TRACE_POINTS_OF``; the first pair of the group only), one more barrier before the last. The
    same outputs as the build without it (``benchmarks/stage1_trace.py`` checks, and reads the phases' latencies).
    """
    if diag16 and triangle:
        raise ValueError("diag16 and triangle are two ways of splitting the substitution: take one")
    if registers16 and not diag16:
        raise ValueError("registers16 is a way of making diag16's 16x16 blocks: it needs diag16")
    if registers8 and not registers16:
        raise ValueError("registers8 is a way of making registers16's blocks in its registers: it needs registers16")
    if merge16_registers and not registers16:
        raise ValueError("merge16_registers takes its blocks from registers16's registers: it needs registers16")
    if merge32_registers and not (merge16_registers and mma32):
        raise ValueError("merge32_registers takes A21' from merge16_registers and replaces mma32's merge: it needs both")
    if merge32_quadrants and (not (mma32 and merge16_registers) or merge32_registers):
        # without merge16_registers a pair's build holds x16_s beside x32_s: 48 KB, past five CTAs an SM
        raise ValueError("merge32_quadrants replaces mma32's merge after merge16_registers (needs both), as "
                         "merge32_registers does: take one")
    if mma32 and not diag16:
        raise ValueError("mma32 merges the 32x32 blocks with diag16's warp mma: it needs diag16")
    if chunk_injects and not chunk_bounds:
        raise ValueError("chunk_injects is written beside chunk_bounds (the b start needs both): it needs it")
    if chunk_bounds and Hv // Hqk > 128:
        raise ValueError("chunk_bounds sums each value head's rows on a thread of its own: at most 128 a qk head")
    if trace and not (diag16 and mma32 and async_loads) or trace and (store_inverse or chunk_bounds or chunk_injects):
        raise ValueError("trace stamps the default build's phases (diag16, mma32 and async_loads; Ag and g~ only)")
    if blocks_per_sm not in (3, 4, 5, 6, 7):
        raise ValueError(f"blocks_per_sm must be 3 to 7, got {blocks_per_sm}")
    # five CTAs per SM need <= 44.6 KB of shared memory: each head's A21 is kept over the merge's second tile and
    # gated right after its merge, so the pair holds two blocks per head instead of three (same values, same bits);
    # more than five fit only an odd group's build (one head at a time: ~29-31 KB)
    five = blocks_per_sm >= 5
    import tilelang
    import tilelang.language as T

    C = CHUNK
    B = C // 2  # diagonal block of the inverse
    H = B // 2  # with triangle: where a block's columns split
    group = Hv // Hqk
    pair = 2 if group % 2 == 0 else 1  # value heads inverted side by side (one per 64 threads)
    num_tokens = T.dynamic("num_tokens")
    num_slots = T.dynamic("num_slots")
    slot_rows = T.dynamic("slot_rows")  # 64 * num_slots
    acc = "float32"
    pair_logsumexp, _, _ = warp_lse_macros()

    @T.macro
    def stamp(tr, slot, hq, point, tx):
        # trace builds only: the SM's cycle counter, by thread 0 (called right after a barrier)
        if trace:
            if tx == 0:
                tr[slot, hq, point] = T.call_extern("int64", "clock64")

    # the v0.38 options' register-level pieces (inverse_registers.py), and the helpers the other builds share with them
    ri = make_register_inverse(pair, registers8)
    kk_col, warp_mma, a_slot, c_col, mma_fp16, l_fragment = (
        ri.kk_col, ri.warp_mma, ri.a_slot, ri.c_col, ri.mma_fp16, ri.l_fragment)

    def gated(a, b_s, gc_s, hp, row, col):
        # Ag's element from A's: Gam ⊙ A ⊙ beta^T for value head hp of the group. Every exponent is clamped at 0:
        # above the diagonal A is 0 and the factor must stay finite.
        return T.cast(a * b_s[hp, col] * T.exp2(T.min(gc_s[hp, row] - gc_s[hp, col], 0.0) * LOG2E), a_dtype)

    # the substitution's threads: tx -> value head p of the pair, diagonal block d, column c of the block. With
    # triangle a warp takes one half of the columns of one head's two blocks, a half-warp per block
    def sub_head(tx):
        return (tx // 32) % pair if triangle else tx // 64

    def sub_block(tx):
        return (tx // 16) % 2 if triangle else (tx // B) % 2

    def sub_column(tx):
        return (tx // (32 * pair)) * H + tx % H if triangle else tx % B

    @T.macro
    def substitute(x, part, kk_s, b_s, hp, r0, c, first):
        # column c of a diagonal block's inverse by forward substitution, from row `first` on (x holds zeros above):
        # x_r = -beta_r sum_{j<r} (K K^T)_rj x_j, the sum in two partial sums by the parity of j
        for r in T.unroll(first, B):
            part[0] = 0.0
            part[1] = 0.0
            for j in T.unroll(first, r):
                part[j % 2] += kk_s[r0 + r, r0 + kk_col(r, j)] * x[j]  # r0 % 32 == 0
            x[r] = T.if_then_else(
                r == c, 1.0, T.if_then_else(r < c, 0.0, -b_s[hp, r0 + r] * (part[0] + part[1]))
            )

    @T.macro
    def substitute16(x, part, kk_s, b_s, hp, r0, c):
        # column c of the 16x16 diagonal block at row r0 (r0 % 16 == 0). K K^T's (r0 + r, r0 + j) is at column
        # kk_col(r0 + r, r0 + j) = (r0 ^ (m & 16)) + ((j ^ m) & 15), m = kk_col's mask of row r: a base of two per
        # thread plus a constant once the loops are unrolled, as the 32x32 substitution's r0 % 32 == 0 gives it
        flip = H - 2 * (r0 % B)  # r0 ^ 16 - r0
        for r in T.unroll(H):
            part[0] = 0.0
            part[1] = 0.0
            for j in T.unroll(r):
                # (j ^ m) & 15 == j ^ (m & 15); m & 16 is set for rows r % 4 >= 2
                part[j % 2] += kk_s[r0 + r, r0 + ((r % 4) // 2) * flip + (j ^ ((r % 2) * 8 + (r // 4) % 2))] * x[j]
            x[r] = T.if_then_else(
                r == c, 1.0, T.if_then_else(r < c, 0.0, -b_s[hp, r0 + r] * (part[0] + part[1]))
            )

    @T.macro
    def merge32_in_registers_product(kk_s, b_s, d_s, x32_s, u, tx, fh, bh, fc32):
        # merge32_registers, on warps 2 and 3 (rows 16 w ..): X = L21 A11 of every head of pair u into x32_s; A11's
        # columns 16-31 are zero in its rows 0-15, so the n-tiles 2 and 3 take the second k-step only
        w = tx // 32
        gq = (tx % 32) // 4
        tq = tx % 4
        r0 = 16 * w
        for p in T.unroll(pair):
            for i in T.unroll(16):
                fc32[i] = 0.0
            for ks in T.unroll(2):
                l_fragment(fh, b_s, kk_s, u * pair + p, r0, 16 * ks, gq, tq)
                for nt in T.unroll(4):
                    if ks == 1 or nt < 2:
                        mma_fp16(fh, bh, fc32, nt, gq, tq, lambda k_, n: d_s[p, 0, 16 * ks + k_, n])
            for nt in T.unroll(4):
                for i in T.unroll(4):
                    x32_s[p, r0 - B + gq + 8 * (i // 2), 8 * nt + c_col(tq, i)] = fc32[4 * nt + i]

    @T.macro
    def merge32_in_registers_finish(x32_s, tx, xr, ar, fh, bh, fc32, p):
        # A22 X of head p on warps 2 and 3 (their 16 rows of A22: warp 2's are D_2 and zeros, warp 3's A21' and D_3)
        w = tx // 32
        gq = (tx % 32) // 4
        tq = tx % 4
        for i in T.unroll(16):
            fc32[i] = 0.0
        for ks in T.unroll(2):
            if ks == 1 or w == 3:
                for rh in T.unroll(2):
                    for cc in T.unroll(4):
                        fh[a_slot(rh, cc)] = T.cast(T.if_then_else(
                            ks == 0, ar[8 * p + 4 * rh + cc], xr[8 * p + 4 * rh + cc]), "float16")
                for nt in T.unroll(4):
                    # warp 2's only k-step is its D_2 against X's rows 0-15; warp 3's are A21' against rows 0-15 and
                    # D_3 against rows 16-31
                    mma_fp16(fh, bh, fc32, nt, gq, tq, lambda k_, n: x32_s[p, 16 * (ks * (w - 2)) + k_, n])

    def warp_block(tx):
        # the 32x32 diagonal block whose 16x16 merge this thread's warp does: (warp, head p of the pair, block d; in
        # the 32x32 merge, d is the warp's half of head p's rows or columns), and the lane's mma.m16n8k8 coordinates
        # (g = lane / 4, t = lane % 4): fragments a_i = (g + 8 (i % 2), t + 4 (i / 2)), b_i = (t + 4 i, g),
        # c_i = (g + 8 (i / 2), 2 t + i % 2)
        w = tx // 32
        return w, w // 2, w % 2, (tx % 32) // 4, tx % 4

    @T.macro
    def mma_tf32(fa, fb, fc, c_offset):
        # fc[c_offset : c_offset + 4] += a b for one mma.m16n8k8 on this warp's fragments (fp32 bits read as tf32)
        warp_mma("m16n8k8", "tf32", fa, fb, fc, c_offset)

    @T.macro
    def mma16(fa, fb, fc, gq, tq, a_at, b_at, skip_upper_b):
        # fc = a b for 16x16 tiles read element-wise by a_at(row, col) and b_at(row, col), k in two steps of 8, n in
        # two tiles of 8; with skip_upper_b, b's rows 0-7 are zero in columns 8-15 (a lower triangle) and skipped
        for i in T.unroll(8):
            fc[i] = 0.0
        for ks in T.unroll(2):
            for i in T.unroll(4):
                fa[i] = a_at(gq + 8 * (i % 2), tq + 4 * (i // 2) + 8 * ks)
            for nt in T.unroll(2):
                if not skip_upper_b or ks == 1 or nt == 0:
                    fb[0] = b_at(tq + 8 * ks, gq + 8 * nt)
                    fb[1] = b_at(tq + 4 + 8 * ks, gq + 8 * nt)
                    mma_tf32(fa, fb, fc, nt * 4)

    @T.macro
    def merge16_product(u, b_s, kk_s, d_s, x16_s, fa, fb, fc, tx):
        # X = L21' A11' for this warp's 32x32 diagonal block, into x16_s[warp]
        w, p, d, gq, tq = warp_block(tx)
        R = d * B + H  # L21''s first row in the chunk
        mma16(fa, fb, fc, gq, tq, lambda r, c: b_s[u * pair + p, R + r] * kk_s[R + r, kk_col(R + r, d * B + c)],
              lambda r, c: d_s[p, d, r, c], True)
        for c in T.unroll(8):
            x16_s[w, gq + 8 * ((c % 4) // 2), 8 * (c // 4) + 2 * tq + c % 2] = fc[c]

    @T.macro
    def merge16_finish(d_s, x16_s, fa, fb, fc, tx):
        # A21' = -A22' X into the 32x32 block's lower left
        w, p, d, gq, tq = warp_block(tx)
        mma16(fa, fb, fc, gq, tq, lambda r, c: d_s[p, d, H + r, H + c], lambda r, c: x16_s[w, r, c], False)
        for c in T.unroll(8):
            d_s[p, d, H + gq + 8 * ((c % 4) // 2), 8 * (c // 4) + 2 * tq + c % 2] = -fc[c]

    @T.macro
    def merge32_product(u, b_s, kk_s, d_s, x32_s, fa, fb, fc, tx):
        # X = L21 A11 of head p, rows 16 h2 + (0..15): this warp's half. A11[k, n] = 0 for k < n, so the n-tile nt
        # needs the k-steps from nt on
        w, p, h2, gq, tq = warp_block(tx)
        for i in T.unroll(16):
            fc[i] = 0.0
        for ks in T.unroll(4):
            for i in T.unroll(4):
                rr = B + 16 * h2 + gq + 8 * (i % 2)
                fa[i] = b_s[u * pair + p, rr] * kk_s[rr, kk_col(rr, tq + 4 * (i // 2) + 8 * ks)]
            for nt in T.unroll(4):
                if nt <= ks:
                    fb[0] = d_s[p, 0, tq + 8 * ks, gq + 8 * nt]
                    fb[1] = d_s[p, 0, tq + 4 + 8 * ks, gq + 8 * nt]
                    mma_tf32(fa, fb, fc, nt * 4)
        for c in T.unroll(16):
            xr = 16 * h2 + gq + 8 * ((c % 4) // 2)
            x32_s[p, xr, 8 * (c // 4) + 2 * tq + c % 2] = fc[c]

    @T.macro
    def merge32_finish(d_s, x32_s, fa, fb, fc, tx):
        # A22 X of head p, columns 16 h2 + (0..15): this warp's half, in fc (m-tile mt, n-tile nt at 4 (2 mt + nt));
        # A22's rows 16 mt + (0..15) are zero from column 16 (mt + 1) on
        w, p, h2, gq, tq = warp_block(tx)
        for i in T.unroll(16):
            fc[i] = 0.0
        for mt in T.unroll(2):
            for ks in T.unroll(4):
                if ks < 2 * mt + 2:
                    for i in T.unroll(4):
                        fa[i] = d_s[p, 1, 16 * mt + gq + 8 * (i % 2), tq + 4 * (i // 2) + 8 * ks]
                    for nt in T.unroll(2):
                        xc = 16 * h2 + 8 * nt + gq
                        fb[0] = x32_s[p, tq + 8 * ks, xc]
                        fb[1] = x32_s[p, tq + 4 + 8 * ks, xc]
                        mma_tf32(fa, fb, fc, (2 * mt + nt) * 4)

    @T.macro
    def merge32_store(x32_s, fc, tx):
        # A21 = -(A22 X) over X, once every warp's reads of X are done
        w, p, h2, gq, tq = warp_block(tx)
        for c in T.unroll(16):  # c = 4 (2 mt + nt) + i
            ar = 16 * (c // 8) + gq + 8 * ((c % 4) // 2)
            ac = 16 * h2 + 8 * ((c // 4) % 2) + 2 * tq + c % 2
            x32_s[p, ar, ac] = -fc[c]

    @T.macro
    def merge_a21(u, p, b_s, kk_s, d_s, l21_s, t_s, m_f):
        # m_f = A22 (L21 A11) for head p of pair u (A21 is its negative), tf32 tensor cores on the blocks in place
        for r, c2 in T.Parallel(B, B):
            l21_s[r, c2] = b_s[u * pair + p, B + r] * kk_s[B + r, kk_col(B + r, c2)]
        T.gemm(l21_s, d_s[p, 0, :, :], m_f, clear_accum=True)
        T.copy(m_f, t_s)
        T.gemm(d_s[p, 1, :, :], t_s, m_f, clear_accum=True)

    @T.macro
    def gate_head(Ag, A_out, slot, h, u, p, d_s, a21, b_s, gc_s):
        # Ag (and A) of value head h + p, block by block (as in the kernel body for a whole pair)
        hp = u * pair + p
        for i, j in T.Parallel(B, B):
            Ag[slot, h + p, i, j] = gated(d_s[p, 0, i, j], b_s, gc_s, hp, i, j)
        for i, j in T.Parallel(B, B):
            Ag[slot, h + p, B + i, j] = gated(a21[i, j], b_s, gc_s, hp, B + i, j)
        for i, j in T.Parallel(B, B):
            Ag[slot, h + p, B + i, B + j] = gated(d_s[p, 1, i, j], b_s, gc_s, hp, B + i, B + j)
        for i, j in T.Parallel(B, B):
            Ag[slot, h + p, i, B + j] = T.cast(0, a_dtype)
        if store_inverse:
            for i, j in T.Parallel(B, B):
                A_out[slot, h + p, i, j] = T.cast(d_s[p, 0, i, j], a_dtype)
                A_out[slot, h + p, B + i, j] = T.cast(a21[i, j], a_dtype)
                A_out[slot, h + p, B + i, B + j] = T.cast(d_s[p, 1, i, j], a_dtype)
                A_out[slot, h + p, i, B + j] = T.cast(0, a_dtype)

    @T.macro
    def gate_pair(Ag, A_out, slot, h, u, d_s, a21_at, b_s, gc_s):
        # Ag = Gam ⊙ A ⊙ beta^T (and A) of both heads of pair u, block by block, stored as it is formed; A21 is read
        # by a21_at(p, i, j) from wherever the merge left it
        for p, i, j in T.Parallel(pair, B, B):
            Ag[slot, h + p, i, j] = gated(d_s[p, 0, i, j], b_s, gc_s, u * pair + p, i, j)
        for p, i, j in T.Parallel(pair, B, B):
            Ag[slot, h + p, B + i, j] = gated(a21_at(p, i, j), b_s, gc_s, u * pair + p, B + i, j)
        for p, i, j in T.Parallel(pair, B, B):
            Ag[slot, h + p, B + i, B + j] = gated(d_s[p, 1, i, j], b_s, gc_s, u * pair + p, B + i, B + j)
        for p, i, j in T.Parallel(pair, B, B):
            Ag[slot, h + p, i, B + j] = T.cast(0, a_dtype)
        if store_inverse:
            for p, i, j in T.Parallel(pair, B, B):
                A_out[slot, h + p, i, j] = T.cast(d_s[p, 0, i, j], a_dtype)
                A_out[slot, h + p, B + i, j] = T.cast(a21_at(p, i, j), a_dtype)
                A_out[slot, h + p, B + i, B + j] = T.cast(d_s[p, 1, i, j], a_dtype)
                A_out[slot, h + p, i, B + j] = T.cast(0, a_dtype)

    @T.macro
    def chunk_inject_terms(v, slot, t0, n_rows, hq, kk_s, g_s, b_s, vn_s, vh_s, lu_s, lc_s, mg_s, lj, vr,
                           chunk_inject, tx):
        # |v_t|^2 per row and value head of the group, from global memory into registers: two threads a row, each
        # half a row in 16-byte vectors (no staged tile: one shared with the loop over heads would need to outlive
        # an iteration, which the shared-memory merge does not see)
        for p in T.serial(group):
            lj[2] = 0.0
            if tx // 2 < n_rows:
                for c in T.unroll(K // 16):
                    for e in T.vectorized(8):
                        vr[e] = v[0, t0 + tx // 2, hq * group + p, (tx % 2) * (K // 2) + 8 * c + e]
                    for e in T.unroll(8):
                        lj[1] = T.cast(vr[e], acc)
                        lj[2] = lj[2] + lj[1] * lj[1]
            if tx % 2 == 0:
                vn_s[p, tx // 2] = lj[2]
            else:
                vh_s[p, tx // 2] = lj[2]
        T.sync_threads()
        # per row and head: log |beta| |k| |v| (-inf where nothing is injected or past the rows), and the row's log
        # factor g + growth whose suffix over the later rows carries it to the chunk's end
        for p, i in T.Parallel(group, C):
            lu_s[p, i] = g_s[p, i] + T.max(T.log(T.abs(1.0 - b_s[p, i] * kk_s[i, kk_col(i, i)])), T.float32(0))
            vn_s[p, i] = T.if_then_else(
                i < n_rows, T.log(T.abs(b_s[p, i])) + 0.5 * T.log(kk_s[i, kk_col(i, i)] * (vn_s[p, i] + vh_s[p, i])),
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
                lj[0] = vn_s[p, lane] + (lc_s[p, C - 1] - lc_s[p, lane])
                lj[1] = vn_s[p, lane + 32] + (lc_s[p, C - 1] - lc_s[p, lane + 32])
                pair_logsumexp(lj, 0, 1, 2, 3, 4)
                if lane == 0:
                    # rounded up as the chunk's bound is (mg_s: this head's margin, made with it)
                    chunk_inject[hq * group + p, slot] = T.if_then_else(
                        lj[2] > 0, T.float32(float("nan")), T.if_then_else(
                            lj[3] > -T.infinity(acc), lj[3] + T.log(lj[4]) + mg_s[p], lj[3]))

    @T.macro
    def kernel_body(k, g, beta, bounds, gcum, Ag, A_out, chunk_bound=None, v=None, chunk_inject=None, tr=None):
        with T.Kernel(num_slots, Hqk, threads=128) as (slot, hq):
            T.annotate_min_blocks_per_sm(blocks_per_sm)
            t0 = bounds[slot, 0]
            n_rows = bounds[slot, 1]

            k_s = T.alloc_shared((C, K), qk_dtype)
            kk_f = T.alloc_fragment((C, C), acc)
            kk_s = T.alloc_shared((C, C), acc)
            g_s = T.alloc_shared((group, C), acc)
            gc_s = T.alloc_shared((group, C), acc)
            b_s = T.alloc_shared((group, C), acc)
            # the inverse of a head pair as blocks: 0 = A11, 1 = A22, 2 = A21 (A12 = 0)
            d_s = T.alloc_shared((pair, 2 if five or mma32 else 3, B, B), acc)
            if mma32:
                x32_s = T.alloc_shared((pair, B, B), acc)  # X = L21 A11, then A21 over it
                fc32 = T.alloc_local((16,), acc)
                # the layout T.gemm would give the blocks (16-byte groups XOR-ed by row): the mma fragments' element
                # reads fall on distinct banks and the gating still reads 16 bytes at a time
                T.annotate_layout({d_s: tilelang.layout.make_swizzled_layout(d_s),
                                   x32_s: tilelang.layout.make_swizzled_layout(x32_s)})
            else:
                l21_s = T.alloc_shared((B, B), acc)
                t_s = T.alloc_shared((B, B), acc)
                m_f = T.alloc_fragment((B, B), acc)
            x = T.alloc_local((B,), acc)
            part = T.alloc_local((2,), acc)
            if chunk_bounds:
                lg = T.alloc_local((3,), acc)  # decay, growth, sum of |g|
            if chunk_injects:
                vn_s = T.alloc_shared((group, C), acc)  # |v_t|^2 by halves, then log |beta_t| |k_t| |v_t|
                vh_s = T.alloc_shared((group, C), acc)
                lu_s = T.alloc_shared((group, C), acc)  # per row: g + growth, then their inclusive cumsum
                lc_s = T.alloc_shared((group, C), acc)
                mg_s = T.alloc_shared((group,), acc)  # per head: the chunk bound's rounding margin
                lj = T.alloc_local((5,), acc)  # a lane's two terms, then the NaN flag, the max, the sum
                vr = T.alloc_local((8,), qk_dtype)  # 8 values of a v row
            if diag16:
                x16_s = T.alloc_shared((4, H, H), acc)  # a warp's L21' A11'
                fa = T.alloc_local((4,), acc)
                fb = T.alloc_local((2,), acc)
                fc = T.alloc_local((8,), acc)
            if registers16:
                kr = T.alloc_local((8,), acc)  # K K^T at the lane's 8 places of its warp's block
                xr = T.alloc_local((8 * pair,), acc)  # the block's inverse there, per head of the pair
                br = T.alloc_local((2 * pair,), acc)  # beta of the lane's two rows, per head
                xj = T.alloc_local((4,), acc)  # row j at the lane's four columns
                kj = T.alloc_local((4,), acc)  # (K K^T)_ij of the lane's two rows, then their factors
            if merge16_registers or merge32_quadrants or registers8:
                fh = T.alloc_local((8,), "float16")  # an mma.m16n8k16 A fragment
                bh = T.alloc_local((4,), "float16")  # and a B fragment
            if merge16_registers or registers8:
                ft = T.alloc_local((8,), acc)  # X^T's (Z^T's) C fragments, the second product's B
            ar = T.alloc_local((8 * pair,), acc) if merge16_registers else None  # an odd warp's A21', per head

            tx = T.get_thread_binding()

            stamp(tr, slot, hq, 0, tx)
            if n_rows > 0:
                if async_loads:
                    T.async_copy(k[0, t0:t0 + C, hq, :], k_s)
                else:
                    for i, j in T.Parallel(C, K):
                        k_s[i, j] = T.if_then_else(i < n_rows, k[0, t0 + i, hq, j], T.cast(0, qk_dtype))
                # the gates of the whole group at once (contiguous in g and beta)
                for i, p in T.Parallel(C, group):
                    g_s[p, i] = T.if_then_else(i < n_rows, g[0, t0 + i, hq * group + p], 0.0)
                    b_s[p, i] = T.if_then_else(i < n_rows, beta[0, t0 + i, hq * group + p], 0.0)
                if async_loads:
                    T.ptx_wait_group(0)
                    T.sync_threads()
                    stamp(tr, slot, hq, 1, tx)
                    if n_rows < C:  # rows of the next sequence (or zeros past the tensor's end)
                        for i, j in T.Parallel(C, K):
                            if i >= n_rows:
                                k_s[i, j] = T.cast(0, qk_dtype)
                T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    kk_s[i, kk_col(i, j)] = kk_f[i, j]
                T.cumsum(g_s, gc_s, dim=1)
                for p, i in T.Parallel(group, C):
                    gcum[hq * group + p, slot * C + i] = gc_s[p, i]
                if chunk_bounds:
                    T.sync_threads()  # K K^T, beta and the cumsum are other threads' writes
                    if tx < group:
                        lg[1] = 0.0
                        lg[2] = 0.0
                        for i in T.unroll(C):
                            # log |1 - beta |k|^2|, clamped at 0 from below; NaN passes (NaN < 0 is false)
                            lt = T.log(T.abs(1.0 - b_s[tx, i] * kk_s[i, kk_col(i, i)]))
                            lg[1] = lg[1] + T.if_then_else(lt < 0.0, T.float32(0), lt)
                            lg[2] = lg[2] + T.abs(g_s[tx, i])
                        lg[0] = gc_s[tx, C - 1]
                        chunk_bound[hq * group + tx, slot] = lg[0] + lg[1] + (lg[2] + lg[1]) * T.float32(
                            CHUNK_BOUND_REL) + T.float32(CHUNK_BOUND_ABS)
                        if chunk_injects:
                            mg_s[tx] = (lg[2] + lg[1]) * T.float32(CHUNK_BOUND_REL) + T.float32(CHUNK_BOUND_ABS)
                    if chunk_injects:
                        chunk_inject_terms(v, slot, t0, n_rows, hq, kk_s, g_s, b_s, vn_s, vh_s, lu_s, lc_s, mg_s, lj,
                                           vr, chunk_inject, tx)

                for u in T.serial(group // pair):
                    h = hq * group + u * pair  # first value head of this pair

                    # diagonal blocks: thread -> (head p, block d, column c); column c of the block in x
                    T.sync_threads()
                    if u == 0:
                        stamp(tr, slot, hq, 2, tx)
                    if diag16:
                        # thread -> head tx / 64 of the pair, 16x16 block q, column; with an odd group (one head at
                        # a time) the upper 64 threads wait at the barriers, which stay outside the branches
                        if registers16:  # (or a warp a block, every head of the pair, all four warps)
                            ri.eliminate16(kk_s, b_s, d_s, u, tx, kr, xr, br, xj, kj)
                            if registers8:
                                ri.merge8_in_registers(kk_s, b_s, d_s, u, tx, xr, fh, bh, fc, ft)
                        elif tx < 64 * pair:
                            for r in T.unroll(H):
                                x[r] = 0.0
                            sp = tx // 64
                            sq = (tx // 16) % 4
                            sc = tx % H
                            substitute16(x, part, kk_s, b_s, u * pair + sp, sq * H, sc)
                            # the column's other half: zeros, the 32x32 block's upper right for an odd q (its lower
                            # left, written by the merge below, for an even one)
                            for r in T.unroll(H):
                                d_s[sp, sq // 2, (sq % 2) * H + r, (sq % 2) * H + sc] = x[r]
                                d_s[sp, sq // 2, H - (sq % 2) * H + r, (sq % 2) * H + sc] = 0.0
                        T.sync_threads()
                        if u == 0:
                            stamp(tr, slot, hq, 3, tx)
                        if merge16_registers:
                            ri.merge16_in_registers(kk_s, b_s, d_s, u, tx, xr, fh, bh, fc, ft, ar)
                        else:
                            if tx < 64 * pair:
                                merge16_product(u, b_s, kk_s, d_s, x16_s, fa, fb, fc, tx)
                            T.sync_threads()
                            if tx < 64 * pair:
                                merge16_finish(d_s, x16_s, fa, fb, fc, tx)
                    elif tx < 64 * pair:
                        for r in T.unroll(B):
                            x[r] = 0.0
                        sp = sub_head(tx)
                        sd = sub_block(tx)
                        sc = sub_column(tx)
                        r0 = sd * B
                        if triangle and tx >= 32 * pair:
                            substitute(x, part, kk_s, b_s, u * pair + sp, r0, sc, H)  # rows above H are zero
                        else:
                            substitute(x, part, kk_s, b_s, u * pair + sp, r0, sc, 0)
                        for r in T.unroll(B):
                            d_s[sp, sd, r, sc] = x[r]
                    T.sync_threads()
                    if u == 0:
                        stamp(tr, slot, hq, 4, tx)

                    if mma32:
                        if merge32_quadrants:
                            # a quadrant a warp, every head of the pair: X, then A21 = -A22 X over it
                            ri.merge32_quadrant_product(kk_s, b_s, d_s, x32_s, u, tx, fh, bh, fc32)
                            T.sync_threads()
                            ri.merge32_quadrant_finish(d_s, x32_s, tx, fh, bh, fc32)
                            T.sync_threads()  # every warp's reads of X are done
                            ri.merge32_quadrant_store(x32_s, tx, fc32)
                            T.sync_threads()
                        elif merge32_registers:
                            # on warps 2 and 3, from their registers: X of every head, then head by head A22 X,
                            # stored over X once every warp has read it
                            if tx >= 64:
                                merge32_in_registers_product(kk_s, b_s, d_s, x32_s, u, tx, fh, bh, fc32)
                            T.sync_threads()
                            for mp in T.unroll(pair):
                                if tx >= 64:
                                    merge32_in_registers_finish(x32_s, tx, xr, ar, fh, bh, fc32, mp)
                                T.sync_threads()
                                if tx >= 64:
                                    for nt in T.unroll(4):
                                        for i in T.unroll(4):
                                            x32_s[mp, 16 * (tx // 32) - B + (tx % 32) // 4 + 8 * (i // 2),
                                                  8 * nt + c_col(tx % 4, i)] = -fc32[4 * nt + i]
                            T.sync_threads()
                        else:
                            # both heads at once, two warps each: X, then A21 = -A22 X over it (barriers outside
                            # the branches: an odd group's upper 64 threads only wait)
                            if tx < 64 * pair:
                                merge32_product(u, b_s, kk_s, d_s, x32_s, fa, fb, fc32, tx)
                            T.sync_threads()
                            if tx < 64 * pair:
                                merge32_finish(d_s, x32_s, fa, fb, fc32, tx)
                            T.sync_threads()  # every warp's reads of X are done
                            if tx < 64 * pair:
                                merge32_store(x32_s, fc32, tx)
                            T.sync_threads()
                        if u == 0:
                            stamp(tr, slot, hq, 5, tx)
                        gate_pair(Ag, A_out, slot, h, u, d_s, lambda p, i, j: x32_s[p, i, j], b_s, gc_s)
                        if trace:
                            T.sync_threads()
                            if u == 0:
                                stamp(tr, slot, hq, 6, tx)
                    elif five:
                        # per head: A21 = -A22 (L21 A11) into the merge's second tile, then the head's Ag (and A)
                        for p in T.serial(pair):
                            merge_a21(u, p, b_s, kk_s, d_s, l21_s, t_s, m_f)
                            T.sync_threads()  # every warp's reads of t_s in the product are done
                            for r, c2 in T.Parallel(B, B):
                                t_s[r, c2] = -m_f[r, c2]
                            T.sync_threads()
                            gate_head(Ag, A_out, slot, h, u, p, d_s, t_s, b_s, gc_s)
                            T.sync_threads()  # t_s read by the gating before the next head's merge writes it
                    else:
                        # off-diagonal blocks: A21 = -A22 (L21 A11)
                        for p in T.serial(pair):
                            merge_a21(u, p, b_s, kk_s, d_s, l21_s, t_s, m_f)
                            for r, c2 in T.Parallel(B, B):
                                d_s[p, 2, r, c2] = -m_f[r, c2]

                        gate_pair(Ag, A_out, slot, h, u, d_s, lambda p, i, j: d_s[p, 2, i, j], b_s, gc_s)

    if store_inverse and chunk_injects:

        @T.prim_func
        def kkt_inverse_kernel(
            k: T.Tensor((1, num_tokens, Hqk, K), qk_dtype),
            g: T.Tensor((1, num_tokens, Hv), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            v: T.Tensor((1, num_tokens, Hv, K), qk_dtype),
            bounds: T.Tensor((num_slots, 2), "int32"),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), a_dtype),
            A_out: T.Tensor((num_slots, Hv, C, C), a_dtype),
            chunk_bound: T.Tensor((Hv, num_slots), "float32"),
            chunk_inject: T.Tensor((Hv, num_slots), "float32"),
        ):
            kernel_body(k, g, beta, bounds, gcum, Ag, A_out, chunk_bound, v, chunk_inject)

    elif chunk_injects:

        @T.prim_func
        def kkt_inverse_kernel(
            k: T.Tensor((1, num_tokens, Hqk, K), qk_dtype),
            g: T.Tensor((1, num_tokens, Hv), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            v: T.Tensor((1, num_tokens, Hv, K), qk_dtype),
            bounds: T.Tensor((num_slots, 2), "int32"),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), a_dtype),
            chunk_bound: T.Tensor((Hv, num_slots), "float32"),
            chunk_inject: T.Tensor((Hv, num_slots), "float32"),
        ):
            kernel_body(k, g, beta, bounds, gcum, Ag, Ag, chunk_bound, v, chunk_inject)

    elif store_inverse and chunk_bounds:

        @T.prim_func
        def kkt_inverse_kernel(
            k: T.Tensor((1, num_tokens, Hqk, K), qk_dtype),
            g: T.Tensor((1, num_tokens, Hv), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            bounds: T.Tensor((num_slots, 2), "int32"),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), a_dtype),
            A_out: T.Tensor((num_slots, Hv, C, C), a_dtype),
            chunk_bound: T.Tensor((Hv, num_slots), "float32"),
        ):
            kernel_body(k, g, beta, bounds, gcum, Ag, A_out, chunk_bound)

    elif chunk_bounds:

        @T.prim_func
        def kkt_inverse_kernel(
            k: T.Tensor((1, num_tokens, Hqk, K), qk_dtype),
            g: T.Tensor((1, num_tokens, Hv), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            bounds: T.Tensor((num_slots, 2), "int32"),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), a_dtype),
            chunk_bound: T.Tensor((Hv, num_slots), "float32"),
        ):
            kernel_body(k, g, beta, bounds, gcum, Ag, Ag, chunk_bound)

    elif store_inverse:

        @T.prim_func
        def kkt_inverse_kernel(
            k: T.Tensor((1, num_tokens, Hqk, K), qk_dtype),
            g: T.Tensor((1, num_tokens, Hv), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            bounds: T.Tensor((num_slots, 2), "int32"),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), a_dtype),
            A_out: T.Tensor((num_slots, Hv, C, C), a_dtype),
        ):
            kernel_body(k, g, beta, bounds, gcum, Ag, A_out)

    elif trace:

        @T.prim_func
        def kkt_inverse_kernel(
            k: T.Tensor((1, num_tokens, Hqk, K), qk_dtype),
            g: T.Tensor((1, num_tokens, Hv), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            bounds: T.Tensor((num_slots, 2), "int32"),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), a_dtype),
            tr: T.Tensor((num_slots, Hqk, TRACE_POINTS), "int64"),
        ):
            kernel_body(k, g, beta, bounds, gcum, Ag, Ag, tr=tr)

    else:

        @T.prim_func
        def kkt_inverse_kernel(
            k: T.Tensor((1, num_tokens, Hqk, K), qk_dtype),
            g: T.Tensor((1, num_tokens, Hv), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            bounds: T.Tensor((num_slots, 2), "int32"),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), a_dtype),
        ):
            kernel_body(k, g, beta, bounds, gcum, Ag, Ag)

    configs = pass_configs()
    # k_s is dead once K K^T is formed: its space is reused
    configs[tilelang.PassConfigKey.TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE] = True
    return tilelang.compile(kkt_inverse_kernel, out_idx=None, target=TARGET, pass_configs=configs)
