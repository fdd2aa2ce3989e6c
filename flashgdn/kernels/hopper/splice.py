"""Context parallelism's splice in one kernel: every segment's start state (forward) or end gradient (backward).

Math (``flashgdn/cp/exact.py`` and ``flashgdn/cp/backward.py``), per sequence, its segments first to last:

    forward:   S_first = h0;  S_{first+1} = b_first (its b already starts from h0);  S_{i+1} = M_i S_i + b_i
    backward:  E_last = d(final state);  E_{i-1} = M_i^T E_i + D_i      (last to first)

with ``M_i`` (K x K) and ``b_i`` from the transition pass's pairs (``[segments, 2 Hv, K, V]``: head 2h the b of
value head h, head 2h + 1 its M) and ``D_i`` the walk of segment i from a zero end gradient. The torch splice does
one step for all sequences at once with three small kernels (gather, batched product, scatter), ~13 us per step on
the H200 (``flashgdn/cp/plan.py``); here one launch does every step.

One CTA per (sequence, value head, block of BV = 8 state columns: V / 8 x Hv x N CTAs, 128 for one sequence of 8
heads), 128 threads, float32 throughout (as the torch splice: no TF32): per step M (transposed for the forward)
and the state block go to shared memory, then ``state = b + M S`` by CUDA-core FMAs over K (8 outputs per
thread). Each step is a dependent chain, so the kernel's time is the number of steps times one step's latency (a
64 KB load of M from L2, where the transition pass just wrote it, and 128 x 8 x K FMAs).

PyTorch counterparts: ``flashgdn.cp.exact.splice_segments`` and ``flashgdn.cp.backward.splice_reverse``.
"""
import functools

from .common import TARGET, pass_configs


@functools.lru_cache(maxsize=None)
def build_splice(Hv: int, K: int, V: int, reverse: bool, BV: int = 8, split_k: int = 1):
    """Compile (or load) the kernel. ``split_k`` > 1 (an A/B, ``forward.SPLICE_SPLIT_K``; ``split_k_steps``): 128 x
    ``split_k`` threads share each step's products over K, and the next step's M is loaded while this one's are
    made. Arguments, in order:

      pairs   [S, 2 Hv, K, V]  float32: head 2h + 1 is M (V = K), head 2h the forward's b
      D       [S, Hv, K, V]    float32: the backward's D (read only when ``reverse``; any such tensor otherwise)
      start   [N, Hv, K, V]    float32: h0 (forward) or d(final state) (backward)
      first   [N] int64, count [N] int64: each sequence's first segment and its number of segments
      out     [S, Hv, K, V]    float32, written: every segment's start state (forward) / end gradient (backward)
    """
    import tilelang
    import tilelang.language as T

    assert K == V, "the transitions M come from the pairs, which need V = K"
    assert V % BV == 0
    num_segments = T.dynamic("num_segments")
    num_d = T.dynamic("num_d")
    num_seqs = T.dynamic("num_seqs")
    acc = "float32"

    assert K % split_k == 0
    KG = K // split_k  # each group's share of the sum over K

    @T.macro
    def plain_steps(pairs, D, start, first, count, out):
        with T.Kernel(V // BV, Hv, num_seqs, threads=128) as (vb, h, n):
            m_s = T.alloc_shared((K, K + 1), acc)  # [k][r]: the factor of state row k in output row r (padded)
            s_s = T.alloc_shared((K, BV), acc)
            s_f = T.alloc_fragment((K, BV), acc)
            f = first[n]
            c = count[n]
            c0 = vb * BV
            # the first row of the chain is the sequence's own start (forward) or end (backward)
            row0 = f + c - 1 if reverse else f
            for r, j in T.Parallel(K, BV):
                s_f[r, j] = start[n, h, r, c0 + j]
            for r, j in T.Parallel(K, BV):
                out[row0, h, r, c0 + j] = s_f[r, j]
            for step in T.serial(c - 1):
                src = f + c - 1 - step if reverse else f + step  # the segment whose transition applies
                dst = src - 1 if reverse else src + 1
                if reverse or step > 0:
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
                else:  # the forward's first step: b_first already starts from h0
                    for r, j in T.Parallel(K, BV):
                        s_f[r, j] = pairs[src, 2 * h, r, c0 + j]
                for r, j in T.Parallel(K, BV):
                    out[dst, h, r, c0 + j] = s_f[r, j]

    @T.macro
    def split_k_steps(pairs, D, start, first, count, out):
        # ``split_k`` > 1: a step's latency cut two ways. One step was ~1024 FMAs and ~1150 shared-memory loads per
        # thread on a chain of 128 (2.5 us forward, 4.4 reverse on the H200: 31 steps of each took 0.23 ms of 2/4
        # 32768x1's backward on 16-chunk segments), after a 64 KB load of M that nothing overlapped. Here
        # ``split_k`` groups of 128 threads each sum K / ``split_k`` of the products (their partial sums meet in
        # shared memory, added in group order), and M of the next step, which does not depend on the chain, is
        # loaded into registers before this step's products and stored into the other of two M tiles after them.
        # The sums run in another order than the plain kernel's (float32 throughout).
        with T.Kernel(V // BV, Hv, num_seqs, threads=128 * split_k) as (vb, h, n):
            m_s = T.alloc_shared((2, K, K + 1), acc)  # two steps' [k][r] factors (padded rows), in turn
            s_s = T.alloc_shared((K, BV), acc)  # the chain's state block, read by every group
            part_s = T.alloc_shared((split_k, K, BV), acc)
            m_f = T.alloc_fragment((K, K), acc)  # the next step's M on its way to shared memory
            part_f = T.alloc_fragment((split_k, K, BV), acc)
            s_f = T.alloc_fragment((K, BV), acc)
            f = first[n]
            c = count[n]
            c0 = vb * BV
            row0 = f + c - 1 if reverse else f
            for r, j in T.Parallel(K, BV):
                s_s[r, j] = start[n, h, r, c0 + j]
                out[row0, h, r, c0 + j] = start[n, h, r, c0 + j]
            # the first step that multiplies: the reverse's every step, the forward's from its second (its first
            # takes b_first, which already starts from h0)
            first_mul = 0 if reverse else 1
            if c - 1 > first_mul:
                src0 = f + c - 1 - first_mul if reverse else f + first_mul
                for a, b in T.Parallel(K, K):
                    if reverse:
                        m_s[first_mul % 2, a, b] = pairs[src0, 2 * h + 1, a, b]
                    else:
                        m_s[first_mul % 2, b, a] = pairs[src0, 2 * h + 1, a, b]
            for step in T.serial(c - 1):
                src = f + c - 1 - step if reverse else f + step
                dst = src - 1 if reverse else src + 1
                if reverse or step > 0:
                    # this step's D or b and the next step's M: loads in flight while the products are made
                    for r, j in T.Parallel(K, BV):
                        s_f[r, j] = D[src, h, r, c0 + j] if reverse else pairs[src, 2 * h, r, c0 + j]
                    nxt = src - 1 if reverse else src + 1
                    has_next = step + 1 < c - 1
                    if has_next:
                        for a, b in T.Parallel(K, K):
                            m_f[a, b] = pairs[nxt, 2 * h + 1, a, b]
                    buf = step % 2
                    for g, r, j in T.Parallel(split_k, K, BV):
                        part_f[g, r, j] = 0.0
                    for kk in T.serial(KG):
                        for g, r, j in T.Parallel(split_k, K, BV):
                            part_f[g, r, j] = part_f[g, r, j] + m_s[buf, g * KG + kk, r] * s_s[g * KG + kk, j]
                    T.copy(part_f, part_s)
                    for r, j in T.Parallel(K, BV):
                        for g in T.serial(split_k):
                            s_f[r, j] = s_f[r, j] + part_s[g, r, j]
                    if has_next:
                        for a, b in T.Parallel(K, K):
                            if reverse:
                                m_s[1 - buf, a, b] = m_f[a, b]
                            else:
                                m_s[1 - buf, b, a] = m_f[a, b]
                else:  # the forward's first step: b_first already starts from h0
                    for r, j in T.Parallel(K, BV):
                        s_f[r, j] = pairs[src, 2 * h, r, c0 + j]
                for r, j in T.Parallel(K, BV):
                    s_s[r, j] = s_f[r, j]
                    out[dst, h, r, c0 + j] = s_f[r, j]

    @T.prim_func
    def splice_kernel(
        pairs: T.Tensor((num_segments, 2 * Hv, K, V), acc),
        D: T.Tensor((num_d, Hv, K, V), acc),
        start: T.Tensor((num_seqs, Hv, K, V), acc),
        first: T.Tensor((num_seqs,), "int64"),
        count: T.Tensor((num_seqs,), "int64"),
        out: T.Tensor((num_segments, Hv, K, V), acc),
    ):
        if split_k > 1:
            split_k_steps(pairs, D, start, first, count, out)
        else:
            plain_steps(pairs, D, start, first, count, out)

    return tilelang.compile(splice_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())
