"""The lane mapping of stage 1's ``registers16`` (its macros in ``inverse_registers.py``, shared by ``kkt_inverse.py``
and the fused loop's ``gate_inverse.py``), emulated on the CPU: a 16x16 diagonal block of (I + L)^{-1} by elimination
in one warp's registers, rows exchanged by shuffles, read from K K^T stored with the kernel's XOR swizzle (``kk_col``),
equals the float64 inverse. The kernel's macro ``eliminate16`` does what
``eliminate16_lanes`` does here, index for index: a wrong source lane or register in either is a wrong block."""
import torch


def kk_col(i, j):
    # kkt_inverse's swizzle of K K^T's columns in shared memory (its kk_col)
    return j ^ ((i % 4) * 8 + (i // 4) % 2)


def eliminate16_lanes(kk_s, beta, w):
    """Block w of (I + StrictLower(diag(beta) K K^T))^{-1} as warp w's 32 lanes make it: lane (g, t) holds rows g and
    g + 8 at columns 2t, 2t + 1, 8 + 2t, 9 + 2t, register 4 rh + cc; a shuffle reads another lane's register."""
    r0 = 16 * w
    lanes = range(32)

    def row(lane, rh):
        return lane // 4 + 8 * rh

    def col(lane, cc):
        return 2 * (lane % 4) + cc % 2 + 8 * (cc // 2)

    kr = [[kk_s[r0 + row(ln, rh), kk_col(r0 + row(ln, rh), r0 + col(ln, cc))].item() for rh in (0, 1)
           for cc in range(4)] for ln in lanes]
    br = [[beta[r0 + row(ln, rh)].item() for rh in (0, 1)] for ln in lanes]
    xr = [[1.0 if row(ln, rh) == col(ln, cc) else 0.0 for rh in (0, 1) for cc in range(4)] for ln in lanes]
    for j in range(15):
        # every lane's shuffles read the registers as they were before this step
        kj = [[kr[4 * (ln // 4) + (j % 8) // 2][4 * rh + 2 * (j // 8) + j % 2] for rh in (0, 1)] for ln in lanes]
        xj = [[xr[4 * (j % 8) + ln % 4][4 * (j // 8) + cc] for cc in range(4)] for ln in lanes]
        for ln in lanes:
            for rh in (0, 1):
                f = -br[ln][rh] * kj[ln][rh] if row(ln, rh) > j else 0.0
                for cc in range(4):
                    xr[ln][4 * rh + cc] += f * xj[ln][cc]
    return block_of_lanes(xr)


def chunk(seed):
    """Random unit keys (rows 20-39 sharing a direction), betas in (0, 1), K K^T swizzled as the kernel stores it, and
    the float64 inverse of the whole chunk."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(64, 128, generator=gen, dtype=torch.float64), dim=-1)
    k[20:40] = torch.nn.functional.normalize(k[20] + 0.3 * k[20:40], dim=-1)
    beta = torch.rand(64, generator=gen, dtype=torch.float64)
    kk = k @ k.T
    kk_s = torch.empty_like(kk)
    for i in range(64):
        for j in range(64):
            kk_s[i, kk_col(i, j)] = kk[i, j]
    full = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + torch.tril(beta[:, None] * kk, -1))
    return kk_s, beta, full


def test_each_warps_block_is_the_inverse_of_its_diagonal_block():
    # (the inverse of a lower triangular matrix has the inverses of its diagonal blocks on its diagonal)
    kk_s, beta, full = chunk(0)
    for w in range(4):
        blk = slice(16 * w, 16 * w + 16)
        want = full[blk, blk]
        got = eliminate16_lanes(kk_s, beta, w)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (w, (got - want).abs().max())
        assert torch.equal(torch.triu(got, 1), torch.zeros(16, 16, dtype=torch.float64))


def mma_m16n8k16(a_frags, b_frags):
    """What ``mma.m16n8k16`` (row, col; fp16 in, float32 out) gives each lane, from each lane's fragments as PTX lays
    them out: a[i] at (g + 8 ((i // 2) % 2), 2t + i % 2 + 8 (i // 4)), b[i] at (k = 2t + i % 2 + 8 (i // 2), n = g),
    c[i] at (g + 8 (i // 2), 2t + i % 2)."""
    A = torch.zeros(16, 16, dtype=torch.float64)
    Bm = torch.zeros(16, 8, dtype=torch.float64)
    for ln in range(32):
        g, t = ln // 4, ln % 4
        for i in range(8):
            A[g + 8 * ((i // 2) % 2), 2 * t + i % 2 + 8 * (i // 4)] = a_frags[ln][i]
        for i in range(4):
            Bm[2 * t + i % 2 + 8 * (i // 2), g] = b_frags[ln][i]
    C = A @ Bm
    return [[C[ln // 4 + 8 * (i // 2), 2 * (ln % 4) + i % 2].item() for i in range(4)] for ln in range(32)]


def fp16(x):
    return torch.tensor(x, dtype=torch.float64).to(torch.float16).double().item()


def a_fragments(value):
    """Each lane's A fragment (fp16) from ``value(lane, rh, cc)``, its element (rh, cc) of registers16's mapping, at
    the fragment's slot 2 rh + 4 (cc // 2) + cc % 2."""
    frags = [[0.0] * 8 for _ in range(32)]
    for ln in range(32):
        for rh in (0, 1):
            for cc in range(4):
                frags[ln][2 * rh + 4 * (cc // 2) + cc % 2] = fp16(value(ln, rh, cc))
    return frags


def product(a, b_at, n_tiles):
    """The 16 x 8 n_tiles product of one warp: A fragments ``a``, B fragment element i of n-tile nt read as
    ``b_at(k, n)`` (k = 2t + i % 2 + 8 (i // 2), n = 8 nt + g), fp16; returned as a float64 tile."""
    out = torch.zeros(16, 8 * n_tiles, dtype=torch.float64)
    for nt in range(n_tiles):
        b = [[fp16(b_at(2 * (ln % 4) + i % 2 + 8 * (i // 2), 8 * nt + ln // 4)) for i in range(4)] for ln in range(32)]
        c = mma_m16n8k16(a, b)
        for ln in range(32):
            for i in range(4):
                out[ln // 4 + 8 * (i // 2), 8 * nt + 2 * (ln % 4) + i % 2] = c[ln][i]
    return out


def lane_col(ln, cc):
    return 2 * (ln % 4) + cc % 2 + 8 * (cc // 2)


def block_of_lanes(regs):
    """The 16x16 block a warp holds in registers16's mapping: lane ln's register 4 rh + cc is element (ln // 4 + 8 rh,
    lane_col(ln, cc))."""
    out = torch.zeros(16, 16, dtype=torch.float64)
    for ln in range(32):
        for rh in (0, 1):
            for cc in range(4):
                out[ln // 4 + 8 * rh, lane_col(ln, cc)] = regs[ln][4 * rh + cc]
    return out


def merge16_lanes(kk_s, beta, m, d_lo, d_hi):
    """``merge16_in_registers`` on warp 2m + 1, lane by lane: X^T = D_2m^T L21'^T (D_2m^T's A fragments from the
    stored block, L21'^T's B fragments from the swizzled K K^T), then A21' = -D_2m+1 X with X's B fragments taken from
    X^T's C fragments in the same lane, and A21' by way of the lane's ``ar`` registers to the place it is stored."""
    r0 = 16 * (2 * m + 1)

    def l21(r, c):
        return beta[r0 + r].item() * kk_s[r0 + r, kk_col(r0 + r, r0 - 16 + c)].item()

    a1 = a_fragments(lambda ln, rh, cc: d_lo[lane_col(ln, cc), ln // 4 + 8 * rh].item())
    # xt[nt][lane][i]: X^T at (g + 8 (i // 2), 8 nt + 2t + i % 2)
    xt = [mma_m16n8k16(a1, [[fp16(l21(8 * nt + ln // 4, 2 * (ln % 4) + i % 2 + 8 * (i // 2))) for i in range(4)]
                            for ln in range(32)]) for nt in range(2)]
    a2 = a_fragments(lambda ln, rh, cc: d_hi[ln // 4 + 8 * rh, lane_col(ln, cc)].item())
    ar = [[0.0] * 8 for _ in range(32)]
    for nt in range(2):
        c = mma_m16n8k16(a2, [[fp16(xt[i // 2][ln][2 * nt + i % 2]) for i in range(4)] for ln in range(32)])
        for ln in range(32):
            for i in range(4):
                ar[ln][4 * (i // 2) + 2 * nt + i % 2] = -c[ln][i]
    return block_of_lanes(ar)


def test_the_16_to_32_merge_from_registers_gives_the_lower_left_block():
    """``merge16_registers`` as warp 2m + 1 runs it (``merge16_in_registers``): X^T = D_2m^T L21'^T with D_2m^T from
    the stored block and L21'^T from the swizzled K K^T, then -D_2m+1 X with D_2m+1 from the elimination's registers
    and X from X^T's accumulators in the same lane; fp16 operands, so within fp16's rounding of the float64 block."""
    kk_s, beta, full = chunk(1)
    for m in range(2):
        got = merge16_lanes(kk_s, beta, m, eliminate16_lanes(kk_s, beta, 2 * m), eliminate16_lanes(kk_s, beta, 2 * m + 1))
        want = full[32 * m + 16:32 * m + 32, 32 * m:32 * m + 16]
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-3, (m, err)


def test_the_32_to_64_merge_from_registers_gives_the_lower_left_block():
    """``merge32_registers`` as warps 2 and 3 run it (``merge32_in_registers_product`` and ``_finish``): X = L21 A11
    with L21 from their rows of the swizzled K K^T and A11 as B from the stored 32x32 block (its zero upper right
    skipped), then A21 = -A22 X with A22's rows from registers (warp 2: D_2; warp 3: its A21' and D_3) and X as B from
    shared memory: within fp16's rounding of the float64 block, all three levels emulated."""
    kk_s, beta, full = chunk(2)
    d = [eliminate16_lanes(kk_s, beta, w) for w in range(4)]
    a21p = [merge16_lanes(kk_s, beta, m, d[2 * m], d[2 * m + 1]) for m in range(2)]
    a11 = torch.zeros(32, 32, dtype=torch.float64)
    a11[:16, :16], a11[16:, :16], a11[16:, 16:] = d[0], a21p[0], d[1]
    x = torch.zeros(32, 32, dtype=torch.float64)
    for w in (2, 3):
        r0 = 16 * w
        part = torch.zeros(16, 32, dtype=torch.float64)
        for ks in (0, 1):
            a = a_fragments(lambda ln, rh, cc: beta[r0 + ln // 4 + 8 * rh].item()
                            * kk_s[r0 + ln // 4 + 8 * rh, kk_col(r0 + ln // 4 + 8 * rh, 16 * ks + lane_col(ln, cc))].item())
            tiles = 4 if ks == 1 else 2  # A11's upper right is zero: n-tiles 2, 3 take the second k-step only
            part[:, :8 * tiles] += product(a, lambda k_, n: a11[16 * ks + k_, n].item(), tiles)
        x[16 * (w - 2):16 * (w - 1)] = part
    got = torch.zeros(32, 32, dtype=torch.float64)
    for w in (2, 3):
        acc = torch.zeros(16, 32, dtype=torch.float64)
        for ks in (0, 1):
            if ks == 1 or w == 3:
                blk = a21p[1] if ks == 0 else d[w]  # warp 3's A21' (kept from its merge), else the warp's D
                a = a_fragments(lambda ln, rh, cc: blk[ln // 4 + 8 * rh, lane_col(ln, cc)].item())
                row0 = 16 * (ks * (w - 2))
                acc += product(a, lambda k_, n: x[row0 + k_, n].item(), 4)
        got[16 * (w - 2):16 * (w - 1)] = -acc
    want = full[32:, :32]
    err = ((got - want).norm() / want.norm()).item()
    assert err < 3e-3, err


def test_the_32_to_64_merge_by_quadrants_gives_the_lower_left_block():
    """``merge32_quadrants`` as the four warps run it (``merge32_quadrant_product``, ``_finish``, ``_store``): warp w
    makes quadrant (w // 2, w % 2) of X = L21 A11 (L21's rows from the swizzled K K^T, A11 as B from the stored
    32x32 block, both k-steps, the zero upper right included), then of A21 = -A22 X (A22's rows from the stored
    block, X's quadrants as B): within fp16's rounding of the float64 block, with the 16 -> 32 merges emulated too."""
    kk_s, beta, full = chunk(3)
    d = [eliminate16_lanes(kk_s, beta, w) for w in range(4)]
    a21p = [merge16_lanes(kk_s, beta, m, d[2 * m], d[2 * m + 1]) for m in range(2)]
    blocks = []
    for m in range(2):
        blk = torch.zeros(32, 32, dtype=torch.float64)
        blk[:16, :16], blk[16:, :16], blk[16:, 16:] = d[2 * m], a21p[m], d[2 * m + 1]
        blocks.append(blk)
    a11, a22 = blocks
    x = torch.zeros(32, 32, dtype=torch.float64)
    for w in range(4):
        qr, qc = w // 2, w % 2
        part = torch.zeros(16, 16, dtype=torch.float64)
        for ks in (0, 1):
            r0 = 32 + 16 * qr

            def l21(ln, rh, cc):
                r = r0 + ln // 4 + 8 * rh
                return beta[r].item() * kk_s[r, kk_col(r, 16 * ks + lane_col(ln, cc))].item()

            a = a_fragments(l21)
            part += product(a, lambda k_, n: a11[16 * ks + k_, 16 * qc + n].item(), 2)
        x[16 * qr:16 * qr + 16, 16 * qc:16 * qc + 16] = part
    got = torch.zeros(32, 32, dtype=torch.float64)
    for w in range(4):
        qr, qc = w // 2, w % 2
        acc = torch.zeros(16, 16, dtype=torch.float64)
        for ks in (0, 1):
            a = a_fragments(lambda ln, rh, cc: a22[16 * qr + ln // 4 + 8 * rh, 16 * ks + lane_col(ln, cc)].item())
            acc += product(a, lambda k_, n: x[16 * ks + k_, 16 * qc + n].item(), 2)
        got[16 * qr:16 * qr + 16, 16 * qc:16 * qc + 16] = -acc
    want = full[32:, :32]
    err = ((got - want).norm() / want.norm()).item()
    assert err < 3e-3, err


def eliminate8_lanes(kk_s, beta, w):
    """``eliminate8``: the two 8x8 diagonal blocks of warp w's 16x16 block at once, in registers16's lane mapping (lane
    (g, t): block 0's row g at columns 2t, 2t + 1, registers 0 and 1; block 1's row 8 + g at columns 8 + 2t, 9 + 2t,
    registers 6 and 7), 7 steps; the lower left quadrant stays zero."""
    r0 = 16 * w
    lanes = range(32)
    kr = [[kk_s[r0 + ln // 4 + 8 * rh, kk_col(r0 + ln // 4 + 8 * rh, r0 + lane_col(ln, cc))].item() for rh in (0, 1)
           for cc in range(4)] for ln in lanes]
    br = [[beta[r0 + ln // 4 + 8 * rh].item() for rh in (0, 1)] for ln in lanes]
    xr = [[1.0 if ln // 4 + 8 * rh == lane_col(ln, cc) else 0.0 for rh in (0, 1) for cc in range(4)] for ln in lanes]
    for j in range(7):
        kj = [[kr[4 * (ln // 4) + j // 2][6 * rh + j % 2] for rh in (0, 1)] for ln in lanes]
        xj = [[xr[4 * j + ln % 4][6 * rh + c2] for rh in (0, 1) for c2 in (0, 1)] for ln in lanes]
        for ln in lanes:
            for rh in (0, 1):
                f = -br[ln][rh] * kj[ln][rh] if ln // 4 > j else 0.0
                for c2 in (0, 1):
                    xr[ln][6 * rh + c2] += f * xj[ln][2 * rh + c2]
    return xr


def merge8_lanes(kk_s, beta, w, xr):
    """``merge8_in_registers`` on warp w from ``eliminate8``'s registers: the block D = diag(D0, D1) stored, Z^T = D^T
    Lo^T (A: D^T read from the stored block; B: Lo, L's lower left quadrant, from the swizzled K K^T; n-tile 1 only),
    then W = D Z (A: D from registers; B: Z from Z^T's accumulators in the same lane; n-tile 0 only), A10 = -W's lower
    left into registers 4 and 5. The whole 16x16 block, as the lanes hold it afterwards."""
    r0 = 16 * w
    d = block_of_lanes(xr)
    a1 = a_fragments(lambda ln, rh, cc: d[lane_col(ln, cc), ln // 4 + 8 * rh].item())

    def lo(n, k):
        return beta[r0 + n].item() * kk_s[r0 + n, kk_col(r0 + n, r0 + k)].item() if n >= 8 and k < 8 else 0.0

    # zt[lane][i]: Z^T at (g + 8 (i // 2), 8 + 2t + i % 2)
    zt = mma_m16n8k16(a1, [[fp16(lo(8 + ln // 4, 2 * (ln % 4) + i % 2 + 8 * (i // 2))) for i in range(4)]
                           for ln in range(32)])
    a2 = a_fragments(lambda ln, rh, cc: xr[ln][4 * rh + cc])
    wc = mma_m16n8k16(a2, [[fp16(zt[ln][i % 2]) if i >= 2 else 0.0 for i in range(4)] for ln in range(32)])
    out = [list(r) for r in xr]
    for ln in range(32):
        out[ln][4], out[ln][5] = -wc[ln][2], -wc[ln][3]
    return block_of_lanes(out)


def test_the_8x8_eliminations_merged_to_16_give_each_warps_diagonal_block():
    """``registers8`` as warp w runs it (``eliminate8`` then ``merge8_in_registers``): the 8x8 blocks exactly (float64
    here, the same sums as the 16x16 elimination's), the lower left quadrant within fp16's rounding of the float64
    block, the upper right zero."""
    kk_s, beta, full = chunk(4)
    for w in range(4):
        xr = eliminate8_lanes(kk_s, beta, w)
        got = merge8_lanes(kk_s, beta, w, xr)
        want = full[16 * w:16 * w + 16, 16 * w:16 * w + 16]
        assert torch.allclose(got[:8, :8], want[:8, :8], rtol=0, atol=1e-12)
        assert torch.allclose(got[8:, 8:], want[8:, 8:], rtol=0, atol=1e-12)
        assert torch.equal(got[:8, 8:], torch.zeros(8, 8, dtype=torch.float64))
        err = ((got[8:, :8] - want[8:, :8]).norm() / want[8:, :8].norm()).item()
        assert err < 2e-3, (w, err)
