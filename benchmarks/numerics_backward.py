"""What the Hopper backward's bf16 operands cost in accuracy, predicted on the CPU before the GPU runs it.

    python benchmarks/numerics_backward.py [--tokens 4096] [--heads 2] [--cp N] [--precise 2|3]

Emulates, for one sequence and ``--heads`` value heads of one qk head (K = V = 128), the three stages of the
Hopper backward with their rounding points (``rnd``): the forward states of the rs loop's store_chunk_states
variant (S, W, Vn as bf16 register operands, Ag and P bf16 tiles, S stored in bf16), the state-gradient walk
(``state_grad_walk.py``: dS'^T, X^T and Y^T diag(gamma) as bf16 register operands, P and Qg bf16 tiles, dS' stored
in bf16) and ``chunk_grad.py`` (every shared-memory operand in bf16: W, gamma KS, Vn, P, dVn, dA, -gamma dW,
d Vn, dQK, A^T dA, dKK, and A; accumulators in float32; dq and dk per value head in bf16, summed over the group).
Everything else is float64. It prints each gradient's relative RMS against the float64 chunked backward on the same (bf16-valued)
inputs, beside the bars of DESIGN.md §3, for a normal, a strong and a zero gate; and the same with no rounding
(``rnd`` the identity), which must come out at float64 precision (a check of the emulation itself). With ``--cp
N`` also the backward through exact context parallelism (segments of N chunks, ``flashgdn/cp/backward.py``): how
far its gradients are from those without, the issue's bar being 1e-3. With ``--precise T`` the register operands
of the states pass, the walk and CP's transitions (the passes whose state lives in registers) are split into T
bf16 terms (2: hi + lo; 3: hi + mid + lo, what the kernels' precise mode does in those passes). ``--g-last chain``
(with ``--fold-every N``): dg's g~_last term by a recurrence over the chunks instead of a fold of each (notes v0.30a:
not taken, its rounding adds up along the walk).
"""
import argparse

import torch

C, K, V = 64, 128, 128
BARS = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dg": 2e-2, "dbeta": 2e-2, "dh0": 8e-3}


def bf16(x):
    return x.to(torch.bfloat16).to(x.dtype)


def exact(x):
    return x


def split2(x):  # a bf16 hi + lo pair, summed back
    hi = bf16(x)
    return hi + bf16(x - hi)


def split3(x):  # hi + mid + lo
    hi = bf16(x)
    mid = bf16(x - hi)
    return hi + mid + bf16(x - hi - mid)


#: the rounding of the register operands of the passes whose state lives in registers (None: the same as the
#: tiles'); ``--precise`` sets it
REGISTER_OPERANDS = {"rnd": None}


def _chunks(T):
    return [(c0, min(C, T - c0)) for c0 in range(0, T, C)]


def _tile(x, n):
    out = torch.zeros((C,) + tuple(x.shape[1:]), dtype=x.dtype)
    out[:n] = x
    return out


def _chunk_tensors(kc, gcum, bet, rnd):
    lower = torch.ones(C, C, dtype=kc.dtype).tril()
    Gam = (gcum[:, None] - gcum[None, :]).clamp(max=0).exp() * lower
    A = torch.linalg.inv(torch.eye(C, dtype=kc.dtype) + torch.tril(bet[:, None] * (kc @ kc.T), -1))
    return Gam, A, rnd(Gam * A * bet[None, :])


def _states_pass(tiles, S, rnd, zero_v=False):
    """The rs loop's state-only pass from S (its register operands rounded): the state at every chunk's start
    (rounded, as stored) and at the end. ``zero_v``: with v = 0 (from the identity: the transition M)."""
    states = []
    for (c0, n, Q, Kc, Vc, dO, G, bet, Gam, A, Ag, P) in tiles:
        states.append(rnd(S))
        reg = REGISTER_OPERANDS["rnd"] or rnd
        gam, dec = G.exp(), (G[-1] - G).exp()
        W = (0 if zero_v else Vc) - gam[:, None] * (Kc @ reg(S))
        Vn = Ag @ reg(W)
        S = G[-1].exp() * S + Kc.T @ reg(Vn * dec[:, None])
    return states, S


def _walk(tiles, dS, scale, rnd):
    """``state_grad_walk`` from dS (dS^T in registers): the gradient at every chunk's end (rounded, as stored)
    and at the start."""
    ends = [None] * len(tiles)
    for i in reversed(range(len(tiles))):
        c0, n, Q, Kc, Vc, dO, G, bet, Gam, A, Ag, P = tiles[i]
        ends[i] = rnd(dS)
        reg = REGISTER_OPERANDS["rnd"] or rnd
        gam, dec = G.exp(), (G[-1] - G).exp()
        XT = (reg(dS.T) @ Kc.T) * dec[None, :] + dO.T @ P
        YT = reg(XT) @ Ag
        Qg = rnd(scale * gam[:, None] * Q)
        dS = (G[-1].exp() * dS.T + reg(-YT * gam[None, :]) @ Kc + dO.T @ Qg).T
    return ends, dS


def _cp_states_and_ends(tiles, h0, dht, scale, rnd, seg):
    """The same through exact context parallelism with segments of ``seg`` chunks (``flashgdn.cp``): the
    transitions b and M by the state-only pass (b of the first segment from h0), the splices in float32 (the
    forward's, and the backward's reverse one with M^T and the walks from zero), then the passes on every
    segment from its true start state / end gradient."""
    segs = [tiles[i:i + seg] for i in range(0, len(tiles), seg)]
    K = h0.shape[0]
    f32 = torch.float32
    bs = [_states_pass(t, h0 if i == 0 else torch.zeros_like(h0), rnd)[1] for i, t in enumerate(segs)]
    Ms = [_states_pass(t, torch.eye(K, dtype=h0.dtype), rnd, zero_v=True)[1] for t in segs]
    Ds = [_walk(t, torch.zeros_like(dht), scale, rnd)[1] for t in segs]
    starts = [h0, bs[0].to(f32).to(h0.dtype)]
    for i in range(1, len(segs) - 1):
        starts.append((Ms[i].to(f32) @ starts[-1].to(f32) + bs[i].to(f32)).to(h0.dtype))
    seg_ends = [None] * len(segs)
    seg_ends[-1] = dht
    for i in range(len(segs) - 1, 0, -1):
        seg_ends[i - 1] = (Ms[i].to(f32).T @ seg_ends[i].to(f32) + Ds[i].to(f32)).to(h0.dtype)
    states, ends, dS = [], [], None
    for i, t in enumerate(segs):
        states += _states_pass(t, starts[i], rnd)[0]
        e, d = _walk(t, seg_ends[i], scale, rnd)
        ends += e
        dS = d if i == 0 else dS
    return states, ends, dS


def emulate(q, k, v, g, beta, h0, do, dht, scale, rnd=bf16, cp=None, g_last="fold", fold_every=None,
            row_terms="elementwise"):
    """Gradients of one sequence ``(dq, dk, dv, dg, dbeta, dh0)``: q, k ``[T, K]`` (one qk head), v, do
    ``[T, H, V]``, g, beta ``[T, H]``, h0, dht ``[H, K, V]``; q and k gradients summed over the H value heads.
    ``cp``: through exact context parallelism with segments of that many chunks.

    ``g_last``: how dg's g~_last term of a chunk, <dS', S'> at its end, is made. "fold" (the kernels'): from the
    chunk's dS'^T and S^T tiles, every chunk. "chain" (an alternative, not built): folded on the last chunk of each
    walk (a sequence, or a CP segment) only; for the chunks before, from the chunk after's: <dS, S> at a chunk's start
    is <dS', S'> at its end plus the sum of its value-side row terms (d_i <(K dS')_i, Vn_i>, gamma_i <dW_i, KS_i>,
    scale gamma_i <q_i, (dO S^T)_i>), by the chunk's own recurrences of S and dS. ``fold_every``: with "chain", also
    fold every this many chunks of a walk (counted from its last), so that the chain's rounding adds up over at most
    that many.

    ``row_terms``: how the value side's three row terms of dg (d_i <(K dS')_i, Vn_i>, gamma_i <dW_i, KS_i>,
    scale gamma_i <q_i, (dO S^T)_i>) are made. "elementwise" (the kernels'): the float32 accumulator times the bf16
    tile. "mma" (v0.33a's ``row_mma`` build, measured and removed): the last two as diagonals of tensor-core
    products, their accumulators (dW, scale gamma ⊙ dO S^T) rounded to bf16 as the products' register operands.
    "mma-all": the first one too (d ⊙ K dS' rounded; not built: notes v0.33a)."""
    ra = rnd if row_terms == "mma-all" else exact
    rt = rnd if row_terms in ("mma", "mma-all") else exact
    T, H = v.shape[0], v.shape[1]
    chunks = _chunks(T)
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    dv, dg, dbeta = torch.zeros_like(v), torch.zeros_like(g), torch.zeros_like(beta)
    dh0 = torch.zeros_like(h0)
    for h in range(H):
        tiles = []
        for c0, n in chunks:
            gc = g[c0:c0 + n, h].cumsum(0)
            G = _tile(gc, n)
            G[n:] = gc[-1]
            Q, Kc, Vc, dO, bet = (_tile(x, n) for x in (q[c0:c0 + n], k[c0:c0 + n], v[c0:c0 + n, h],
                                                         do[c0:c0 + n, h], beta[c0:c0 + n, h]))
            Gam, A, Ag = _chunk_tensors(Kc, G, bet, rnd)
            P = rnd(scale * Gam * (Q @ Kc.T))
            tiles.append((c0, n, Q, Kc, Vc, dO, G, bet, Gam, A, Ag, P))
        if cp is None:
            states, _ = _states_pass(tiles, h0[h], rnd)
            ends, dS = _walk(tiles, dht[h], scale, rnd)
        else:
            states, ends, dS = _cp_states_and_ends(tiles, h0[h], dht[h], scale, rnd, cp)
        dh0[h] = dS
        # chunk_grad, one chunk at a time
        local, folded, rows = [], [], []
        for i, (c0, n, Q, Kc, Vc, dO, G, bet, Gam, A, Ag, P) in enumerate(tiles):
            St, dSt = states[i].T, ends[i].T  # the kernel's S^T and dS'^T tiles
            gam, dec = G.exp(), (G[-1] - G).exp()
            A = rnd(A)  # stored in the io dtype by stage 1
            Ab = A
            sd = (dSt * St).sum()
            gks = gam[:, None] * (Kc @ St.T)
            W, gks_t = rnd(Vc - gks), rnd(gks)
            Vn = rnd(Ag @ W)
            X = dec[:, None] * (Kc @ dSt.T)
            tdec = (ra(X) * Vn).sum(1)
            dVn = rnd(X + P.T @ dO)
            E = (dVn @ W.T) * Gam
            db1 = (E * A).sum(0)
            EAb = E * A * bet[None, :]
            ta = EAb.sum(1) - EAb.sum(0)
            dA = rnd(E * bet[None, :])
            dW = Ag.T @ dVn
            tw = (rt(dW) * gks_t).sum(1)
            dWg = rnd(-gam[:, None] * dW)
            lower = torch.ones(C, C, dtype=q.dtype).tril()
            dP = (dO @ Vn.T) * lower
            tp = (dP * P).sum(1) - (dP * P).sum(0)
            dQK = rnd(scale * Gam * dP)
            Vnd = rnd(dec[:, None] * Vn)
            dqs = scale * gam[:, None] * (dO @ St)
            tq = (rt(dqs) * Q).sum(1)
            dqc = dqs + dQK @ Kc
            Y = rnd(Ab.T @ dA)
            dL = -torch.tril(Y @ Ab.T, -1)
            db2 = (dL * (Kc @ Kc.T)).sum(1)
            dKK = rnd(bet[:, None] * dL)
            dkc = dQK.T @ Q + dWg @ St + Vnd @ dSt + dKK @ Kc + dKK.T @ Kc
            dgc = tq - tw - tdec + tp + ta
            upper = torch.ones(C, C, dtype=q.dtype).triu()
            local.append((upper * dgc[None, :]).sum(1))
            folded.append(tdec.sum() + G[-1].exp() * sd)
            rows.append((tq - tw - tdec).sum())
            dgt = local[-1] + folded[-1]
            dv[c0:c0 + n, h] = rnd(dW[:n])
            dq[c0:c0 + n] += rnd(dqc[:n])  # written per value head in the io dtype, summed over the group
            dk[c0:c0 + n] += rnd(dkc[:n])
            dg[c0:c0 + n, h] = dgt[:n]
            dbeta[c0:c0 + n, h] = (db1 + db2)[:n]
        if g_last == "chain":
            walk = len(tiles) if cp is None else cp
            total = None
            for i in reversed(range(len(tiles))):
                last_of_walk = (i == len(tiles) - 1 or (i + 1) % walk == 0
                                or (fold_every and (len(tiles) - 1 - i) % fold_every == 0))
                total = folded[i] if last_of_walk else total + rows[i + 1]
                c0, n = tiles[i][:2]
                dg[c0:c0 + n, h] = (local[i] + total)[:n]
    return rnd(dq), rnd(dk), dv, dg, dbeta, dh0


def inputs(T, H, gate, seed=1):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = bf16(torch.nn.functional.normalize(randn(T, K), dim=-1))
    k = bf16(torch.nn.functional.normalize(randn(T, K), dim=-1))
    v = bf16(randn(T, H, V))
    if gate == "zero":
        g = torch.zeros(T, H, dtype=torch.float64)
    elif gate == "strong":
        g = -torch.nn.functional.softplus(randn(T, H)) * torch.linspace(1, 16, H, dtype=torch.float64)
    else:
        g = torch.nn.functional.logsigmoid(randn(T, H)) / 16
    beta = torch.sigmoid(randn(T, H))
    h0 = randn(H, K, V)
    do = bf16(randn(T, H, V))
    dht = randn(H, K, V)
    return q, k, v, g, beta, h0, do, dht


def reference(q, k, v, g, beta, h0, do, dht, scale):
    """The float64 chunked backward on the same inputs (one sequence, Hqk = 1)."""
    from flashgdn.reference.chunked_backward import chunk_gated_delta_rule_backward_reference

    T, H = v.shape[:2]
    return chunk_gated_delta_rule_backward_reference(
        q[None, :, None], k[None, :, None], v[None], g[None], beta[None], do[None], dht[None], scale=scale,
        initial_state=h0[None], cu_seqlens=torch.tensor([0, T]))


def rel(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=2, help="value heads of the one qk head (GVA)")
    ap.add_argument("--cp", type=int, default=None,
                    help="also run through exact context parallelism with segments of this many chunks, and print "
                         "how far its gradients are from those without (issue bar: 1e-3)")
    ap.add_argument("--precise", type=int, choices=(2, 3), default=None,
                    help="register operands of the states pass, the walk and the transitions as this many bf16 "
                         "terms (the kernels' precise mode)")
    ap.add_argument("--g-last", choices=("fold", "chain"), default="fold",
                    help="dg's g~_last term by a fold of every chunk's dS' and S tiles (the kernels'), or chained from "
                         "the chunk after's (emulate's g_last; notes v0.30a)")
    ap.add_argument("--fold-every", type=int, default=None, help="with --g-last chain: fold every this many chunks too")
    ap.add_argument("--row-terms", choices=("elementwise", "mma", "mma-all"), default="elementwise",
                    help="dg's value-side row terms from the float32 accumulators (the kernels'), or two (mma) or all "
                         "three (mma-all) from them rounded to bf16, as diagonals of tensor-core products "
                         "(emulate's row_terms)")
    args = ap.parse_args(argv)
    if args.precise:
        print(f"precise: register operands of the state passes as {args.precise} bf16 terms")
    scale = K ** -0.5
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    print(f"{args.tokens} tokens, {args.heads} value heads of one qk head; relative RMS against the float64 "
          f"chunked backward (bars: {', '.join(f'{n} {BARS[n]:.0e}' for n in names)})")
    for gate in ("normal", "strong", "zero"):
        x = inputs(args.tokens, args.heads, gate)
        want = reference(*x, scale)
        want = [w[0, :, 0] if i < 2 else w[0] for i, w in enumerate(want)]
        for label, rnd in (("bf16 (the kernels)", bf16), ("no rounding", exact)):
            REGISTER_OPERANDS["rnd"] = dict([(2, split2), (3, split3)]).get(args.precise) if rnd is bf16 else None
            got = emulate(*x, scale, rnd=rnd, g_last=args.g_last, fold_every=args.fold_every, row_terms=args.row_terms)
            errs = {n: rel(a, w) for n, a, w in zip(names, got, want)}
            over = [n for n in names if errs[n] > BARS[n]]
            print(f"  gate {gate:6s} {label:18s} " + "  ".join(f"{n} {errs[n]:.1e}" for n in names)
                  + (f"  OVER THE BAR: {', '.join(over)}" if over and rnd is bf16 else ""), flush=True)
            if args.cp:
                got_cp = emulate(*x, scale, rnd=rnd, cp=args.cp, g_last=args.g_last, fold_every=args.fold_every,
                                 row_terms=args.row_terms)
                diffs = {n: rel(a, b) for n, a, b in zip(names, got_cp, got)}
                print(f"  gate {gate:6s} {label:18s} CP {args.cp} vs none: "
                      + "  ".join(f"{n} {diffs[n]:.1e}" for n in names), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
