"""How much do the chunk loop's bf16 operands cost in accuracy, and what does that mean for exact CP? (CPU)

    python benchmarks/numerics_study.py [--tokens 4096] [--gate zero|weak]

Emulates the numerics of the "rs" chunk loop (and the "uw" loop's order of operations, the transition form: one
product per chunk on the chain, S' = gamma_C S - M S + u, M and u made off the chain, and W as one product onto V
with gamma folded into a bf16 K tile) for one head (K = V = 128) in PyTorch: the tensor-core operands are
rounded where the kernel rounds them (the state S, W and Vn in registers; the Ag and P tiles from shared memory;
the output O), everything else is float32. It prints the error of o and of the final state against a float64
run without any rounding, for several rounding modes of the operands (bf16, tf32, a bf16 hi + lo pair), and the
distance between a run with exact context parallelism (segments of 4 and 16 chunks: b and M by the same
emulated kernel, splice in float32) and the run without it.

No decay (g = 0) is the hard case: nothing forgets, so every rounding of S stays in the state.
"""
import argparse

import torch

C, K, V = 64, 128, 128


def bf16(x):
    return x.to(torch.bfloat16).to(x.dtype)


def tf32(x):
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(x.dtype)


def hi_lo(x):
    hi = bf16(x)
    return hi + bf16(x - hi)


def exact(x):
    return x


def chunk_loop(q, k, v, g, beta, S, reg=bf16, tile=bf16, out=bf16, scale=K ** -0.5, form="rs", inverse=None):
    """The chunk recurrence with the kernel's rounding points: ``reg`` for S, W, Vn (register operands), ``tile``
    for Ag and P (shared-memory operands), ``out`` for O. ``form="uw"`` is the uw loop's order instead:
    Vn = U - Wk S with U = Ag V and Wk = (Ag diag(gamma)) K made per chunk and rounded as tiles. ``inverse(kc, bc,
    gc)`` (the chunk's keys, betas and gate cumsum), if given, makes each chunk's A (the gate-free inverse) instead of
    an exact inverse in q's dtype."""
    outs = []
    T = q.shape[0]
    for c0 in range(0, T, C):
        sl = slice(c0, min(T, c0 + C))
        n = sl.stop - sl.start
        qc, kc, vc, bc = q[sl], k[sl], v[sl], beta[sl]
        gc = g[sl].cumsum(0)
        upper = torch.ones(n, n, dtype=torch.bool).triu(1)
        A = (inverse(kc, bc, gc) if inverse is not None
             else torch.linalg.inv(torch.eye(n, dtype=q.dtype) + (bc[:, None] * (kc @ kc.T)).tril(-1)))
        Gam = (gc[:, None] - gc[None, :]).masked_fill(upper, float("-inf")).exp()
        Ag, P = tile(Gam * A * bc[None, :]), tile(scale * Gam * (qc @ kc.T))
        gam, dec = gc.exp(), (gc[-1] - gc).exp()
        Sr = reg(S)
        if form in ("m", "m32"):
            # the transition form: the chain is one product per chunk, S' = gamma_C S - M S + u, and o = Qe S + Ve,
            # with M = (diag(d) K)^T Wk, u = (diag(d) K)^T U, Qe = scale diag(gamma) Q - P Wk, Ve = P U made off the
            # chain (U = Ag V, Wk = (Ag diag(gamma)) K as in the uw form); M and Qe are bf16 tiles, u and Ve bf16
            # tiles ("m") or float32 ("m32")
            U, Wk = tile(Ag @ vc), tile(tile(Ag * gam[None, :]) @ kc)
            Kd = tile(kc * dec[:, None])
            wide = exact if form == "m32" else tile
            M, u = tile(Kd.T @ Wk), wide(Kd.T @ U)
            Qe, Ve = tile(scale * gam[:, None] * qc - P @ Wk), wide(P @ U)
            outs.append(out(Qe @ Sr + Ve))
            S = gc[-1].exp() * S - M @ Sr + u
            continue
        if form == "uw":
            Vn = tile(Ag @ vc) - tile(tile(Ag * gam[None, :]) @ kc) @ Sr
        elif form == "gk":
            # W as one product onto V: W = V - (diag(gamma) K) S with gamma ⊙ K rounded as a tile (a K tile scaled
            # off the chain), instead of (K S) scaled by gamma in float32 after the product
            Vn = Ag @ reg(vc - tile(gam[:, None] * kc) @ Sr)
        else:
            W = vc - gam[:, None] * (kc @ Sr)
            Vn = Ag @ reg(W)
        outs.append(out(scale * gam[:, None] * (qc @ Sr) + P @ reg(Vn)))
        S = gc[-1].exp() * S + kc.T @ reg(Vn * dec[:, None])
    return torch.cat(outs), S


def with_segments(q, k, v, g, beta, h0, seg_chunks, **mode):
    """Exact CP around the emulated loop: b from zero (the first segment from h0), M from the identity with
    v = 0, splice in float32, then every segment from its start state."""
    L = seg_chunks * C
    bounds = list(range(0, q.shape[0], L))
    bs, Ms = [], []
    for i in bounds:
        sl = slice(i, i + L)
        bs.append(chunk_loop(q[sl], k[sl], v[sl], g[sl], beta[sl], h0 if i == 0 else torch.zeros_like(h0), **mode)[1])
        Ms.append(chunk_loop(q[sl], k[sl], torch.zeros_like(v[sl]), g[sl], beta[sl], torch.eye(K), **mode)[1])
    starts = [h0, bs[0]]
    for i in range(1, len(bounds) - 1):
        starts.append(Ms[i] @ starts[-1] + bs[i])
    outs, final = [], None
    for j, i in enumerate(bounds):
        sl = slice(i, i + L)
        o, final = chunk_loop(q[sl], k[sl], v[sl], g[sl], beta[sl], starts[j], **mode)
        outs.append(o)
    return torch.cat(outs), final


def rel(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--gate", choices=("zero", "weak", "normal"), default="zero",
                    help="g = 0, logsigmoid(randn) / 256, or logsigmoid(randn) / 16 (DESIGN.md's benchmark inputs)")
    args = ap.parse_args(argv)
    torch.manual_seed(1)
    T = args.tokens
    q = bf16(torch.nn.functional.normalize(torch.randn(T, K), dim=-1))
    k = bf16(torch.nn.functional.normalize(torch.randn(T, K), dim=-1))
    v = bf16(torch.randn(T, V))
    g = torch.zeros(T) if args.gate == "zero" else torch.nn.functional.logsigmoid(torch.randn(T)) / (
        256 if args.gate == "weak" else 16)
    beta = torch.sigmoid(torch.randn(T))
    h0 = torch.randn(K, V)
    o_ex, s_ex = chunk_loop(*(x.double() for x in (q, k, v, g, beta, h0)), reg=exact, tile=exact, out=exact)

    print(f"{T} tokens, gate {args.gate}; relative RMS against float64 without rounding (o is bf16 in every mode)")
    modes = {
        "bf16 operands (rs loop)": dict(reg=bf16, tile=bf16),
        "bf16, U/Wk form (uw loop)": dict(reg=bf16, tile=bf16, form="uw"),
        "bf16, gamma K tile for W": dict(reg=bf16, tile=bf16, form="gk"),
        "bf16, transition form": dict(reg=bf16, tile=bf16, form="m"),
        "bf16, transition, u fp32": dict(reg=bf16, tile=bf16, form="m32"),
        "tf32 operands": dict(reg=tf32, tile=tf32),
        "bf16 hi+lo registers": dict(reg=hi_lo, tile=bf16),
        "bf16 hi+lo everywhere": dict(reg=hi_lo, tile=hi_lo),
        "float32 (no rounding)": dict(reg=exact, tile=exact),
    }
    for name, mode in modes.items():
        o, s = chunk_loop(q, k, v, g, beta, h0, **mode)
        line = f"  {name:26s} o {rel(o, o_ex):.1e}  final {rel(s, s_ex):.1e}"
        for seg in (4, 16):
            o_cp, s_cp = with_segments(q, k, v, g, beta, h0, seg, **mode)
            line += f" | CP {seg:2d} vs none: o {rel(o_cp, o):.1e} final {rel(s_cp, s):.1e}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
