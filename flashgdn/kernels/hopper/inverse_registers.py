"""The register-level pieces of the gate-free inverse A = (I + L)^{-1}, L = StrictLower(diag(beta) K K^T), of one 64-row
chunk on four warps, shared by stage 1 (``kkt_inverse``'s v0.38 options) and the chunk loop that makes the inverse
itself (``gate_inverse``'s register build). Each warp w owns the 16x16 diagonal block D_w of rows 16w..16w+15:

    D_w           = (I + L_ww)^{-1}                     eliminate16 (registers16; registers8: two 8x8 blocks at once,
                                                          merged by merge8_in_registers)
    A21' (16->32) = -D_(2m+1) (L_(2m+1,2m) D_2m)          merge16_in_registers, on warp 2m + 1, fp16 mma.m16n8k16
    A21  (32->64) = -A22 (L21 A11)                      merge32_quadrant_*, a 16x16 quadrant a warp, fp16 mma

K K^T is read from a 64x64 float32 tile stored with ``kk_col``'s swizzle, beta from ``b_s[hp, row]`` with hp = u *
pair + p (u: the pair's index, p: the head within it), and the blocks go to ``d_s[p, block, row, col]`` (block 0 =
A11, 1 = A22) and A21 to ``x32_s[p]``, both in the swizzled layout ``T.gemm`` would give them. The lane mappings of
the fragments are emulated on the CPU (``tests/test_kkt_registers16_model.py``). None of these macros holds a
barrier: each caller puts its own between the phases (a CTA's in stage 1; in a warp-specialised role, TileLang's
automatic ones over the role's threads).

PyTorch counterpart: ``flashgdn.reference.chunked.kkt_inverse``.
"""
from types import SimpleNamespace

H = 16  # a diagonal block of the first level
B = 32  # a diagonal block of the second


def make_register_inverse(pair: int, registers8: bool):
    """The macros for ``pair`` value heads side by side (1 or 2); ``registers8`` makes eliminate16's blocks from 8x8
    ones."""
    import tilelang.language as T

    def kk_col(i, j):
        # where K K^T's (i, j) lives in kk_s. Unswizzled, a warp's accumulator stores (8 rows x 4 column pairs, rows
        # 256 bytes apart) fall on the same 8 banks: 4-way conflicts. XOR-ing the column with 8 (i % 4) + (i // 4) % 2
        # sends the 8 rows' columns to 32 distinct banks, moves no element out of its aligned group of 4 floats (the
        # substitution reads them 16 bytes at a time) and keeps kk_s the size of k's tile, whose space it reuses.
        return j ^ ((i % 4) * 8 + (i // 4) % 2)

    @T.macro
    def warp_mma(shape, ab_dtype, fa, fb, fc, c_offset):
        # fc[c_offset : c_offset + 4] += a b for one mma.sync of this warp's fragments (row A, col B, float32 C)
        T.ptx_mma("float32", shape, "row", "col", ab_dtype, ab_dtype, "fp32", fa.data, 0, fb.data, 0, fc.data,
                  c_offset, False)

    # registers16's lane mapping: lane (g, t) holds rows g + 8 rh (rh = 0, 1) of its warp's 16x16 block at columns
    # lane_col(t, cc) (cc = 0..3), element (rh, cc) in register 4 rh + cc; the same element is a[a_slot(rh, cc)] of an
    # mma.m16n8k16 A fragment. A B fragment's b[i] is row b_row(t, i) and column g + 8 nt; a C fragment's c[4 nt + i]
    # is row g + 8 (i / 2) and column 8 nt + c_col(t, i)
    def lane_col(tq, cc):
        return 2 * tq + cc % 2 + 8 * (cc // 2)

    def a_slot(rh, cc):
        return 2 * rh + 4 * (cc // 2) + cc % 2

    def b_row(tq, i):
        return 2 * tq + i % 2 + 8 * (i // 2)

    def c_col(tq, i):
        return 2 * tq + i % 2

    @T.macro
    def a_fragment(fh, at, gq, tq):
        # an mma.m16n8k16 A fragment (fp16) of the 16x16 tile whose element (r, c) is at(r, c)
        for rh in T.unroll(2):
            for cc in T.unroll(4):
                fh[a_slot(rh, cc)] = T.cast(at(gq + 8 * rh, lane_col(tq, cc)), "float16")

    @T.macro
    def a_fragment_of_block(fh, xr, p):
        # the A fragment of head p's 16x16 block as the elimination left it in registers: the same mapping
        for rh in T.unroll(2):
            for cc in T.unroll(4):
                fh[a_slot(rh, cc)] = T.cast(xr[8 * p + 4 * rh + cc], "float16")

    @T.macro
    def eliminate16(kk_s, b_s, d_s, u, tx, kr, xr, br, xj, kj):
        # registers16: diagonal block w = tx / 32 of every head of pair u, in registers (the docstring's mapping)
        w = tx // 32
        gq = (tx % 32) // 4
        tq = tx % 4
        r0 = 16 * w
        for rh in T.unroll(2):
            for cc in T.unroll(4):
                kr[4 * rh + cc] = kk_s[r0 + gq + 8 * rh, kk_col(r0 + gq + 8 * rh, r0 + lane_col(tq, cc))]
            for p in T.unroll(pair):
                br[2 * p + rh] = b_s[u * pair + p, r0 + gq + 8 * rh]
                for cc in T.unroll(4):
                    xr[8 * p + 4 * rh + cc] = T.if_then_else(gq + 8 * rh == lane_col(tq, cc), 1.0, 0.0)
        if registers8:
            # the block's two 8x8 diagonal blocks at once, 7 steps (block 0's row g in registers 0 and 1, block 1's row
            # 8 + g in 6 and 7: the same source lanes for both); its lower left stays zero for merge8_in_registers
            for j in T.unroll(7):
                for rh in T.unroll(2):
                    kj[rh] = T.shfl_sync(kr[6 * rh + j % 2], 4 * gq + j // 2)
                for p in T.unroll(pair):
                    for rh in T.unroll(2):
                        for c2 in T.unroll(2):
                            xj[2 * rh + c2] = T.shfl_sync(xr[8 * p + 6 * rh + c2], 4 * j + tq)
                    for rh in T.unroll(2):
                        kj[2 + rh] = T.if_then_else(gq > j, -br[2 * p + rh] * kj[rh], 0.0)
                        for c2 in T.unroll(2):
                            xr[8 * p + 6 * rh + c2] = xr[8 * p + 6 * rh + c2] + kj[2 + rh] * xj[2 * rh + c2]
        else:
            for j in T.unroll(H - 1):
                for rh in T.unroll(2):  # (K K^T)_ij of this lane's rows, from the quad's lane that holds column j
                    kj[rh] = T.shfl_sync(kr[4 * rh + 2 * (j // 8) + j % 2], 4 * gq + (j % 8) // 2)
                for p in T.unroll(pair):
                    for cc in T.unroll(4):  # row j, final: every update to it came from the rows above
                        xj[cc] = T.shfl_sync(xr[8 * p + 4 * (j // 8) + cc], 4 * (j % 8) + tq)
                    for rh in T.unroll(2):
                        kj[2 + rh] = T.if_then_else(gq + 8 * rh > j, -br[2 * p + rh] * kj[rh], 0.0)
                        for cc in T.unroll(4):
                            xr[8 * p + 4 * rh + cc] = xr[8 * p + 4 * rh + cc] + kj[2 + rh] * xj[cc]
        # block w is quadrant w % 2 of 32x32 block w / 2; its other quadrant in this column range is zero (the upper
        # right for an odd w; the lower left, written by the merge below, for an even one)
        for p in T.unroll(pair):
            for rh in T.unroll(2):
                for cc in T.unroll(4):
                    d_s[p, w // 2, (w % 2) * H + gq + 8 * rh, (w % 2) * H + lane_col(tq, cc)] = xr[8 * p + 4 * rh + cc]
                    d_s[p, w // 2, H - (w % 2) * H + gq + 8 * rh, (w % 2) * H + lane_col(tq, cc)] = 0.0

    @T.macro
    def merge8_in_registers(kk_s, b_s, d_s, u, tx, xr, fh, bh, fc, ft):
        # registers8: the lower left 8x8 of warp w's block, A10 = -D1 L10 D0, as the lower left of -D (Lo D) with D =
        # diag(D0, D1) as stored and Lo = L's lower left quadrant: Z^T = D^T Lo^T (A: D^T from d_s; B: Lo^T from the
        # swizzled K K^T; only n-tile 1, Z's rows 8-15, is not zero), then D Z (A: D from registers; B: Z from the same
        # lane's accumulators of Z^T, as in merge16_in_registers; n-tile 0). Every warp runs it: no branch.
        w = tx // 32
        gq = (tx % 32) // 4
        tq = tx % 4
        r0 = 16 * w
        o = (w % 2) * H
        for p in T.unroll(pair):
            hp = u * pair + p
            a_fragment(fh, lambda r, c: d_s[p, w // 2, o + c, o + r], gq, tq)  # D^T
            for i in T.unroll(4):
                bh[i] = T.cast(T.if_then_else(
                    b_row(tq, i) < 8,
                    b_s[hp, r0 + 8 + gq] * kk_s[r0 + 8 + gq, kk_col(r0 + 8 + gq, r0 + b_row(tq, i))], 0.0), "float16")
                ft[i] = 0.0
            warp_mma("m16n8k16", "fp16", fh, bh, ft, 0)
            a_fragment_of_block(fh, xr, p)
            for i in T.unroll(4):  # Z at (b_row(tq, i), gq): zero above row 8, else Z^T's C element (0, i % 2)
                bh[i] = T.cast(T.if_then_else(i >= 2, ft[i % 2], 0.0), "float16")
                fc[i] = 0.0
            warp_mma("m16n8k16", "fp16", fh, bh, fc, 0)
            for c2 in T.unroll(2):
                xr[8 * p + 4 + c2] = -fc[2 + c2]
        for p in T.unroll(pair):
            for c2 in T.unroll(2):
                d_s[p, w // 2, o + 8 + gq, o + lane_col(tq, c2)] = xr[8 * p + 4 + c2]

    @T.macro
    def mma_fp16(fh, bh, fc, nt, gq, tq, b_at):
        # fc[4 nt : 4 nt + 4] += a b for n-tile nt: one mma.m16n8k16 on fp16 fragments (float32 accumulation), the B
        # fragment read by b_at(k, n)
        for i in T.unroll(4):
            bh[i] = T.cast(b_at(b_row(tq, i), gq + 8 * nt), "float16")
        warp_mma("m16n8k16", "fp16", fh, bh, fc, 4 * nt)

    @T.macro
    def l_fragment(fh, b_s, kk_s, hp, r0, c0, gq, tq):
        # an mma.m16n8k16 A fragment of L = diag(beta) K K^T (fp16) at rows r0 .., columns c0 .. of value head hp
        a_fragment(fh, lambda r, c: b_s[hp, r0 + r] * kk_s[r0 + r, kk_col(r0 + r, c0 + c)], gq, tq)

    @T.macro
    def merge16_in_registers(kk_s, b_s, d_s, u, tx, xr, fh, bh, fc, ft, ar):
        # merge16_registers: warp 2m + 1 joins 32-block m of every head of pair u (the docstring's products), its
        # fragments as above, A21' left in ar. Nothing in the branch touches shared memory but reads: X is made
        # transposed (X^T = D_2m^T L21'^T) because a C fragment of X^T holds, in the same lane, the B fragment of X that
        # the second product needs, and A21' is stored after the branch by every warp. A hazard inside the branch
        # would make TileLang put a CTA barrier there, where only two of the four warps arrive.
        w = tx // 32
        gq = (tx % 32) // 4
        tq = tx % 4
        for i in T.unroll(8 * pair):
            ar[i] = 0.0
        if w % 2 == 1:
            r0 = 16 * w
            for p in T.unroll(pair):
                hp = u * pair + p
                a_fragment(fh, lambda r, c: d_s[p, w // 2, c, r], gq, tq)  # D_2m^T
                for i in T.unroll(8):
                    ft[i] = 0.0
                for nt in T.unroll(2):
                    mma_fp16(fh, bh, ft, nt, gq, tq,
                             lambda k_, n: b_s[hp, r0 + n] * kk_s[r0 + n, kk_col(r0 + n, r0 - H + k_)])
                a_fragment_of_block(fh, xr, p)
                for i in T.unroll(8):
                    fc[i] = 0.0
                for nt in T.unroll(2):
                    for i in T.unroll(4):  # X at (b_row(tq, i), gq + 8 nt) is X^T's C element (nt, b_row)
                        bh[i] = T.cast(ft[4 * (i // 2) + 2 * nt + i % 2], "float16")
                    warp_mma("m16n8k16", "fp16", fh, bh, fc, 4 * nt)
                for nt in T.unroll(2):
                    for i in T.unroll(4):  # A21' as element (rh, cc) = (i / 2, 2 nt + i % 2)
                        ar[8 * p + 4 * (i // 2) + 2 * nt + i % 2] = -fc[4 * nt + i]
        # an odd warp's A21' into its 32-block's lower left; an even warp's zeros into the upper right, zero already
        for p in T.unroll(pair):
            for rh in T.unroll(2):
                for cc in T.unroll(4):
                    d_s[p, w // 2, (w % 2) * H + gq + 8 * rh, (1 - w % 2) * H + lane_col(tq, cc)] = ar[8 * p + 4 * rh + cc]

    @T.macro
    def merge32_quadrant_product(kk_s, b_s, d_s, x32_s, u, tx, fh, bh, fc32):
        # merge32_quadrants: warp w's quadrant (w / 2, w % 2) of X = L21 A11, for every head of pair u, into x32_s
        w = tx // 32
        gq = (tx % 32) // 4
        tq = tx % 4
        for p in T.unroll(pair):
            for i in T.unroll(8):
                fc32[i] = 0.0
            for ks in T.unroll(2):
                l_fragment(fh, b_s, kk_s, u * pair + p, B + 16 * (w // 2), 16 * ks, gq, tq)
                for nt in T.unroll(2):
                    mma_fp16(fh, bh, fc32, nt, gq, tq, lambda k_, n: d_s[p, 0, 16 * ks + k_, 16 * (w % 2) + n])
            for nt in T.unroll(2):
                for i in T.unroll(4):
                    x32_s[p, 16 * (w // 2) + gq + 8 * (i // 2), 16 * (w % 2) + 8 * nt + c_col(tq, i)] = fc32[4 * nt + i]

    @T.macro
    def merge32_quadrant_finish(d_s, x32_s, tx, fh, bh, fc32):
        # warp w's quadrant of A22 X for every head, head p's in fc32[8 p ..]
        w = tx // 32
        gq = (tx % 32) // 4
        tq = tx % 4
        for p in T.unroll(pair):
            for i in T.unroll(8):
                fc32[8 * p + i] = 0.0
            for ks in T.unroll(2):
                a_fragment(fh, lambda r, c: d_s[p, 1, 16 * (w // 2) + r, 16 * ks + c], gq, tq)  # A22's rows
                for nt in T.unroll(2):
                    for i in T.unroll(4):
                        bh[i] = T.cast(x32_s[p, 16 * ks + b_row(tq, i), 16 * (w % 2) + gq + 8 * nt], "float16")
                    warp_mma("m16n8k16", "fp16", fh, bh, fc32, 8 * p + 4 * nt)

    @T.macro
    def merge32_quadrant_store(x32_s, tx, fc32):
        # A21 = -(A22 X) over X, once every warp's reads of X are done
        w = tx // 32
        gq = (tx % 32) // 4
        tq = tx % 4
        for p in T.unroll(pair):
            for nt in T.unroll(2):
                for i in T.unroll(4):
                    x32_s[p, 16 * (w // 2) + gq + 8 * (i // 2), 16 * (w % 2) + 8 * nt + c_col(tq, i)] = \
                        -fc32[8 * p + 4 * nt + i]

    return SimpleNamespace(
        kk_col=kk_col,
        warp_mma=warp_mma,
        lane_col=lane_col,
        a_slot=a_slot,
        b_row=b_row,
        c_col=c_col,
        a_fragment=a_fragment,
        a_fragment_of_block=a_fragment_of_block,
        eliminate16=eliminate16,
        merge8_in_registers=merge8_in_registers,
        mma_fp16=mma_fp16,
        l_fragment=l_fragment,
        merge16_in_registers=merge16_in_registers,
        merge32_quadrant_product=merge32_quadrant_product,
        merge32_quadrant_finish=merge32_quadrant_finish,
        merge32_quadrant_store=merge32_quadrant_store,
    )
