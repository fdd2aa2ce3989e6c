"""Could stage 1's inverse make its diagonal blocks on the tensor cores? Its rounding, emulated on the CPU.

    python benchmarks/inverse_numerics.py [--chunks 64] [--seed 0] [--loop-tokens 2048]

Stage 1 (``flashgdn/kernels/hopper/kkt_inverse.py``, the default ``diag16`` and ``mma32`` build) inverts
``I + L``, ``L = StrictLower(diag(beta) K K^T)``, per 64-token chunk: its four 16x16 diagonal blocks by forward
substitution in float32 (a chain of ~120 dependent FMAs a thread, about half of the stage's instructions), then two
levels of merges ``A21 = -A22 (L21 A11)`` as tf32 ``mma.m16n8k8`` products. A tensor-core alternative for the
diagonal blocks: ``N = -L`` is nilpotent (``N^16 = 0`` on a 16x16 block), so

    (I - N)^{-1} = I + N + ... + N^15 = (I + N)(I + N^2)(I + N^4)(I + N^8)

three squarings and three products, each a 16x16x16 mma. This script emulates both with the kernel's rounding points
(operands rounded to tf32, to three-pass tf32 (hi, lo split) or to bf16; float32 accumulation; the merges as the
kernel makes them) and prints, against a float64 inverse of the same bf16 keys:
  * the inverse A's relative RMS and largest element error (A's entries are at most ~1 in size);
  * Ag = Gam ⊙ A ⊙ (1 beta^T) after its bf16 store, the tile the chunk loop multiplies by;
  * with ``--loop-tokens``, o and the final state of the emulated chunk loop (``numerics_study.chunk_loop``) fed each
    inverse, against a float64 loop: what DESIGN.md's bars (5e-3) see.

It also emulates the merges with fp16 operands and blocks (``WAYS``: FlashInfer's Hopper prefill makes its inverse so,
from 8x8 diagonal blocks, with the gate applied first; and the same from our 16x16 blocks) and with bf16 ones: whether
an inverse with half the products (``mma.m16n8k16``) and half the shared-memory bytes keeps the accuracy.

Keys: random unit vectors (nearly orthogonal in 128 dimensions, so L is small) and keys that share a direction
(``k = normalize(base + s * noise)``), where the doubling's powers of N grow and then cancel, which is where a
product with short operands can lose what the substitution keeps. Nothing here runs a kernel; it says whether such a
kernel would meet the bars before one is written. The doubling's operands are rounded to nearest (a kernel would
convert them, ``cvt.rna.tf32.f32``; three-pass: hi rounded, lo = x - hi exact and then read truncated, a negligible
loss); the merges' are truncated, as the kernel's ``mma`` reads float32 bits.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numerics_study as ns  # noqa: E402  (the chunk loop's emulation and its rounding functions)
from numerics_study import bf16, tf32  # noqa: E402  (tf32: to nearest, as cvt.rna.tf32.f32)

C, K = 64, 128


def tf32_truncated(x):
    """float32 bits read as tf32 by ``mma`` (the low 13 bits ignored): what the kernel's merges do."""
    bits = x.float().contiguous().view(torch.int32)
    return (bits & ~0x1FFF).view(torch.float32).to(x.dtype)


def fp16(x):
    """float32 values stored as float16 (to nearest), as an fp16 tile in shared memory holds them."""
    return x.half().to(x.dtype)


def mm(a, b, operand):
    """One tensor-core product, float32 accumulation: ``operand`` rounds the inputs (``"3xtf32"``: a hi + lo split,
    three products, the lo x lo term left out)."""
    if operand == "3xtf32":
        ah, bh = tf32(a), tf32(b)
        al, bl = tf32(a - ah), tf32(b - bh)
        return ah @ bh + (ah @ bl + al @ bh)
    rnd = {"tf32": tf32, "tf32-truncated": tf32_truncated, "bf16": bf16, "fp16": fp16,
           "fp32": lambda x: x}[operand]
    return rnd(a) @ rnd(b)


def substitution(Lb):
    """A 16x16 (or any) diagonal block's inverse by forward substitution in float32: column by column,
    x_r = -sum_{j<r} L_rj x_j (the kernel's chain, one column per thread)."""
    n = Lb.shape[0]
    X = torch.eye(n, dtype=torch.float32)
    for r in range(1, n):
        X[r, :r] = -(Lb[r, :r] @ X[:r, :r])
    return X


def doubling(Lb, operand):
    """The same block as (I + N)(I + N^2)(I + N^4)(I + N^8), N = -L, every product on the tensor cores."""
    n = Lb.shape[0]
    eye = torch.eye(n, dtype=torch.float32)
    N = -Lb
    X = eye + N
    P = N
    p = 1
    while 2 * p < n:
        P = mm(P, P, operand)  # N^(2p)
        X = mm(X, eye + P, operand)
        p *= 2
    return X


#: the merges' operands: float32 bits that ``mma.m16n8k8.tf32`` reads as tf32, i.e. truncated (``kkt_inverse.py``'s
#: ``mma_tf32``)
MERGE = "tf32-truncated"


def blocked_inverse(L, diag, merge=MERGE, leaf=16, store=None):
    """The kernel's blocked inverse of I + L (64 x 64): ``leaf`` x ``leaf`` diagonal blocks by ``diag``
    ("substitution" or a doubling's operand rounding), merged up to 64 by A21 = -A22 (L21 A11) with products whose
    operands ``merge`` rounds (the default build's: tf32 read truncated, ``MERGE``). ``store`` rounds every block as
    it is written (None: kept in float32, as the default build keeps them)."""
    keep = (lambda x: x) if store is None else {"fp16": fp16, "bf16": bf16}[store]

    def inv(block):
        n = block.shape[0]
        if n == leaf:
            return keep(substitution(block) if diag == "substitution" else doubling(block, diag))
        h = n // 2
        A11, A22 = inv(block[:h, :h]), inv(block[h:, h:])
        A21 = keep(-mm(A22, keep(mm(block[h:, :h], A11, merge)), merge))
        out = torch.zeros(n, n, dtype=torch.float32)
        out[:h, :h], out[h:, h:], out[h:, :h] = A11, A22, A21
        return out
    return inv(L)


#: the ways of making the inverse that the study compares: name -> (diagonal blocks, merges' operands, leaf size,
#: storage of the blocks, gate applied before the inverse). "fp16 8x8, gated" is FlashInfer's Hopper prefill's (read
#: in its source): the gated L = Gam ⊙ L, 8x8 diagonal blocks by elimination in float32, every block stored as fp16
#: and merged by fp16 mma (float32 accumulation), beta applied to the columns afterwards.
WAYS = {
    "substitution": ("substitution", MERGE, 16, None, False),
    "tf32": ("tf32", MERGE, 16, None, False),
    "3xtf32": ("3xtf32", MERGE, 16, None, False),
    "bf16": ("bf16", MERGE, 16, None, False),
    "fp16 16x16": ("substitution", "fp16", 16, "fp16", False),
    "fp16 8x8": ("substitution", "fp16", 8, "fp16", False),
    "fp16 8x8, gated": ("substitution", "fp16", 8, "fp16", True),
    "bf16 16x16": ("substitution", "bf16", 16, "bf16", False),
}


def inverse_by(way, L, Gam):
    """The ungated inverse A of I + L made the way ``way`` names (a key of ``WAYS``, or such a tuple), and Gam ⊙ A as
    that way has it (float32): a way that gates first inverts I + Gam ⊙ L, which is Gam ⊙ A, and has no A of its own
    (its A is that divided back)."""
    diag, merge, leaf, store, gate_first = WAYS[way] if isinstance(way, str) else way
    if not gate_first:
        A = blocked_inverse(L, diag, merge, leaf, store)
        return A, Gam.float() * A
    GA = blocked_inverse(Gam.float() * L, diag, merge, leaf, store)
    return GA / Gam.float().clamp_min(1e-30) * (Gam > 0), GA


def chunk_keys(kind, gen, s=None):
    if kind == "random":
        k = torch.randn(C, K, generator=gen, dtype=torch.float64)
    else:
        base = torch.randn(1, K, generator=gen, dtype=torch.float64)
        k = base + s * torch.randn(C, K, generator=gen, dtype=torch.float64)
    return bf16(torch.nn.functional.normalize(k, dim=-1))


def study(kind, s, chunks, beta_kind, gen):
    errs = {d: [0.0, 0.0, 0.0] for d in WAYS}  # A rel RMS (summed squares), A max abs, Ag rel RMS (summed)
    ref_sq = [0.0, 0.0]
    for _ in range(chunks):
        k = chunk_keys(kind, gen, s)
        beta = torch.sigmoid(torch.randn(C, generator=gen, dtype=torch.float64))
        if beta_kind == "one":
            beta = torch.ones(C, dtype=torch.float64)
        g = torch.nn.functional.logsigmoid(torch.randn(C, generator=gen, dtype=torch.float64)) / 16
        gc = g.cumsum(0)
        Gam = (gc[:, None] - gc[None, :]).exp().tril()
        L64 = (beta[:, None] * (k @ k.T)).tril(-1)
        A64 = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + L64)
        Ag64 = Gam * A64 * beta[None, :]
        ref_sq[0] += float(A64.pow(2).sum())
        ref_sq[1] += float(Ag64.pow(2).sum())
        # the kernel's L: K K^T of bf16 keys in float32 (a wgmma), scaled by beta in float32
        L32 = (beta.float()[:, None] * (k.float() @ k.float().T)).tril(-1)
        for d in WAYS:
            A, GA = inverse_by(d, L32, Gam)
            A = A.double()
            Ag = bf16(GA * beta.float()[None, :]).double()
            errs[d][0] += float((A - A64).pow(2).sum())
            errs[d][1] = max(errs[d][1], float((A - A64).abs().max()))
            errs[d][2] += float((Ag - Ag64).pow(2).sum())
    return {d: ((e[0] / ref_sq[0]) ** 0.5, e[1], (e[2] / ref_sq[1]) ** 0.5) for d, e in errs.items()}


def loop_errors(kind, s, tokens, gen):
    """o and the final state of the emulated rs loop, each inverse fed in, against the loop in float64."""
    T = tokens
    if kind == "random":
        kk = torch.randn(T, K, generator=gen, dtype=torch.float64)
    else:
        kk = torch.randn(1, K, generator=gen, dtype=torch.float64) + s * torch.randn(T, K, generator=gen,
                                                                                   dtype=torch.float64)
    k = bf16(torch.nn.functional.normalize(kk, dim=-1))
    q = bf16(torch.nn.functional.normalize(torch.randn(T, K, generator=gen, dtype=torch.float64), dim=-1))
    v = bf16(torch.randn(T, K, generator=gen, dtype=torch.float64))
    g = torch.nn.functional.logsigmoid(torch.randn(T, generator=gen, dtype=torch.float64)) / 16
    beta = torch.sigmoid(torch.randn(T, generator=gen, dtype=torch.float64))
    S0 = torch.zeros(K, K, dtype=torch.float64)
    o_ref, S_ref = ns.chunk_loop(q, k, v, g, beta, S0, reg=ns.exact, tile=ns.exact, out=ns.exact)
    out = {}
    for d in WAYS:
        def inverse(kc, bc, gc, d=d):
            n = kc.shape[0]
            L = (bc.float()[:, None] * (kc.float() @ kc.float().T)).tril(-1)
            Gam = (gc[:, None] - gc[None, :]).exp().tril()
            if n < C:  # a partial chunk: the kernel's zero rows past the end
                L = torch.nn.functional.pad(L, (0, C - n, 0, C - n))
                Gam = torch.nn.functional.pad(Gam, (0, C - n, 0, C - n))
            return inverse_by(d, L, Gam)[0][:n, :n].double()
        o, S = ns.chunk_loop(q, k, v, g, beta, S0.clone(), inverse=inverse)
        out[d] = (ns.rel(o, o_ref), ns.rel(S, S_ref))
    o, S = ns.chunk_loop(q, k, v, g, beta, S0.clone())
    out["float64 inverse"] = (ns.rel(o, o_ref), ns.rel(S, S_ref))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=64, help="chunks per key distribution (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loop-tokens", type=int, default=0,
                    help="also run the emulated chunk loop over this many tokens per distribution (0: skip)")
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    cases = [("random", None, "sigmoid"), ("shared", 1.0, "sigmoid"), ("shared", 0.3, "sigmoid"),
             ("shared", 0.1, "sigmoid"), ("shared", 0.1, "one")]
    print(f"{'keys':<22} {'beta':<8} {'diagonal blocks':<14} {'A rel RMS':>10} {'A max abs':>10} "
          f"{'Ag bf16 rel RMS':>16}")
    for kind, s, beta_kind in cases:
        name = kind if s is None else f"{kind}, noise {s}"
        for d, (a_rms, a_max, ag_rms) in study(kind, s, args.chunks, beta_kind, gen).items():
            print(f"{name:<22} {beta_kind:<8} {d:<14} {a_rms:10.2e} {a_max:10.2e} {ag_rms:16.2e}")
    if args.loop_tokens:
        print(f"\nthe rs loop over {args.loop_tokens} tokens (bf16 operands as the kernel rounds them), "
              "rel RMS against float64: o, final state")
        for kind, s in (("random", None), ("shared", 0.3), ("shared", 0.1)):
            name = kind if s is None else f"{kind}, noise {s}"
            for d, (eo, es) in loop_errors(kind, s, args.loop_tokens, gen).items():
                print(f"{name:<22} {d:<16} {eo:10.2e} {es:10.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
