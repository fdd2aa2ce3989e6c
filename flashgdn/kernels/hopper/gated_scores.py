"""The backward's gated scores P of every chunk, made before the fused backward so that its chunk step need not make
them first (``fused_backward.py``'s ``p_given``).

Math (``reference/chunked_backward.py``), per chunk slot and value head, C = 64 rows i, j of the chunk, g~ stage 1's
per-slot cumsum:

    P_ij = scale exp(g~_i - g~_j) (q_i . k_j)      (i >= j, else 0)

the forward's intra-chunk attention scores, which the backward reads in P^T dO (dv's and dk's intra-chunk terms)
and in P ⊙ dP (dg's row and column sums). One CTA per (chunk slot, qk head) loads the slot's rows of Q and K
(rows past the slot's length zero, as the fused kernel's masked loads make them), takes Q K^T once on the tensor
cores, and gates it for each value head of the qk head's group: the fused kernel's own product and expression, in
the same order, so that its P (and every gradient) keeps its bits. Stored in the io dtype, as the fused kernel
rounds P into its shared tile.

Why: in the fused kernel P starts each chunk step on the critical path (K's load, Q K^T, the gating; the value
side's P^T dO waits for it). Given P, the kernel alone took 0.89x its time at 16/32 8 x 4096 and 0.955x at 8/16
8 x 8192 (docs/hopper-notes.md, v0.28a); this pass reads Q and K once more and writes 128 bytes per token and value
head, live until the fused kernel has run.

PyTorch counterpart: the ``P`` of ``flashgdn.reference.chunked_backward`` (its per-chunk scores).
"""

from .common import CHUNK, LOG2E, TARGET, kernel_cache, pass_configs


@kernel_cache
def build_gated_scores(Hqk: int, Hv: int, K: int, io_dtype: str):
    """Compile (or load) the kernel. Arguments, in order:

      q, k    [1, T, Hqk, K]   io dtype (normalised as the forward used them)
      gcum    [Hv, 64 S]       float32, stage 1's per-slot cumsum
      bounds  [S, 2]           int32, (first token, length) of every chunk slot (``forward.chunk_plan``)
      scale   float32
      p       [S, Hv, 64, 64]  io dtype, written (an idle slot's tiles are zeros)
    """
    import tilelang
    import tilelang.language as T

    C = CHUNK
    acc = "float32"
    group = Hv // Hqk
    assert Hv % Hqk == 0, "Hv must be a multiple of Hqk"
    num_tokens = T.dynamic("num_tokens")
    num_slots = T.dynamic("num_slots")
    slot_rows = T.dynamic("slot_rows")

    @T.prim_func
    def gated_scores(
        q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        gcum: T.Tensor((Hv, slot_rows), acc),
        bounds: T.Tensor((num_slots, 2), "int32"),
        scale: T.float32,
        p: T.Tensor((num_slots, Hv, C, C), io_dtype),
    ):
        with T.Kernel(num_slots, Hqk, threads=128) as (s, hq):
            q_s = T.alloc_shared((C, K), io_dtype)
            k_s = T.alloc_shared((C, K), io_dtype)
            p_s = T.alloc_shared((C, C), io_dtype)
            gc_s = T.alloc_shared((C,), acc)
            qk_f = T.alloc_fragment((C, C), acc)
            p_f = T.alloc_fragment((C, C), acc)
            t0 = bounds[s, 0]
            n_rows = bounds[s, 1]
            for i, j in T.Parallel(C, K):
                q_s[i, j] = T.if_then_else(i < n_rows, q[0, t0 + i, hq, j], T.cast(0, io_dtype))
                k_s[i, j] = T.if_then_else(i < n_rows, k[0, t0 + i, hq, j], T.cast(0, io_dtype))
            T.gemm(q_s, k_s, qk_f, transpose_B=True, clear_accum=True)
            for hh in T.serial(group):
                for i in T.Parallel(C):
                    gc_s[i] = gcum[hq * group + hh, s * C + i]
                for i, j in T.Parallel(C, C):
                    p_f[i, j] = T.if_then_else(
                        i >= j, qk_f[i, j] * scale * T.exp2((gc_s[i] - gc_s[j]) * LOG2E), 0.0)
                # through shared memory, so that a warp's global stores are whole rows of 16-byte pieces
                T.copy(p_f, p_s)
                for i, j in T.Parallel(C, C):
                    p[s, hq * group + hh, i, j] = p_s[i, j]

    return tilelang.compile(gated_scores, out_idx=None, target=TARGET, pass_configs=pass_configs())
