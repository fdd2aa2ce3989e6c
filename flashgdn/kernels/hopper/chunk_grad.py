"""Stage 2 of the Hopper backward: every per-chunk gradient (dv, dq, dk, dg, dbeta), one CTA per (chunk, value head).

Math (``reference/chunked_backward.py``, step 2). One chunk of one value head, S its start state (the forward's,
recomputed by the rs loop's ``store_chunk_states`` variant), dS' the state gradient at its end
(``state_grad_walk``), A the ungated inverse and Ag the gated one (``kkt_inverse`` with ``store_inverse``, both in the io dtype),
gamma_i = exp(g~_i), d_i = exp(g~_last - g~_i), Gam_ij = exp(g~_i - g~_j):

    forward, again:  KS = K S      W = V - diag(gamma) KS      Vn = Ag W      P = scale Gam ⊙ Q K^T (i >= j)
    dVn = diag(d) K dS' + P^T dO          dW = Ag^T dVn = dV
    dAg = (dVn W^T) (i >= j)              dP = (dO Vn^T) (i >= j)        dQK = scale Gam ⊙ dP
    E = dAg ⊙ Gam     dA = E ⊙ (1 beta^T)     dL = -(A^T dA A^T) (i > j)     dKK = diag(beta) dL
    dQ = dQK K + scale diag(gamma) dO S^T
    dK = dQK^T Q - diag(gamma) dW S^T + diag(d) Vn dS'^T + (dKK + dKK^T) K
    dbeta_j = sum_i (E ⊙ A)_ij + sum_k (dL ⊙ K K^T)_jk

and the gate, by what each g~_i multiplies (every term below is a row dot product of two tiles the kernel holds):

    dg~_i = scale gamma_i <dO_i, (Q S)_i>  - gamma_i <dW_i, KS_i>  - d_i <(K dS')_i, Vn_i>
            + sum_j (P ⊙ dP)_ij - sum_j (P ⊙ dP)_ji + sum_j (E ⊙ A ⊙ beta)_ij - sum_j (E ⊙ A ⊙ beta)_ji
    plus, for g~_last, gamma_C <dS', S> + sum_i d_i <(K dS')_i, Vn_i>;  dg = reverse cumsum of dg~ in the chunk

(scale gamma_i <dO_i, (QS)_i> is <q_i, scale gamma_i (dO S^T)_i>, a row dot of dq's state term with q; the g~_last
terms reach every token of the chunk through the reverse cumsum, so they are added to all of them).

The GEMMs that need only what is ready are issued together as asynchronous wgmma and waited on once, in six
batches: (A) K S, K dS', Q K^T, dO S^T, K K^T from the loaded tiles; (B) Ag W and P^T dO; (C) dVn W^T, Ag^T dVn
and dO Vn^T; (D) dQK K, A^T dA and dk's first three terms into one accumulator; (E) (A^T dA) A^T; (F) dk's dKK
terms. Builds measured and removed: waiting on each of the 18 GEMMs (1.02x-1.04x the time,
``stages-hopper-v0.6-bwd.json``), and 256 or 128 threads (1.06x-1.10x and 1.6x-1.9x,
``stages-hopper-v0.4.json``).
With ``async_loads`` (the default, ``backward.CHUNK_GRAD_ASYNC_LOADS``) the eight tiles arrive by
cp.async (16 bytes per thread and instruction, zero-filled past the tensor's end), all in flight before one wait,
instead of through registers: the load phase was ~20% of the stall samples
(``profiles/backward-v0.6-*``). TMA would be the other way, but a kernel with TMA loads loses TileLang's reuse of
shared memory between buffers (256 KB, over the limit). Measured: 0.92x-0.95x the time of the register-staged
loads, the same bits out.
With ``row_factors`` (the default, ``backward.CHUNK_GRAD_ROW_FACTORS``) gamma_i and d_i, which
scale rows of the [C, V] accumulators in four steps, are computed once per row into a two-element register
fragment instead of once per element from g~ in shared memory (16 elements per thread, two rows), and Gam, which
P, E and dQK are each scaled by, once per element into an eight-element fragment instead of three times.
Measured: 0.96x-0.97x the time of the per-element factors, the same bits out.
With ``scan_dg`` (the default, ``backward.CHUNK_GRAD_SCAN_DG``) dg's reverse cumsum is one scan of a [2, C] tile in
shared memory (TileLang's ``T.cumsum``; the second row carries the g~_last terms, whose total is its reverse
cumsum at 0) instead of a [C, C] masked sum and a cross-warp reduction (that phase was ~6% of the stall samples
at v0.6). The sums run in another order, so dg differs from the masked sum's in float32 rounding only. Measured:
0.98x-0.99x the time of the masked sum.
With ``pair_sums`` (a memory option, ``backward.CHUNK_GRAD_PAIR_SUMS``, two value heads per qk head) dq and dk are added
into one zeroed [T, Hqk, K] output by bf16x2 atomics (``red.add.bf16x2``) straight from the accumulators, instead
of written per value head for the host's group sum: two addends onto zero give RN(a + b) in either order, so the
result is deterministic and the same bits as the sum's. All 64 rows of the tile are added (TileLang keeps the
tensor's end): a chunk's rows past its sequence's end come out exactly zero in dq and dk (stage 1 makes A the
identity and Ag zero there, and q, k, v, dO, beta are zero), and adding a zero changes no value. Measured: 1.29x
the time on 16/32 (``stages-hopper-v0.7e-bwd.json``; 67 million bf16x2 reductions per tensor there, bound by the
atomics' throughput), more than the group sum it replaces (``group_sum.py``); a training step's peak memory 0.90x.
Kept as a memory option (off by default).
With ``wide_stores`` (the default, ``backward.CHUNK_GRAD_WIDE_STORES``) dv, dq and dk go to a shared
tile that is dead by then (dVn's, dO's, Q's: TileLang's stmatrix), and from there out in 16-byte stores, instead of
from the accumulators' layout in 4-byte ones (400 store instructions per CTA, and LG-queue stalls ~8% of the
samples at v0.6); the cost is a pass through shared memory and a barrier per tile. Measured: 0.90x-0.94x the time
of the 4-byte stores, the same bits out.
With ``heads_inner`` (an A/B, off: ``backward.CHUNK_GRAD_HEADS_INNER``) the linear block id is mapped value heads
first, so the value heads of one qk head, which load the same q and k tiles, are neighbours and start together: the
group reads those tiles from HBM about once instead of once per value head (32 KB of a CTA's 144 KB of loads). As a
grid of (value heads, slots) it took 0.979x-1.001x the time (``stages-hopper-v0.9b-bwd.json``, ``-v0.9c-bwd.json``),
but the grid's y caps the slots at 65535; mapped from the linear id (the slots stay on x) one measurement shows no
gain (``backward.CHUNK_GRAD_HEADS_INNER``). The same bits out either way.
Measured and removed: each CTA prefetching into L2 the tiles of the CTA one wave later (linear id plus the SM count,
``%nsmid``) by bulk prefetches (``cp.async.bulk.prefetch.L2``): 1.16x-1.29x the time issued at the CTA's start,
1.15x-1.24x issued after dk's store, 1.17x-1.33x two waves ahead (``stages-hopper-v0.9a-bwd.json`` and
``-v0.9b-bwd.json``). The traffic in flight slows every CTA's own loads more than the hits save.
Also measured and removed: the first wave's odd CTAs sleeping 5 or 10 us before their loads (``__nanosleep``), on the
guess that CTAs of equal work, one per SM, stay in step and load all at once: 0.98x-1.01x the time, the same bits
(``stages-hopper-v0.13a-bwd.json``, ``gpu-stagger-v0.13a.log``), so the waves are not in step, or not for long.

Every chunk at once: one CTA per chunk slot and value head, 512 threads (four warpgroups splitting every GEMM's N
and every element-wise loop),
18 GEMMs on tiles in shared memory with float32 accumulators; no atomics. q and k gradients are per value head
(``dq``, ``dk`` are ``[T, Hv, K]`` in the io dtype, as FlashQLA's): the host sums each qk head's group in a fixed
order, so results are deterministic. Operands that need a row scaling after their GEMM is shared with another term are scaled before
it instead (-gamma ⊙ dW, d ⊙ Vn), so dk is one accumulator. Rows past a sequence's end are not written.

PyTorch counterpart: step 2 of ``chunk_gated_delta_rule_backward_reference``.
"""

from .common import CHUNK, LOG2E, TARGET, kernel_cache, pass_configs

#: four warpgroups (126 of the 128 registers a thread may have at 512 threads)
THREADS = 512


@kernel_cache
def build_chunk_grad(Hqk: int, Hv: int, K: int, V: int, io_dtype: str, async_loads: bool = False,
                     row_factors: bool = False, scan_dg: bool = False, wide_stores: bool = False,
                     pair_sums: bool = False, heads_inner: bool = False):
    """Compile (or load) the kernel (``async_loads``: the eight tiles by cp.async, all in flight at once;
    ``row_factors``: gamma_i and d_i computed once per row into registers; ``scan_dg``: dg's reverse cumsum by a
    scan; ``wide_stores``: dv, dq and dk out through a dead shared tile in 16-byte stores; each off is its A/B;
    ``pair_sums``, for two value heads per qk head: dq and dk added into one zeroed output per qk head by atomics;
    ``heads_inner``: the linear block id mapped value heads first, so that the value heads of a qk head run together;
    ``backward.chunk_grad_options`` sets them; module docstring). Arguments, in order:

      q, k      [1, T, Hqk, K]   io dtype (normalised as the forward used them)
      v, do     [1, T, Hv, V]    io dtype
      gcum      [Hv, 64 S]       float32, stage 1's per-slot cumsum
      beta      [1, T, Hv]       float32
      Ag        [S, Hv, 64, 64]  io dtype, stage 1's gated inverse
      A         [S, Hv, 64, 64]  io dtype, stage 1's ungated inverse (``store_inverse``)
      bounds    [S, 2]           int32, stage 0's chunk slots
      states    [S, Hv, V, K]    io dtype: S^T at every chunk's start
      ds_end    [S, Hv, V, K]    io dtype: dS'^T at every chunk's end (``state_grad_walk``)
      scale     float32
      dv        [1, T, Hv, V]    io dtype, written
      dq, dk    [1, T, Hv, K]    io dtype, written: per value head (summed over a group by the caller with
                                 float32 accumulation, as FlashQLA does with its bf16 per-head dq/dk); with
                [1, T, Hqk, K]   ``pair_sums``: zeroed by the caller, each value head's rows added to its qk head's
      dg, dbeta [1, T, Hv]       float32, written
    """
    import tilelang
    import tilelang.language as T

    C = CHUNK
    # <dS', S> is folded onto the chunk's 64 rows (V's two halves added) and totalled by the last reduction
    assert V == 2 * CHUNK, "the kernel is written for V = 128"
    group = Hv // Hqk
    # two addends onto zero round to RN(a + b) in either order; a third would round in arrival order
    assert not pair_sums or group == 2, "pair sums are for two value heads per qk head"
    num_tokens = T.dynamic("num_tokens")
    num_slots = T.dynamic("num_slots")
    slot_rows = T.dynamic("slot_rows")
    acc = "float32"

    # The gate's factors, from g~ in shared memory (an exp2 per element), or with ``row_factors`` from register
    # fragments made once: gamma_i and d_i per row (each thread holds two rows of a [C, V] accumulator; the
    # compiler cannot keep g~ in registers itself, stores to other tiles of the same buffer come between) and Gam
    # per element (P, E and dQK each scale by it). ``gam``, ``dec``, ``gmat`` are g~'s tile or those fragments.
    def gamma_at(gam, i):
        return gam[i] if row_factors else T.exp2(gam[i] * LOG2E)

    def decay_at(dec, i):
        return dec[i] if row_factors else T.exp2((dec[C - 1] - dec[i]) * LOG2E)

    def gam_at(gmat, i, j):
        return gmat[i, j] if row_factors else T.exp2((gmat[i] - gmat[j]) * LOG2E)

    # the element-wise steps, each after the batch of GEMMs that feeds it
    @T.macro
    def w_and_gamma_ks(cv_f, v_s, w_s, gam):
        # cv_f holds K S: W = V - diag(gamma) K S to w_s, and diag(gamma) K S over V in v_s
        for i, j in T.Parallel(C, V):
            cv_f[i, j] = cv_f[i, j] * gamma_at(gam, i)
            w_s[i, j] = T.cast(T.cast(v_s[i, j], acc) - cv_f[i, j], io_dtype)
            v_s[i, j] = T.cast(cv_f[i, j], io_dtype)

    @T.macro
    def gated_p(cc_f, p_s, gmat, scale):
        # cc_f holds Q K^T: P = scale Gam ⊙ Q K^T (lower) to p_s
        for i, j in T.Parallel(C, C):
            cc_f[i, j] = T.if_then_else(i >= j, cc_f[i, j] * scale * gam_at(gmat, i, j), 0.0)
        T.copy(cc_f, p_s)

    @T.macro
    def e_terms(cc_f, prodc_f, x_f, a_s, da_s, beta_s, gmat, red_c, db1_s):
        # cc_f holds dVn W^T: E = dAg ⊙ Gam (lower), dA = E ⊙ beta_j to da_s, dbeta's first sum, X = E ⊙ A ⊙ beta
        for i, j in T.Parallel(C, C):
            cc_f[i, j] = T.if_then_else(i >= j, cc_f[i, j] * gam_at(gmat, i, j), 0.0)
            prodc_f[i, j] = cc_f[i, j] * T.cast(a_s[i, j], acc)
            da_s[i, j] = T.cast(cc_f[i, j] * beta_s[j], io_dtype)
            x_f[i, j] = prodc_f[i, j] * beta_s[j]
        T.reduce_sum(prodc_f, red_c, dim=0)
        T.copy(red_c, db1_s)

    @T.macro
    def store_through(f, tile_s, out, t0, n_rows, h):
        # a [C, 128] accumulator to a shared tile no longer read, then its rows out in 16-byte stores instead of
        # the accumulator layout's 4-byte ones (the profile's LG-queue stalls); rows past the sequence stay unwritten
        T.copy(f, tile_s)
        for i, j in T.Parallel(C, K):
            if i < n_rows:
                out[0, t0 + i, h, j] = tile_s[i, j]

    @T.macro
    def dw_terms(cv_f, prod_f, v_s, w_s, gam, dv, t0, n_rows, h, dvn_s):
        # cv_f holds dW = dV: written out (with ``wide_stores`` through dVn's tile, dead by now); -gamma_i <dW_i,
        # KS_i>'s products onto prod_f; -gamma ⊙ dW to w_s for dk
        if wide_stores:
            store_through(cv_f, dvn_s, dv, t0, n_rows, h)
        else:
            for i, j in T.Parallel(C, V):
                if i < n_rows:
                    dv[0, t0 + i, h, j] = T.cast(cv_f[i, j], io_dtype)
        for i, j in T.Parallel(C, V):
            prod_f[i, j] = prod_f[i, j] - cv_f[i, j] * T.cast(v_s[i, j], acc)
            w_s[i, j] = T.cast(-cv_f[i, j] * gamma_at(gam, i), io_dtype)

    @T.macro
    def dp_terms(dp_f, x_f, p_s, dqk_s, vn_s, gc_s, gmat, red_r, red_c, xr_s, xc_s, scale):
        # dp_f holds dO Vn^T: P ⊙ dP joins X, whose row and column sums are taken; dQK = scale Gam ⊙ dP (lower)
        # to dqk_s; then d ⊙ Vn in vn_s for dk
        for i, j in T.Parallel(C, C):
            x_f[i, j] = x_f[i, j] + T.if_then_else(i >= j, dp_f[i, j] * T.cast(p_s[i, j], acc), 0.0)
            dqk_s[i, j] = T.cast(T.if_then_else(i >= j, dp_f[i, j] * scale * gam_at(gmat, i, j), 0.0), io_dtype)
        T.reduce_sum(x_f, red_r, dim=1)
        T.copy(red_r, xr_s)
        T.reduce_sum(x_f, red_c, dim=0)
        T.copy(red_c, xc_s)
        for i, j in T.Parallel(C, V):
            vn_s[i, j] = T.cast(T.cast(vn_s[i, j], acc) * T.exp2((gc_s[C - 1] - gc_s[i]) * LOG2E), io_dtype)

    @T.macro
    def dl_terms(cc_f, prodc_f, kk_f, dkk_s, beta_s, red_r, db2_s):
        # cc_f holds (A^T dA) A^T: dL = -that, strictly lower; dKK = diag(beta) dL to dkk_s; dbeta's second sum
        for i, j in T.Parallel(C, C):
            cc_f[i, j] = T.if_then_else(i > j, -cc_f[i, j], 0.0)
            prodc_f[i, j] = cc_f[i, j] * kk_f[i, j]
            dkk_s[i, j] = T.cast(cc_f[i, j] * beta_s[i], io_dtype)
        T.reduce_sum(prodc_f, red_r, dim=1)
        T.copy(red_r, db2_s)

    @T.macro
    def load_tile(src, dst):
        if async_loads:  # cp.async: no register staging, every tile in flight before the first wait
            T.async_copy(src, dst)
        else:
            T.copy(src, dst)

    @T.macro
    def store_rows(f, out, t0, n_rows, h):
        for i, j in T.Parallel(C, K):
            if i < n_rows:
                out[0, t0 + i, h, j] = T.cast(f[i, j], io_dtype)

    @T.macro
    def store_qk_grad(f, tile_s, out, t0, n_rows, h, hq):
        # dq or dk: added into its qk head's rows (pair sums), else this value head's rows, through ``tile_s`` (a
        # tile no longer read) with wide stores
        if pair_sums:
            T.atomic_add(out[0, t0:t0 + C, hq, :], f)
        elif wide_stores:
            store_through(f, tile_s, out, t0, n_rows, h)
        else:
            store_rows(f, out, t0, n_rows, h)

    @T.prim_func
    def chunk_grad_kernel(
        q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
        v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
        do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
        gcum: T.Tensor((Hv, slot_rows), "float32"),
        beta: T.Tensor((1, num_tokens, Hv), "float32"),
        Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
        A: T.Tensor((num_slots, Hv, C, C), io_dtype),
        bounds: T.Tensor((num_slots, 2), "int32"),
        states: T.Tensor((num_slots, Hv, V, K), io_dtype),
        ds_end: T.Tensor((num_slots, Hv, V, K), io_dtype),
        scale: T.float32,
        dv: T.Tensor((1, num_tokens, Hv, V), io_dtype),
        dq: T.Tensor((1, num_tokens, Hqk if pair_sums else Hv, K), io_dtype),
        dk: T.Tensor((1, num_tokens, Hqk if pair_sums else Hv, K), io_dtype),
        dg: T.Tensor((1, num_tokens, Hv), "float32"),
        dbeta: T.Tensor((1, num_tokens, Hv), "float32"),
    ):
        # the slots stay on the grid's x (up to 2^31 - 1 blocks; y stops at 65535); blocks start in order of their
        # linear id, which with ``heads_inner`` is mapped value heads first, so that the group of a qk head reads its
        # q and k tiles while they are in L2
        with T.Kernel(num_slots, Hv, threads=THREADS) as (bx, by):
            slot = (by * num_slots + bx) // Hv if heads_inner else bx
            h = (by * num_slots + bx) % Hv if heads_inner else by
            hq = h // group
            t0 = bounds[slot, 0]
            n_rows = bounds[slot, 1]

            q_s = T.alloc_shared((C, K), io_dtype)
            k_s = T.alloc_shared((C, K), io_dtype)
            v_s = T.alloc_shared((C, V), io_dtype)  # V, then gamma ⊙ KS
            do_s = T.alloc_shared((C, V), io_dtype)
            st_s = T.alloc_shared((V, K), io_dtype)  # S^T
            ds_s = T.alloc_shared((V, K), io_dtype)  # dS'^T
            ag_s = T.alloc_shared((C, C), io_dtype)
            a_s = T.alloc_shared((C, C), io_dtype)
            w_s = T.alloc_shared((C, V), io_dtype)  # W, then -gamma ⊙ dW
            vn_s = T.alloc_shared((C, V), io_dtype)  # Vn, then d ⊙ Vn
            dvn_s = T.alloc_shared((C, V), io_dtype)
            p_s = T.alloc_shared((C, C), io_dtype)
            dqk_s = T.alloc_shared((C, C), io_dtype)
            da_s = T.alloc_shared((C, C), io_dtype)
            y_s = T.alloc_shared((C, C), io_dtype)
            dkk_s = T.alloc_shared((C, C), io_dtype)
            gc_s = T.alloc_shared((C,), acc)
            beta_s = T.alloc_shared((C,), acc)
            sd_s = T.alloc_shared((C,), acc)  # <dS', S> in 64 partial sums
            # the gate's row terms (see the module docstring), and dbeta's two sums
            tqw_s = T.alloc_shared((C,), acc)  # scale gamma_i <dO_i, (QS)_i> - gamma_i <dW_i, KS_i>
            tdec_s = T.alloc_shared((C,), acc)
            xr_s = T.alloc_shared((C,), acc)  # row and column sums of X = P ⊙ dP + E ⊙ A ⊙ beta
            xc_s = T.alloc_shared((C,), acc)
            db1_s = T.alloc_shared((C,), acc)
            db2_s = T.alloc_shared((C,), acc)
            if scan_dg:
                scan_s = T.alloc_shared((2, C), acc)
            else:
                dgc_s = T.alloc_shared((C,), acc)

            cv_f = T.alloc_fragment((C, V), acc)
            if row_factors:  # gamma_i and d_i for the rows of the [C, V] accumulators, Gam per element
                gam_f = T.alloc_fragment((C,), acc)
                dec_f = T.alloc_fragment((C,), acc)
                gmat_f = T.alloc_fragment((C, C), acc)
            # the accumulators of GEMMs issued together
            cv2_f = T.alloc_fragment((C, V), acc)
            kd_f = T.alloc_fragment((C, V), acc)
            dk_f = T.alloc_fragment((C, K), acc)
            cc2_f = T.alloc_fragment((C, C), acc)
            ck_f = T.alloc_fragment((C, K), acc)
            cc_f = T.alloc_fragment((C, C), acc)
            kk_f = T.alloc_fragment((C, C), acc)
            prod_f = T.alloc_fragment((C, V), acc)
            prodc_f = T.alloc_fragment((C, C), acc)
            x_f = T.alloc_fragment((C, C), acc)
            # reductions' outputs, one per source layout: rows of a [C, V|K] tile, rows / columns of a [C, C] one
            red_f = T.alloc_fragment((C,), acc)
            red_r = T.alloc_fragment((C,), acc)
            red_c = T.alloc_fragment((C,), acc)

            if n_rows > 0:
                # whole tiles by bulk copies (rows past the tensor's end read as zeros); the rows of a chunk past
                # its sequence's end belong to the next sequence and are zeroed after
                load_tile(q[0, t0:t0 + C, hq, :], q_s)
                load_tile(k[0, t0:t0 + C, hq, :], k_s)
                load_tile(v[0, t0:t0 + C, h, :], v_s)
                load_tile(do[0, t0:t0 + C, h, :], do_s)
                load_tile(Ag[slot, h, :, :], ag_s)
                load_tile(A[slot, h, :, :], a_s)
                load_tile(states[slot, h, :, :], st_s)
                load_tile(ds_end[slot, h, :, :], ds_s)
                for i in T.Parallel(C):
                    gc_s[i] = gcum[h, slot * C + i]
                    beta_s[i] = T.if_then_else(i < n_rows, beta[0, t0 + i, h], 0.0)
                if async_loads:
                    T.ptx_wait_group(0)
                    T.sync_threads()
                if n_rows < C:
                    for i, j in T.Parallel(C, K):
                        if i >= n_rows:
                            q_s[i, j] = T.cast(0, io_dtype)
                            k_s[i, j] = T.cast(0, io_dtype)
                            v_s[i, j] = T.cast(0, io_dtype)
                            do_s[i, j] = T.cast(0, io_dtype)
                # <dS', S> as 64 partial sums (V's two halves folded onto the chunk's rows): the gate's g~_last
                # term needs only their total, which the last reduction makes
                for i, j in T.Parallel(C, K):
                    prod_f[i, j] = (T.cast(st_s[i, j], acc) * T.cast(ds_s[i, j], acc)
                                    + T.cast(st_s[i + C, j], acc) * T.cast(ds_s[i + C, j], acc))
                T.reduce_sum(prod_f, red_f, dim=1)
                T.copy(red_f, sd_s)

                # A: every product of loaded tiles alone, issued together
                T.wgmma_gemm(k_s, st_s, cv_f, transpose_B=True, clear_accum=True)  # K S
                T.wgmma_gemm(k_s, ds_s, kd_f, transpose_B=True, clear_accum=True)  # K dS'
                T.wgmma_gemm(q_s, k_s, cc_f, transpose_B=True, clear_accum=True)  # Q K^T
                T.wgmma_gemm(do_s, st_s, ck_f, clear_accum=True)  # dO S^T
                T.wgmma_gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)  # K K^T
                T.wait_wgmma(0)
                if row_factors:  # the factors once; without them the helpers read g~ itself
                    for i in T.Parallel(C):
                        gam_f[i] = T.exp2(gc_s[i] * LOG2E)
                        dec_f[i] = T.exp2((gc_s[C - 1] - gc_s[i]) * LOG2E)
                    for i, j in T.Parallel(C, C):
                        gmat_f[i, j] = T.exp2((gc_s[i] - gc_s[j]) * LOG2E)
                w_and_gamma_ks(cv_f, v_s, w_s, gam_f if row_factors else gc_s)
                gated_p(cc_f, p_s, gmat_f if row_factors else gc_s, scale)
                for i, j in T.Parallel(C, V):
                    kd_f[i, j] = kd_f[i, j] * decay_at(dec_f if row_factors else gc_s, i)
                # dQ's state term, scale diag(gamma) dO S^T, and the gate's <q_i, scale gamma_i (dO S^T)_i>
                for i, j in T.Parallel(C, K):
                    ck_f[i, j] = ck_f[i, j] * scale * gamma_at(gam_f if row_factors else gc_s, i)
                    prod_f[i, j] = ck_f[i, j] * T.cast(q_s[i, j], acc)

                # B: Vn = Ag W and P^T dO; then dVn = diag(d) K dS' + P^T dO, with the gate's d_i <(K dS')_i, Vn_i>
                T.wgmma_gemm(ag_s, w_s, cv_f, clear_accum=True)
                T.wgmma_gemm(p_s, do_s, cv2_f, transpose_A=True, clear_accum=True)
                T.wait_wgmma(0)
                T.copy(cv_f, vn_s)
                for i, j in T.Parallel(C, V):
                    cv_f[i, j] = kd_f[i, j] * T.cast(vn_s[i, j], acc)
                    dvn_s[i, j] = T.cast(kd_f[i, j] + cv2_f[i, j], io_dtype)
                T.reduce_sum(cv_f, red_f, dim=1)
                T.copy(red_f, tdec_s)

                # C: dAg = dVn W^T, dW = Ag^T dVn, dP = dO Vn^T
                T.wgmma_gemm(dvn_s, w_s, cc_f, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(ag_s, dvn_s, cv_f, transpose_A=True, clear_accum=True)
                T.wgmma_gemm(do_s, vn_s, cc2_f, transpose_B=True, clear_accum=True)
                T.wait_wgmma(0)
                e_terms(cc_f, prodc_f, x_f, a_s, da_s, beta_s, gmat_f if row_factors else gc_s, red_c, db1_s)
                # prod_f holds dQ's term
                dw_terms(cv_f, prod_f, v_s, w_s, gam_f if row_factors else gc_s, dv, t0, n_rows, h, dvn_s)
                T.reduce_sum(prod_f, red_f, dim=1)
                T.copy(red_f, tqw_s)
                dp_terms(cc2_f, x_f, p_s, dqk_s, vn_s, gc_s, gmat_f if row_factors else gc_s, red_r, red_c, xr_s,
                         xc_s, scale)

                # D: dQ += dQK K; A^T dA; dK = dQK^T Q - (gamma ⊙ dW) S^T + (d ⊙ Vn) dS'^T (one accumulator)
                T.wgmma_gemm(dqk_s, k_s, ck_f)
                T.wgmma_gemm(a_s, da_s, cc_f, transpose_A=True, clear_accum=True)
                T.wgmma_gemm(dqk_s, q_s, dk_f, transpose_A=True, clear_accum=True)
                T.wgmma_gemm(w_s, st_s, dk_f)
                T.wgmma_gemm(vn_s, ds_s, dk_f)
                T.wait_wgmma(0)
                store_qk_grad(ck_f, do_s, dq, t0, n_rows, h, hq)  # dO's tile is dead since batch C
                T.copy(cc_f, y_s)

                # E: dL = -(A^T dA A^T) strictly lower, dKK = diag(beta) dL, dbeta's second sum
                T.gemm(y_s, a_s, cc_f, transpose_B=True, clear_accum=True)
                dl_terms(cc_f, prodc_f, kk_f, dkk_s, beta_s, red_r, db2_s)

                # F: dK += dKK K + dKK^T K
                T.wgmma_gemm(dkk_s, k_s, dk_f)
                T.wgmma_gemm(dkk_s, k_s, dk_f, transpose_A=True)
                T.wait_wgmma(0)
                store_qk_grad(dk_f, q_s, dk, t0, n_rows, h, hq)  # Q's tile is dead since batch D
                # ---- dg = reverse cumsum of dg~ over the chunk, plus the g~_last terms (every token gets them)
                if scan_dg:
                    # row 0: dg~, whose reverse cumsum is the first part; row 1: the g~_last terms per token,
                    # whose reverse cumsum at 0 is their total: one scan of a [2, C] tile instead of a [C, C] masked
                    # sum and its cross-warp reduction
                    for i in T.Parallel(C):
                        scan_s[0, i] = tqw_s[i] - tdec_s[i] + xr_s[i] - xc_s[i]
                        scan_s[1, i] = tdec_s[i] + T.exp2(gc_s[C - 1] * LOG2E) * sd_s[i]
                    T.cumsum(scan_s, dim=1, reverse=True)
                    for i in T.Parallel(C):
                        if i < n_rows:
                            dg[0, t0 + i, h] = scan_s[0, i] + scan_s[1, 0]
                            dbeta[0, t0 + i, h] = db1_s[i] + db2_s[i]
                else:
                    # row i of the masked sum: sum_{j >= i} dg~_j + sum_j d_j <(K dS')_j, Vn_j> + gamma_C <dS', S>
                    for i in T.Parallel(C):
                        dgc_s[i] = tqw_s[i] - tdec_s[i] + xr_s[i] - xc_s[i]
                    for i, j in T.Parallel(C, C):
                        prodc_f[i, j] = (T.if_then_else(j >= i, dgc_s[j], 0.0) + tdec_s[j]
                                         + T.exp2(gc_s[C - 1] * LOG2E) * sd_s[j])
                    T.reduce_sum(prodc_f, red_r, dim=1)
                    for i in T.Parallel(C):
                        if i < n_rows:
                            dg[0, t0 + i, h] = red_r[i]
                            dbeta[0, t0 + i, h] = db1_s[i] + db2_s[i]

    return tilelang.compile(chunk_grad_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())
