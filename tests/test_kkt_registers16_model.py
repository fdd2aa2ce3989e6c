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
