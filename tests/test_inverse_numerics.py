"""Stage 1's inverse emulated (``benchmarks/inverse_numerics.py``, CPU): its blocked algebra is the inverse, and the
study's finding holds: diagonal blocks by tensor-core doubling keep the substitution's accuracy with three-pass tf32
operands, and lose it with plain tf32 where keys share a direction."""
import torch

from helpers import load_benchmark

inum = load_benchmark("inverse_numerics")


def _problem(noise, beta_one, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = inum.chunk_keys("random" if noise is None else "shared", gen, noise)
    beta = torch.ones(inum.C, dtype=torch.float64) if beta_one else torch.sigmoid(
        torch.randn(inum.C, generator=gen, dtype=torch.float64))
    L = (beta[:, None] * (k @ k.T)).tril(-1)
    return L, torch.linalg.inv(torch.eye(inum.C, dtype=torch.float64) + L)


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def test_doubling_is_the_inverse_of_a_nilpotent_block():
    L, _ = _problem(0.3, False)
    block = L[:16, :16].float()
    want = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + block.double())
    assert _rel(inum.substitution(block), want) < 1e-6
    assert _rel(inum.doubling(block, "fp32"), want) < 1e-6


def test_blocked_inverse_is_the_inverse():
    for noise in (None, 0.3):
        L, A = _problem(noise, False)
        for diag in ("substitution", "3xtf32"):
            assert _rel(inum.blocked_inverse(L.float(), diag), A) < 2e-3, (noise, diag)


def test_three_pass_tf32_keeps_the_substitutions_accuracy_and_plain_tf32_does_not():
    L, A = _problem(0.1, True)  # keys that share a direction, beta = 1: the doubling's powers grow and cancel
    err = {d: _rel(inum.blocked_inverse(L.float(), d), A) for d in ("substitution", "tf32", "3xtf32")}
    assert err["3xtf32"] < 1.5 * err["substitution"], err
    assert err["tf32"] > 10 * err["substitution"], err


def test_fp16_merges_keep_the_substitutions_accuracy_and_bf16_merges_do_not():
    # FlashInfer's way (fp16 blocks and fp16 mma merges) and its 16x16 variant against the default build's (tf32 read
    # truncated), where keys share a direction and beta = 1, and with random keys
    for noise, beta_one in ((0.1, True), (None, False)):
        L, A = _problem(noise, beta_one)
        Gam = torch.ones(inum.C, inum.C, dtype=torch.float64).tril()
        err = {w: _rel(inum.inverse_by(w, L.float(), Gam)[0], A)
               for w in ("substitution", "fp16 16x16", "fp16 8x8", "bf16 16x16")}
        assert err["fp16 16x16"] < 1.1 * err["substitution"], (noise, err)
        assert err["fp16 8x8"] < 1.1 * err["substitution"], (noise, err)
        assert err["bf16 16x16"] > 3 * err["substitution"], (noise, err)


def test_gating_first_is_the_same_inverse_gated():
    # (I + Gam ⊙ L)^{-1} = Gam ⊙ (I + L)^{-1} for Gam_ij = exp(g~_i - g~_j): FlashInfer gates before inverting
    L, A = _problem(0.3, False)
    gen = torch.Generator().manual_seed(1)
    gc = (torch.nn.functional.logsigmoid(torch.randn(inum.C, generator=gen, dtype=torch.float64)) / 16).cumsum(0)
    Gam = (gc[:, None] - gc[None, :]).exp().tril()
    A_back, GA = inum.inverse_by(("substitution", "fp32", 16, None, True), L.float(), Gam)
    assert _rel(GA, Gam * A) < 1e-5
    assert _rel(A_back, A) < 1e-5
