"""The lane mapping of stage 1's ``registers16`` (``kkt_inverse.py``), emulated on the CPU: a 16x16 diagonal block of
(I + L)^{-1} by elimination in one warp's registers, rows exchanged by shuffles, read from K K^T stored with the
kernel's XOR swizzle (``kk_col``), equals the float64 inverse. The kernel's macro ``eliminate16`` does what
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
    out = torch.zeros(16, 16, dtype=torch.float64)
    for ln in lanes:
        for rh in (0, 1):
            for cc in range(4):
                out[row(ln, rh), col(ln, cc)] = xr[ln][4 * rh + cc]
    return out


def test_each_warps_block_is_the_inverse_of_its_diagonal_block():
    gen = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(64, 128, generator=gen, dtype=torch.float64), dim=-1)
    k[20:40] = k[20] + 0.05 * k[20:40]  # rows sharing a direction: L near its largest
    beta = torch.rand(64, generator=gen, dtype=torch.float64)
    kk = k @ k.T
    kk_s = torch.empty_like(kk)
    for i in range(64):
        for j in range(64):
            kk_s[i, kk_col(i, j)] = kk[i, j]
    for w in range(4):
        blk = slice(16 * w, 16 * w + 16)
        want = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + torch.tril(beta[blk, None] * kk[blk, blk], -1))
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


def test_the_16_to_32_merge_from_registers_gives_the_lower_left_block():
    """``merge16_registers`` as warp 2m + 1 runs it (``merge16_in_registers``): X = L21' D_2m with L21' in the A
    fragment's order from the swizzled K K^T and D_2m as B from the stored block, then -D_2m+1 X with D_2m+1 from the
    elimination's registers and X as B from the warp's scratch tile; fp16 operands, so within fp16's rounding of the
    float64 block."""
    gen = torch.Generator().manual_seed(1)
    k = torch.nn.functional.normalize(torch.randn(64, 128, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(64, generator=gen, dtype=torch.float64)
    kk = k @ k.T
    kk_s = torch.empty_like(kk)
    for i in range(64):
        for j in range(64):
            kk_s[i, kk_col(i, j)] = kk[i, j]
    full = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + torch.tril(beta[:, None] * kk, -1))
    for m in range(2):
        w = 2 * m + 1
        r0 = 16 * w
        d_lo = eliminate16_lanes(kk_s, beta, w - 1)  # D_2m, as stored in the 32-block's upper left
        d_hi = eliminate16_lanes(kk_s, beta, w)  # D_2m+1: the lane's registers (rh, cc) hold it
        a1 = [[0.0] * 8 for _ in range(32)]
        a2 = [[0.0] * 8 for _ in range(32)]
        for ln in range(32):
            g, t = ln // 4, ln % 4
            for rh in (0, 1):
                for cc in range(4):
                    col = 2 * t + cc % 2 + 8 * (cc // 2)
                    row = r0 + g + 8 * rh
                    a1[ln][2 * rh + 4 * (cc // 2) + cc % 2] = fp16(
                        beta[row].item() * kk_s[row, kk_col(row, r0 - 16 + col)].item())
                    a2[ln][2 * rh + 4 * (cc // 2) + cc % 2] = fp16(d_hi[g + 8 * rh, col].item())
        x = torch.zeros(16, 16, dtype=torch.float64)  # the warp's scratch tile
        for nt in range(2):
            b = [[fp16(d_lo[2 * (ln % 4) + i % 2 + 8 * (i // 2), ln // 4 + 8 * nt].item()) for i in range(4)]
                 for ln in range(32)]
            c = mma_m16n8k16(a1, b)
            for ln in range(32):
                for i in range(4):
                    x[ln // 4 + 8 * (i // 2), 8 * nt + 2 * (ln % 4) + i % 2] = c[ln][i]
        got = torch.zeros(16, 16, dtype=torch.float64)
        for nt in range(2):
            b = [[fp16(x[2 * (ln % 4) + i % 2 + 8 * (i // 2), ln // 4 + 8 * nt].item()) for i in range(4)]
                 for ln in range(32)]
            c = mma_m16n8k16(a2, b)
            for ln in range(32):
                for i in range(4):
                    got[ln // 4 + 8 * (i // 2), 8 * nt + 2 * (ln % 4) + i % 2] = -c[ln][i]
        want = full[32 * m + 16:32 * m + 32, 32 * m:32 * m + 16]
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-3, (m, err)
