"""Context parallelism's splice in one kernel: every segment's start state (forward) or end gradient (backward).

Math (``flashgdn/cp/exact.py`` and ``flashgdn/cp/backward.py``), per sequence, its segments first to last:

    forward:   S_first = h0;  S_{first+1} = b_first (its b already starts from h0);  S_{i+1} = M_i S_i + b_i
    backward:  E_last = d(final state);  E_{i-1} = M_i^T E_i + D_i      (last to first)

with ``M_i`` (K x K) and ``b_i`` from the transition pass's pairs (``[segments, 2 Hv, K, V]``: head 2h the b of
value head h, head 2h + 1 its M) and ``D_i`` the walk of segment i from a zero end gradient. The torch splice does
one step for all sequences at once with three small kernels (gather, batched product, scatter), ~13 us per step on
the H200 (``flashgdn/cp/plan.py``); here one launch does every step.

One CTA per (sequence, value head, block of BV state columns: V / BV x Hv x N CTAs), float32 throughout (as the
torch splice: no TF32): per step M (transposed for the forward) and the state block go to shared memory, then
``state = b + M S`` by CUDA-core FMAs over K. Each step is a dependent chain, so the kernel's time is the number of
steps times one step's latency: a 64 KB load of M from L2 (where the transition pass just wrote it) and
128 x BV x K FMAs on one SM. Two builds:

- plain: BV = 8, 128 threads, 8 outputs a thread; M stored transposed into padded rows. Bound by the SM's shared
  memory pipe (~0.4 shared loads per FMA, 4-way conflicted stores of M, one warp per sub-partition).
- ``blocked`` (reverse only, its default: ``forward.SPLICE_BLOCKED``): 512 threads in four K-groups, each thread a
  4 x BV / 4 block of its group's partial sums from one float4 of M^T and BV / 4 state values per k; M stored
  without bank conflicts and the next step's M loaded during this one's products; BV 8, or 16 where the grid of 8
  would not fit the SMs (``forward.splice_width``: one CTA per SM for its ~150-170 KB of shared memory; 32 builds
  too). The forward needs M's transpose in shared memory, and a blocked forward build that transposed it (by
  scalar stores, then by 4 x 4 register transposes) was slower than plain (notes v0.16e, v0.16h).

``chains`` (forward, plain): the splice of a backward that starts from the forward's segment starts
(``flashgdn.cp.exact.starts_from_known``) runs on chains of segments, each from a known start; a chain that
begins inside its sequence (``from_known[n]`` nonzero) takes its first step as ``M_first start + b_first`` (its b
was walked from a zero start), one at the sequence's start as above.

PyTorch counterparts: ``flashgdn.cp.exact.splice_segments`` and ``flashgdn.cp.backward.splice_reverse``.
"""

from .common import TARGET, kernel_cache, pass_configs


@kernel_cache
def build_splice(Hv: int, K: int, V: int, reverse: bool, BV: int = 8, blocked: bool = False, chains: bool = False,
                 m_zero: bool = False):
    """Compile (or load) the kernel: ``blocked`` the reverse's register-blocked build (``blocked_steps``, BV in 8,
    16, 32), else the plain one (``plain_steps``, BV = 8); ``chains`` the forward's plain build with the chains'
    ``from_known`` flags; ``m_zero`` (any build) with the transition pass's flags of the M it stored as zero, whose
    steps are then their own term alone (b, or D), with no load of M and no product. Arguments, in order:

      pairs   [S, 2 Hv, K, V]  float32: head 2h + 1 is M (V = K), head 2h the forward's b
      D       [S, Hv, K, V]    float32: the backward's D (read only when ``reverse``; any such tensor otherwise)
      start   [N, Hv, K, V]    float32: h0 (forward) or d(final state) (backward)
      first   [N] int64, count [N] int64: each sequence's first segment and its number of segments
      from_known [N] int64     (``chains`` only): nonzero where the chain's first step multiplies its M
      m_zero  [S, Hv] int32    (``m_zero`` only): nonzero where the segment's M is zero (its step is b, or D)
      out     [S, Hv, K, V]    float32, written: every segment's start state (forward) / end gradient (backward)
    """
    import tilelang
    import tilelang.language as T

    assert K == V, "the transitions M come from the pairs, which need V = K"
    assert V % BV == 0
    assert not blocked or BV in (8, 16, 32), "the blocked build's columns: 8, 16 or 32"
    assert not blocked or reverse, "the blocked build is the reverse splice's"
    assert not chains or not (reverse or blocked), "chains are the forward's plain build"
    num_segments = T.dynamic("num_segments")
    num_d = T.dynamic("num_d")
    num_seqs = T.dynamic("num_seqs")
    acc = "float32"

    GROUPS = 4  # ``blocked``: K-groups of 128 threads
    KG = K // GROUPS  # each group's share of the sum over K
    CW = BV // 4  # ``blocked``: a thread's columns
    MQ = K * K // 4 // (128 * GROUPS)  # ``blocked``: float4s of M a thread loads a step

    @T.macro
    def plain_multiply(pairs, D, m_s, s_s, s_f, h, c0, src):
        for a, b in T.Parallel(K, K):
            # forward: m_s[k][r] = M[r][k]; backward (M^T): m_s[k][r] = M^T[r][k] = M[k][r]
            if reverse:
                m_s[a, b] = pairs[src, 2 * h + 1, a, b]
            else:
                m_s[b, a] = pairs[src, 2 * h + 1, a, b]
        for r, j in T.Parallel(K, BV):
            s_s[r, j] = s_f[r, j]
        for r, j in T.Parallel(K, BV):
            s_f[r, j] = D[src, h, r, c0 + j] if reverse else pairs[src, 2 * h, r, c0 + j]
        for kk in T.serial(K):
            for r, j in T.Parallel(K, BV):
                s_f[r, j] = s_f[r, j] + m_s[kk, r] * s_s[kk, j]

    @T.macro
    def plain_first_b(pairs, s_f, h, c0, src):
        for r, j in T.Parallel(K, BV):
            s_f[r, j] = pairs[src, 2 * h, r, c0 + j]

    @T.macro
    def plain_own_term(pairs, D, s_f, h, c0, src):
        # a step whose M is zero: its own term alone (exactly what the product adds it to: b + 0, D + 0)
        for r, j in T.Parallel(K, BV):
            s_f[r, j] = D[src, h, r, c0 + j] if reverse else pairs[src, 2 * h, r, c0 + j]

    @T.macro
    def plain_steps(pairs, D, start, first, count, out, from_known, zero):
        with T.Kernel(V // BV, Hv, num_seqs, threads=128) as (vb, h, n):
            m_s = T.alloc_shared((K, K + 1), acc)  # [k][r]: the factor of state row k in output row r (padded)
            s_s = T.alloc_shared((K, BV), acc)
            s_f = T.alloc_fragment((K, BV), acc)
            # ``m_zero``: this step's flag and the next one's, loaded a step ahead (off the chain's critical path)
            zf = T.alloc_local((2,), "int32") if m_zero else None
            f = first[n]
            c = count[n]
            c0 = vb * BV
            # the first row of the chain is the sequence's own start (forward) or end (backward)
            row0 = f + c - 1 if reverse else f
            if m_zero:
                zf[1] = zero[row0, h]  # the first step's segment
            for r, j in T.Parallel(K, BV):
                s_f[r, j] = start[n, h, r, c0 + j]
            for r, j in T.Parallel(K, BV):
                out[row0, h, r, c0 + j] = s_f[r, j]
            for step in T.serial(c - 1):
                src = f + c - 1 - step if reverse else f + step  # the segment whose transition applies
                dst = src - 1 if reverse else src + 1
                if chains or m_zero:
                    # the last step's products still read m_s and s_s; TileLang's sync planner leaves this
                    # barrier out once the first step can multiply too (seen in the generated code), and a step
                    # without products may come between two with them
                    T.sync_threads()
                if m_zero:
                    zf[0] = zf[1]
                    # the next step's segment (past the last step: the chain's last segment again, never used)
                    zf[1] = zero[T.max(src - 1, f) if reverse else T.min(src + 1, f + c - 1), h]
                if m_zero and zf[0] != 0:
                    plain_own_term(pairs, D, s_f, h, c0, src)
                elif reverse or step > 0:
                    plain_multiply(pairs, D, m_s, s_s, s_f, h, c0, src)
                elif chains:
                    if from_known[n] != 0:  # a chain inside its sequence: its b was walked from zero
                        plain_multiply(pairs, D, m_s, s_s, s_f, h, c0, src)
                    else:
                        plain_first_b(pairs, s_f, h, c0, src)
                else:  # the forward's first step: b_first already starts from h0
                    plain_first_b(pairs, s_f, h, c0, src)
                for r, j in T.Parallel(K, BV):
                    out[dst, h, r, c0 + j] = s_f[r, j]

    @T.macro
    def load_m(pairs, m_r, tx, h, src):
        # M in float4s of its rows (M^T's columns, as the products read them), a warp's lanes along a row
        for i in T.serial(MQ):
            for e in T.vectorized(4):
                m_r[i * 4 + e] = pairs[src, 2 * h + 1, tx // 32 + i * (128 * GROUPS // 32), (tx % 32) * 4 + e]

    @T.macro
    def store_m(m_s, m_r, tx, buf):
        for i in T.serial(MQ):
            for e in T.vectorized(4):
                m_s[buf, tx // 32 + i * (128 * GROUPS // 32), (tx % 32) * 4 + e] = m_r[i * 4 + e]

    @T.macro
    def blocked_product(m_s, s_s, part_s, acc_r, mv, sv, d_r, grp, rg, cg, oe, org, ocol, buf):
        # d_r += (M^T E) for this thread's CW outputs: the K-groups' partial sums, then their sum in group order
        for i in T.serial(4 * CW):
            acc_r[i] = 0.0
        T.sync_threads()
        for kk in T.serial(KG):
            kglob = grp * KG + kk
            for e in T.vectorized(4):
                mv[e] = m_s[buf, kglob, rg * 4 + e]
            for j in T.vectorized(CW):
                sv[j] = s_s[kglob % 4, kglob // 4, cg * CW + j]
            for e in T.serial(4):
                for j in T.serial(CW):
                    acc_r[e * CW + j] = acc_r[e * CW + j] + mv[e] * sv[j]
        for e in T.serial(4):
            for j in T.vectorized(CW):
                part_s[grp, e, rg, cg * CW + j] = acc_r[e * CW + j]
        T.sync_threads()
        for g in T.serial(GROUPS):
            for j in T.vectorized(CW):
                sv[j] = part_s[g, oe, org, ocol + j]
            for j in T.serial(CW):
                d_r[j] = d_r[j] + sv[j]

    @T.macro
    def blocked_steps(pairs, D, start, first, count, out, zero):
        # ``blocked``: the plain step is bound by the SM's shared-memory pipe (MIO), not by its FMAs or its loads:
        # per FMA it issues ~0.4 shared loads (a scalar of M and half a float4 of the state for each of a thread's
        # 8 outputs), and M goes to shared memory transposed by 4-way conflicted scalar stores, on one warp per
        # SM sub-partition at ~3.8 cycles an instruction. Splitting K over more threads (the former split_k A/B)
        # left the loads per FMA and so the time as they were. Here each thread of a K-group makes a 4 x (BV / 4)
        # block of outputs from one float4 of M and BV / 4 state values per k (2 or 1 shared wavefronts a warp
        # for 8 or more FMAs); four K-groups of 128 threads share the sum over K (partial sums added in group
        # order), M goes to shared memory by conflict-free float4 stores, and the next step's M is loaded into
        # registers while this step's products are made.
        with T.Kernel(V // BV, Hv, num_seqs, threads=128 * GROUPS) as (vb, h, n):
            m_s = T.alloc_shared((2, K, K), acc)  # two steps' [k][r] factors of state row k in output row r
            # the chain's state block and the groups' partial sums, row k at [k % 4, k // 4]: a warp's partial sums
            # (8 row blocks x 4 column blocks) are then one contiguous run, and so are the final sums it reads back
            s_s = T.alloc_shared((4, K // 4, BV), acc)
            part_s = T.alloc_shared((GROUPS, 4, K // 4, BV), acc)
            m_r = T.alloc_local((MQ * 4,), acc)  # the next step's M on its way to shared memory
            acc_r = T.alloc_local((4 * CW,), acc)  # this thread's 4 x CW block of a group's partial sums
            mv = T.alloc_local((4,), acc)
            sv = T.alloc_local((CW,), acc)
            d_r = T.alloc_local((CW,), acc)  # the output's own term (D or b) for this thread's CW outputs
            zf = T.alloc_local((3,), "int32") if m_zero else None  # ``m_zero``: this step's flag and the next two
            tx = T.get_thread_binding()
            grp = tx // 128
            t = tx % 128
            rg = (t // 32) * 8 + t % 8  # rows 4 rg .. 4 rg + 3: 8 row blocks and 4 column blocks a warp
            cg = (t % 32) // 8  # columns cg CW .. cg CW + CW - 1
            # the final sums: CW of them a thread, at flat [k % 4, k // 4, column] position tx CW
            oe = (tx * CW) // (K // 4 * BV)
            org = (tx * CW) % (K // 4 * BV) // BV
            orow = org * 4 + oe
            ocol = (tx * CW) % BV
            f = first[n]
            c = count[n]
            c0 = vb * BV
            row0 = f + c - 1
            for j in T.vectorized(CW):
                sv[j] = start[n, h, orow, c0 + ocol + j]
            for j in T.vectorized(CW):
                s_s[oe, org, ocol + j] = sv[j]
                out[row0, h, orow, c0 + ocol + j] = sv[j]

            if m_zero:
                # a step whose M is zero neither loads M nor multiplies (nor waits at the step's barriers: every
                # product phase ends at a barrier of its own step, so the shared memory a later write reuses is read).
                # The flags of this step's segment and of the next one, loaded a step ahead (zf[2] on its way)
                zf[0] = zero[f + c - 1, h]
                zf[1] = zero[T.max(f + c - 2, f), h]
                if c - 1 > 0:
                    if zf[0] == 0:
                        load_m(pairs, m_r, tx, h, f + c - 1)
                        store_m(m_s, m_r, tx, 0)
            elif c - 1 > 0:
                load_m(pairs, m_r, tx, h, f + c - 1)
                store_m(m_s, m_r, tx, 0)
            for step in T.serial(c - 1):
                src = f + c - 1 - step
                dst = src - 1
                for j in T.vectorized(CW):
                    d_r[j] = D[src, h, orow, c0 + ocol + j]
                has_next = step + 1 < c - 1
                if m_zero:
                    buf = step % 2
                    zf[2] = zero[T.max(src - 2, f), h]
                    next_m = T.And(has_next, zf[1] == 0)
                    if next_m:
                        load_m(pairs, m_r, tx, h, src - 1)
                    if zf[0] == 0:
                        blocked_product(m_s, s_s, part_s, acc_r, mv, sv, d_r, grp, rg, cg, oe, org, ocol, buf)
                    if next_m:
                        store_m(m_s, m_r, tx, 1 - buf)
                    zf[0] = zf[1]
                    zf[1] = zf[2]
                else:
                    if has_next:
                        load_m(pairs, m_r, tx, h, src - 1)
                    buf = step % 2
                    blocked_product(m_s, s_s, part_s, acc_r, mv, sv, d_r, grp, rg, cg, oe, org, ocol, buf)
                    if has_next:
                        store_m(m_s, m_r, tx, 1 - buf)
                for j in T.vectorized(CW):
                    s_s[oe, org, ocol + j] = d_r[j]
                    out[dst, h, orow, c0 + ocol + j] = d_r[j]

    if chains and m_zero:
        @T.prim_func
        def splice_kernel(
            pairs: T.Tensor((num_segments, 2 * Hv, K, V), acc),
            D: T.Tensor((num_d, Hv, K, V), acc),
            start: T.Tensor((num_seqs, Hv, K, V), acc),
            first: T.Tensor((num_seqs,), "int64"),
            count: T.Tensor((num_seqs,), "int64"),
            from_known: T.Tensor((num_seqs,), "int64"),
            zero: T.Tensor((num_segments, Hv), "int32"),
            out: T.Tensor((num_segments, Hv, K, V), acc),
        ):
            plain_steps(pairs, D, start, first, count, out, from_known, zero)
    elif chains:
        @T.prim_func
        def splice_kernel(
            pairs: T.Tensor((num_segments, 2 * Hv, K, V), acc),
            D: T.Tensor((num_d, Hv, K, V), acc),
            start: T.Tensor((num_seqs, Hv, K, V), acc),
            first: T.Tensor((num_seqs,), "int64"),
            count: T.Tensor((num_seqs,), "int64"),
            from_known: T.Tensor((num_seqs,), "int64"),
            out: T.Tensor((num_segments, Hv, K, V), acc),
        ):
            plain_steps(pairs, D, start, first, count, out, from_known, None)
    elif m_zero:
        @T.prim_func
        def splice_kernel(
            pairs: T.Tensor((num_segments, 2 * Hv, K, V), acc),
            D: T.Tensor((num_d, Hv, K, V), acc),
            start: T.Tensor((num_seqs, Hv, K, V), acc),
            first: T.Tensor((num_seqs,), "int64"),
            count: T.Tensor((num_seqs,), "int64"),
            zero: T.Tensor((num_segments, Hv), "int32"),
            out: T.Tensor((num_segments, Hv, K, V), acc),
        ):
            if blocked:
                blocked_steps(pairs, D, start, first, count, out, zero)
            else:
                plain_steps(pairs, D, start, first, count, out, None, zero)
    else:
        @T.prim_func
        def splice_kernel(
            pairs: T.Tensor((num_segments, 2 * Hv, K, V), acc),
            D: T.Tensor((num_d, Hv, K, V), acc),
            start: T.Tensor((num_seqs, Hv, K, V), acc),
            first: T.Tensor((num_seqs,), "int64"),
            count: T.Tensor((num_seqs,), "int64"),
            out: T.Tensor((num_segments, Hv, K, V), acc),
        ):
            if blocked:
                blocked_steps(pairs, D, start, first, count, out, None)
            else:
                plain_steps(pairs, D, start, first, count, out, None, None)

    return tilelang.compile(splice_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())
