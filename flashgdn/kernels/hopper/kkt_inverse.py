"""Stage 1 of the Hopper forward: chunk-local gate cumsum and the gate-free inverse, per (chunk, value head).

Math (DESIGN.md §2, chunk size C = 64, rows i, j of one chunk of one value head h, qk head h // group):

    g~_i = sum_{s <= i} g_s                                         (chunk-local cumsum)
    L    = StrictLower(diag(beta) K K^T)                            (L_ij = beta_i k_i.k_j for i > j)
    A    = (I + L)^{-1}                                             (unit lower triangular, no gate in it)

The inverse is blocked: the four 16x16 diagonal blocks of (I + L) are inverted by forward substitution
(one thread per column), then merged 16 -> 32 -> 64 with

    [[A11, 0], [L21, A22']]^{-1}  ->  A21 = -A22 L21 A11

so every step is an fp32 product on the CUDA cores or a small tensor-core product, and nothing depends on
the gates (they enter later as Ag = Gam ⊙ A ⊙ beta^T, where every exponent is a difference <= 0).

PyTorch counterparts: ``flashgdn.reference.chunked.chunk_local_cumsum`` and
``flashgdn.reference.chunked.kkt_inverse`` (token-major layouts identical to the outputs here).

Rows of a chunk past its sequence's end are loaded as zeros (k, g, beta), so they add nothing to L and the
cumsum stays flat; outputs are written only for the chunk's own rows, so a chunk never writes into the next
sequence's tokens.
"""

import functools

from .common import CHUNK, TARGET, pass_configs, tl_dtype  # noqa: F401


@functools.lru_cache(maxsize=None)
def build_kkt_inverse(Hqk: int, Hv: int, K: int, qk_dtype: str, a_dtype: str):
    """Compile (or load from the cache) the kernel for one configuration.

    Arguments of the returned kernel, in order:
      k        [1, T, Hqk, K]   qk dtype
      g        [1, T, Hv]       float32 per-token log decay
      beta     [1, T, Hv]       float32
      bounds   [S, 2]           int32: (first token, length) of every chunk slot; length 0 = idle slot
      gcum     [1, T, Hv]       float32, written
      A        [1, T, Hv, 64]   a dtype, written (row t: row of t in its chunk)
    """
    import tilelang
    import tilelang.language as T

    C = CHUNK
    group = Hv // Hqk
    num_tokens = T.dynamic("num_tokens")
    num_slots = T.dynamic("num_slots")
    acc = "float32"

    @T.prim_func
    def kkt_inverse_kernel(
        k: T.Tensor((1, num_tokens, Hqk, K), qk_dtype),
        g: T.Tensor((1, num_tokens, Hv), "float32"),
        beta: T.Tensor((1, num_tokens, Hv), "float32"),
        bounds: T.Tensor((num_slots, 2), "int32"),
        gcum: T.Tensor((1, num_tokens, Hv), "float32"),
        A: T.Tensor((1, num_tokens, Hv, C), a_dtype),
    ):
        with T.Kernel(num_slots, Hv, threads=128) as (slot, h):
            hq = h // group
            t0 = bounds[slot, 0]
            n_rows = bounds[slot, 1]

            k_s = T.alloc_shared((C, K), qk_dtype)
            g_s = T.alloc_shared((C,), acc)
            gc_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            kk_f = T.alloc_fragment((C, C), acc)
            # (I + L) in, A out; one padded row so column walks do not hit one bank
            a_s = T.alloc_shared((C, C + 1), acc)
            l_s = T.alloc_shared((C, C + 1), acc)
            t32_s = T.alloc_shared((32, 32), acc)
            l21_s = T.alloc_shared((32, 32), acc)
            a00_s = T.alloc_shared((32, 32), acc)
            a11_s = T.alloc_shared((32, 32), acc)
            d_f = T.alloc_fragment((4, 16), acc)
            m16_f = T.alloc_fragment((2, 16, 16), acc)
            m32_f = T.alloc_fragment((32, 32), acc)

            if n_rows > 0:
                for i, j in T.Parallel(C, K):
                    k_s[i, j] = T.if_then_else(i < n_rows, k[0, t0 + i, hq, j], T.cast(0, qk_dtype))
                for i in T.Parallel(C):
                    g_s[i] = T.if_then_else(i < n_rows, g[0, t0 + i, h], 0.0)
                    b_s[i] = T.if_then_else(i < n_rows, beta[0, t0 + i, h], 0.0)
                T.cumsum(g_s, gc_s, dim=0)
                for i in T.Parallel(C):
                    if i < n_rows:
                        gcum[0, t0 + i, h] = gc_s[i]

                T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    l_s[i, j] = T.if_then_else(i > j, b_s[i] * kk_f[i, j], 0.0)
                    # diagonal 16x16 blocks start as the identity; everything else is filled below
                    a_s[i, j] = T.if_then_else(i == j, 1.0, 0.0)

                # 1) diagonal blocks by forward substitution: row r of block b, all 16 columns at once.
                #    Fully unrolled: every index is a constant and the loads of one row overlap.
                for r in T.unroll(1, 16):
                    T.clear(d_f)
                    for b, c in T.Parallel(4, 16):
                        for j in T.unroll(r):
                            d_f[b, c] += l_s[16 * b + r, 16 * b + j] * a_s[16 * b + j, 16 * b + c]
                    for b, c in T.Parallel(4, 16):
                        if c < r:
                            a_s[16 * b + r, 16 * b + c] = -d_f[b, c]

                # 2) 16 -> 32: A10 = -A11 L10 A00 for the pairs of blocks (0, 1) and (2, 3)
                T.clear(m16_f)
                for p, r, c in T.Parallel(2, 16, 16):
                    for j in T.unroll(16):
                        m16_f[p, r, c] += l_s[32 * p + 16 + r, 32 * p + j] * a_s[32 * p + j, 32 * p + c]
                for p, r, c in T.Parallel(2, 16, 16):
                    l_s[32 * p + 16 + r, 32 * p + c] = m16_f[p, r, c]
                T.clear(m16_f)
                for p, r, c in T.Parallel(2, 16, 16):
                    for j in T.unroll(16):
                        m16_f[p, r, c] -= a_s[32 * p + 16 + r, 32 * p + 16 + j] * l_s[32 * p + 16 + j, 32 * p + c]
                for p, r, c in T.Parallel(2, 16, 16):
                    a_s[32 * p + 16 + r, 32 * p + c] = m16_f[p, r, c]

                # 3) 32 -> 64 on the tensor cores (tf32): A[32:, :32] = -A[32:, 32:] (L[32:, :32] A[:32, :32])
                for r, c in T.Parallel(32, 32):
                    l21_s[r, c] = l_s[32 + r, c]
                    a00_s[r, c] = a_s[r, c]
                    a11_s[r, c] = a_s[32 + r, 32 + c]
                T.gemm(l21_s, a00_s, m32_f, clear_accum=True)
                T.copy(m32_f, t32_s)
                T.gemm(a11_s, t32_s, m32_f, clear_accum=True)
                for r, c in T.Parallel(32, 32):
                    a_s[32 + r, c] = -m32_f[r, c]

                for i, j in T.Parallel(C, C):
                    if i < n_rows:
                        A[0, t0 + i, h, j] = a_s[i, j]

    return tilelang.compile(
        kkt_inverse_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs()
    )
