"""Stage 2a of the Hopper backward: dv, per (chunk, value head), from the state gradient at the chunk's end.

Math (``reference/chunked_backward.py``, step 2), with dS' the state gradient at the chunk's end (stage 1b,
``state_grad_walk``) and P = scale Gam ⊙ Q K^T (lower, diagonal included):

    dVn = P^T dO + diag(d) K dS'          d_i = exp(g~_last - g~_i)
    dV  = dW = Ag^T dVn

Every chunk at once, one CTA per chunk slot and value head (128 threads): three GEMMs (Q K^T; K dS' with dS'
rounded to the io dtype in shared memory; P^T dO accumulated onto it; Ag^T dVn), the gate factors in between.
Rows past a sequence's end are not written. The rest of step 2 (dq, dk, dg, dbeta) is the next kernel's.

PyTorch counterpart: the ``dVn``/``dW`` lines of ``chunk_gated_delta_rule_backward_reference``.
"""
import functools

from .common import CHUNK, LOG2E, TARGET, pass_configs


@functools.lru_cache(maxsize=None)
def build_chunk_grad_dv(Hqk: int, Hv: int, K: int, V: int, io_dtype: str):
    """Compile (or load) the kernel. Arguments, in order:

      q, k      [1, T, Hqk, K]   io dtype
      do        [1, T, Hv, V]    io dtype
      gcum      [Hv, 64 S]       float32 (stage 1)
      Ag        [S, Hv, 64, 64]  io dtype (stage 1)
      bounds    [S, 2]           int32 (stage 0)
      ds_end    [S, Hv, V, K]    float32, dS^T at every chunk's end (``state_grad_walk``)
      scale     float32
      dv        [1, T, Hv, V]    io dtype, written (rows of real chunks only)
    """
    import tilelang
    import tilelang.language as T

    C = CHUNK
    group = Hv // Hqk
    num_tokens = T.dynamic("num_tokens")
    num_slots = T.dynamic("num_slots")
    slot_rows = T.dynamic("slot_rows")
    acc = "float32"

    @T.prim_func
    def chunk_grad_dv_kernel(
        q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
        gcum: T.Tensor((Hv, slot_rows), "float32"),
        Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
        bounds: T.Tensor((num_slots, 2), "int32"),
        ds_end: T.Tensor((num_slots, Hv, V, K), "float32"),
        scale: T.float32,
        dv: T.Tensor((1, num_tokens, Hv, V), io_dtype),
    ):
        with T.Kernel(num_slots, Hv, threads=128) as (slot, h):
            hq = h // group
            t0 = bounds[slot, 0]
            n_rows = bounds[slot, 1]

            q_s = T.alloc_shared((C, K), io_dtype)
            k_s = T.alloc_shared((C, K), io_dtype)
            do_s = T.alloc_shared((C, V), io_dtype)
            a_s = T.alloc_shared((C, C), io_dtype)
            dst_s = T.alloc_shared((V, K), io_dtype)  # dS'^T
            p_s = T.alloc_shared((C, C), io_dtype)
            x_s = T.alloc_shared((C, V), io_dtype)  # dVn
            gc_s = T.alloc_shared((C,), acc)
            p_f = T.alloc_fragment((C, C), acc)
            x_f = T.alloc_fragment((C, V), acc)

            if n_rows > 0:
                for i, j in T.Parallel(C, K):
                    q_s[i, j] = T.if_then_else(i < n_rows, q[0, t0 + i, hq, j], T.cast(0, io_dtype))
                    k_s[i, j] = T.if_then_else(i < n_rows, k[0, t0 + i, hq, j], T.cast(0, io_dtype))
                for i, j in T.Parallel(C, V):
                    do_s[i, j] = T.if_then_else(i < n_rows, do[0, t0 + i, h, j], T.cast(0, io_dtype))
                for i, j in T.Parallel(C, C):
                    a_s[i, j] = Ag[slot, h, i, j]
                for i, j in T.Parallel(V, K):
                    dst_s[i, j] = T.cast(ds_end[slot, h, i, j], io_dtype)
                for i in T.Parallel(C):
                    gc_s[i] = gcum[h, slot * C + i]
                # P = scale Gam ⊙ Q K^T, lower with the diagonal
                T.gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    p_f[i, j] = T.if_then_else(i >= j, p_f[i, j] * scale * T.exp2((gc_s[i] - gc_s[j]) * LOG2E), 0.0)
                T.copy(p_f, p_s)
                # dVn = diag(d) K dS' + P^T dO
                T.gemm(k_s, dst_s, x_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, V):
                    x_f[i, j] = x_f[i, j] * T.exp2((gc_s[C - 1] - gc_s[i]) * LOG2E)
                T.gemm(p_s, do_s, x_f, transpose_A=True)
                T.copy(x_f, x_s)
                # dV = Ag^T dVn
                T.gemm(a_s, x_s, x_f, transpose_A=True, clear_accum=True)
                for i, j in T.Parallel(C, V):
                    if i < n_rows:
                        dv[0, t0 + i, h, j] = T.cast(x_f[i, j], io_dtype)

    return tilelang.compile(chunk_grad_dv_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())
