"""Stage 1 inside the chunk loop: the gate warpgroup's gate cumsum and gated inverse Ag of one chunk of one value
head, made one chunk ahead of the state paths (``chunk_forward_rs`` with ``inverse_in_loop``).

Same math as ``kkt_inverse.py`` (DESIGN.md §2, C = 64, rows i, j of the chunk):

    g~_i  = sum_{s <= i} g_s                  L = StrictLower(diag(beta) K K^T)
    A     = (I + L)^{-1}                      Ag_ij = exp(g~_i - g~_j) A_ij beta_j   (j <= i, else 0)

blocked one level further: the four 16x16 diagonal blocks of A by forward substitution, one thread per column
with the column in registers (a chain of 16 rows: the gate's latency per chunk is what bounds this loop), joined
into two 32x32 blocks and then into A by ``A21 = -A22 (L21 A11)``, tf32 tensor-core products (the two 16 -> 32
joins as one product each, on block-diagonal 32x32 operands against the stacked 16-column blocks).
Here the work is one value head's (the CTA's), on the 128 threads of the gate warpgroup, and Ag goes straight
into the ring stage's shared tile that the state paths' ``W^T Ag^T`` reads: no Ag or g~ round trip through HBM
and no stage-1 kernel before the loop. The gate's K K^T is its own wgmma on K's tile (the state paths and P read
the same tile). g~ is each row's sum of four interleaved partial sums (one thread per row), so its rounding is
not the scan's of ``kkt_inverse``: other bits, the same error. ``chunk_cumsum_scan`` (the fused loop with
``state_p``) makes it by a shuffle scan on one warp instead: other bits again.

Measured (``benchmarks/results/h200/stages-hopper-v0.10b.json``, ``profiles/forward-v0.10-fused-*``): the gate
warpgroup issues ~1540 instructions per warp and chunk, most of them element-wise (Ag's 64x64 gating, P, Kd), one
warp per sub-partition, and is the loop's critical path: the state paths spend about half their samples waiting
on its barriers, and the op is 1.25x-1.9x the time of the rs loop with stage 1 apart. A loop to build on, not the
default; what it needs is fewer instructions on the gate per chunk (docs/hopper-notes.md, v0.10).

g and beta arrive in the ring beside q, k, v (``ring_producer`` with ``gate_rows``): rows past a sequence's end
are zero, so their rows and columns of Ag are zero and g~ is flat there, as the state paths expect.

``registers=True`` (``chunk_forward_rs``'s ``register_inverse``, an A/B) makes the inverse as stage 1's fastest
build does (``kkt_inverse`` with ``registers16``, ``registers8``, ``merge16_registers`` and ``merge32_quadrants``:
~1770 cycles a chunk alone on an H100 against ~3440 for stage 1's default, notes "v0.38e measured"): each of the
four warps eliminates its 16x16 diagonal block in registers, and the 16 -> 32 and 32 -> 64 merges are fp16
``mma.m16n8k16`` from registers and swizzled tiles (``inverse_registers.py``, the same macros as stage 1's). K K^T
goes from the wgmma's accumulator to a swizzled float32 tile as stage 1 stores it, in two 64x32 halves of columns:
a 16-register accumulator instead of 32 at the gate's 96 registers, where with the whole tile the values kept across
the wgmma spilled and were reloaded inside the 16x16 elimination (80 bytes of spills in ``state_p``'s build, 36 so).
The barriers between the phases are TileLang's own over the role's 128 threads (none of the macros branches on the
warp around a shared-memory write).

PyTorch counterparts: ``flashgdn.reference.chunked.chunk_local_cumsum``, ``kkt_inverse``, ``gated_inverse``.
"""
from types import SimpleNamespace

from .common import LOG2E
from .inverse_registers import make_register_inverse


def make_gate_inverse(C: int, K: int, io_dtype: str, first_thread: int, registers: bool = False):
    """The macros for one configuration; ``first_thread`` is the gate warpgroup's first thread index."""
    import tilelang
    import tilelang.language as T

    B = C // 2  # diagonal block of the inverse
    acc = "float32"
    # one value head (the CTA's); the ring stage st stands where stage 1 has a pair's index, so that beta's row is
    # b_s[st] (the macros read b_s[u * pair + p])
    ri = make_register_inverse(1, True) if registers else None

    @T.macro
    def gate_into_ring(a_s, st, b_s, gc_s, a11, a21, a22):
        # Ag = Gam ⊙ A ⊙ beta^T into the ring stage's tile, from A's blocks a11(i, j), a21, a22 (A12 = 0); exponents
        # clamped at 0 (A is 0 above the diagonal)
        for i, j in T.Parallel(B, B):
            a_s[st, i, j] = T.cast(
                a11(i, j) * b_s[st, j] * T.exp2(T.min(gc_s[st, i] - gc_s[st, j], 0.0) * LOG2E), io_dtype)
            a_s[st, B + i, j] = T.cast(
                a21(i, j) * b_s[st, j] * T.exp2(T.min(gc_s[st, B + i] - gc_s[st, j], 0.0) * LOG2E), io_dtype)
            a_s[st, B + i, B + j] = T.cast(
                a22(i, j) * b_s[st, B + j] * T.exp2(T.min(gc_s[st, B + i] - gc_s[st, B + j], 0.0) * LOG2E),
                io_dtype)
            a_s[st, i, B + j] = T.cast(0, io_dtype)

    @T.macro
    def chunk_cumsum(tx, g_s, gc_s, st, run):
        # one thread per row: the sum of the rows up to it, in four interleaved partial sums (a chain of 16 adds)
        if tx - first_thread < C:
            r = tx - first_thread
            for a in T.unroll(4):
                run[a] = 0.0
            for j in T.unroll(C):
                run[j % 4] = run[j % 4] + T.if_then_else(j <= r, g_s[st, j], 0.0)
            gc_s[st, r] = (run[0] + run[1]) + (run[2] + run[3])

    @T.macro
    def chunk_cumsum_scan(tx, g_s, gc_s, st, run):
        # the first warp: lane l rows 2l and 2l + 1, the pairs' inclusive sums scanned over the lanes by shuffles
        # (a chain of ~7 shuffles and adds instead of the 16 adds behind 64 shared loads of one thread a row)
        if tx - first_thread < 32:
            lane = tx - first_thread
            run[0] = g_s[st, 2 * lane]
            run[1] = g_s[st, 2 * lane + 1]
            run[2] = run[0] + run[1]
            for d in T.unroll(5):
                run[3] = T.shfl_up(run[2], 1 << d)
                if lane >= (1 << d):
                    run[2] = run[2] + run[3]
            run[3] = T.shfl_up(run[2], 1)  # the sum of the rows before 2l (lane 0: none)
            run[3] = T.if_then_else(lane == 0, T.float32(0), run[3])
            gc_s[st, 2 * lane] = run[3] + run[0]
            gc_s[st, 2 * lane + 1] = (run[3] + run[0]) + run[1]

    @T.macro
    def gated_inverse(tx, k_s, b_s, gc_s, a_s, st, kk_f, kk_s, d_s, l21_s, t_s, m_f, x, part, s16_s, t16_s, m16_f):
        T.gemm(k_s[st, :, :], k_s[st, :, :], kk_f, transpose_B=True, clear_accum=True)
        T.copy(kk_f, kk_s)
        # 16-blocks: thread -> (16-block d, column c), column c in x; block d is quadrant d % 2 of 32-block d // 2
        if tx - first_thread < C:
            d = (tx - first_thread) // 16
            r0 = d * 16
            c = (tx - first_thread) % 16
            for r in T.unroll(16):
                x[r] = 0.0
            for r in T.unroll(16):
                part[0] = 0.0
                part[1] = 0.0
                for j in T.unroll(r):
                    part[j % 2] += kk_s[r0 + r, r0 + j] * x[j]
                x[r] = T.if_then_else(r == c, 1.0, T.if_then_else(r < c, 0.0, -b_s[st, r0 + r] * (part[0] + part[1])))
            for r in T.unroll(16):
                d_s[d // 2, (d % 2) * 16 + r, (d % 2) * 16 + c] = x[r]
                if d % 2 == 0:  # the 32-block's upper right quadrant
                    d_s[d // 2, r, 16 + c] = 0.0
        # 16 -> 32 in both 32-blocks: T = blockdiag(L21) [A11; A11'], A21 = -blockdiag(A22) T
        for r, c2 in T.Parallel(B, B):
            l21_s[r, c2] = T.if_then_else(
                r // 16 == c2 // 16,
                b_s[st, (r // 16) * B + 16 + r % 16] * kk_s[(r // 16) * B + 16 + r % 16, (r // 16) * B + c2 % 16], 0.0)
        for r, c2 in T.Parallel(B, 16):
            s16_s[r, c2] = d_s[r // 16, r % 16, c2]
        T.gemm(l21_s, s16_s, m16_f, clear_accum=True)
        T.copy(m16_f, t16_s)
        for r, c2 in T.Parallel(B, B):
            l21_s[r, c2] = T.if_then_else(r // 16 == c2 // 16, d_s[r // 16, 16 + r % 16, 16 + c2 % 16], 0.0)
        T.gemm(l21_s, t16_s, m16_f, clear_accum=True)
        for r, c2 in T.Parallel(B, 16):
            d_s[r // 16, 16 + r % 16, c2] = -m16_f[r, c2]
        # off-diagonal block: A21 = -A22 (L21 A11)
        for r, c2 in T.Parallel(B, B):
            l21_s[r, c2] = b_s[st, B + r] * kk_s[B + r, c2]
        T.gemm(l21_s, d_s[0, :, :], m_f, clear_accum=True)
        T.copy(m_f, t_s)
        T.gemm(d_s[1, :, :], t_s, m_f, clear_accum=True)
        for r, c2 in T.Parallel(B, B):
            d_s[2, r, c2] = -m_f[r, c2]
        gate_into_ring(a_s, st, b_s, gc_s, lambda i, j: d_s[0, i, j], lambda i, j: d_s[2, i, j],
                       lambda i, j: d_s[1, i, j])

    @T.macro
    def gated_inverse_registers(tx, k_s, b_s, gc_s, a_s, st, rb, mark=None):
        # (mark(point): a trace build's stamp after each phase, points 3-6 of chunk_forward_rs.TRACE_POINTS_OF)
        u = tx - first_thread  # the thread's index in the role: its warp and lane, as in stage 1's CTA
        # K K^T by halves of its columns (k's rows 0..31, then 32..63): half the accumulator's registers
        T.gemm(k_s[st, :, :], k_s[st, 0:B, :], rb.kk_f, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(C, B):
            rb.kk_s[i, ri.kk_col(i, j)] = rb.kk_f[i, j]
        T.gemm(k_s[st, :, :], k_s[st, B:C, :], rb.kk_f, transpose_B=True, clear_accum=True)
        for i, j in T.Parallel(C, B):
            rb.kk_s[i, ri.kk_col(i, B + j)] = rb.kk_f[i, j]
        if mark is not None:
            mark(3)
        ri.eliminate16(rb.kk_s, b_s, rb.d_s, st, u, rb.kr, rb.xr, rb.br, rb.xj, rb.kj)
        ri.merge8_in_registers(rb.kk_s, b_s, rb.d_s, st, u, rb.xr, rb.fh, rb.bh, rb.fc, rb.ft)
        if mark is not None:
            mark(4)
        ri.merge16_in_registers(rb.kk_s, b_s, rb.d_s, st, u, rb.xr, rb.fh, rb.bh, rb.fc, rb.ft, rb.ar)
        if mark is not None:
            mark(5)
        ri.merge32_quadrant_product(rb.kk_s, b_s, rb.d_s, rb.x32_s, st, u, rb.fh, rb.bh, rb.fc32)
        ri.merge32_quadrant_finish(rb.d_s, rb.x32_s, u, rb.fh, rb.bh, rb.fc32)
        ri.merge32_quadrant_store(rb.x32_s, u, rb.fc32)
        if mark is not None:
            mark(6)
        gate_into_ring(a_s, st, b_s, gc_s, lambda i, j: rb.d_s[0, 0, i, j], lambda i, j: rb.x32_s[0, i, j],
                       lambda i, j: rb.d_s[0, 1, i, j])

    def register_buffers():
        """The register build's buffers, allocated where it is called (inside the kernel, in the gate's role)."""
        d_s = T.alloc_shared((1, 2, B, B), acc)  # A11, A22
        x32_s = T.alloc_shared((1, B, B), acc)  # X = L21 A11, then A21 over it
        # stage 1's layout for them: the fragments' element reads on distinct banks
        T.annotate_layout({d_s: tilelang.layout.make_swizzled_layout(d_s),
                           x32_s: tilelang.layout.make_swizzled_layout(x32_s)})
        return SimpleNamespace(
            kk_f=T.alloc_fragment((C, B), acc),  # a half of K K^T's columns
            kk_s=T.alloc_shared((C, C), acc),
            d_s=d_s,
            x32_s=x32_s,
            kr=T.alloc_local((8,), acc),  # K K^T at the lane's 8 places of its warp's block
            xr=T.alloc_local((8,), acc),  # the block's inverse there
            br=T.alloc_local((2,), acc),  # beta of the lane's two rows
            xj=T.alloc_local((4,), acc),
            kj=T.alloc_local((4,), acc),
            fh=T.alloc_local((8,), "float16"),  # an mma.m16n8k16 A fragment
            bh=T.alloc_local((4,), "float16"),  # and a B fragment
            fc=T.alloc_local((8,), acc),
            ft=T.alloc_local((8,), acc),
            ar=T.alloc_local((8,), acc),  # an odd warp's A21'
            fc32=T.alloc_local((8,), acc),
            run=T.alloc_local((4,), acc),
        )

    def buffers():
        """The gate's own buffers, allocated where it is called (inside the kernel)."""
        if registers:
            return register_buffers()
        return SimpleNamespace(
            kk_f=T.alloc_fragment((C, C), acc),
            kk_s=T.alloc_shared((C, C), acc),
            d_s=T.alloc_shared((3, B, B), acc),  # 0 = A11, 1 = A22, 2 = A21
            l21_s=T.alloc_shared((B, B), acc),
            t_s=T.alloc_shared((B, B), acc),
            m_f=T.alloc_fragment((B, B), acc),
            x=T.alloc_local((16,), acc),
            s16_s=T.alloc_shared((B, 16), acc),  # the two A11 16-blocks, stacked
            t16_s=T.alloc_shared((B, 16), acc),
            m16_f=T.alloc_fragment((B, 16), acc),
            part=T.alloc_local((2,), acc),
            run=T.alloc_local((4,), acc),
        )

    return SimpleNamespace(chunk_cumsum=chunk_cumsum, chunk_cumsum_scan=chunk_cumsum_scan, gated_inverse=gated_inverse,
                           gated_inverse_registers=gated_inverse_registers, buffers=buffers)
