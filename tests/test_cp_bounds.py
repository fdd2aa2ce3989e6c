"""``flashgdn.cp.bounds`` (CPU): the bound on each segment's transition norm holds against the transition itself,
made token by token in float64, for any gate, beta and key norm; it is tight for one token; and where it says
"negligible" the transition is below float32's range."""
import math

import pytest
import torch

from flashgdn.cp.bounds import NEGLIGIBLE_LOG_NORM, token_log_growth, transition_log_bounds
from flashgdn.reference.chunked import compose_transitions, kkt_inverse, state_pass, chunk_local_cumsum


def _transition(k, g, beta, h, group, t0, t1):
    """``prod_t exp(g_t) (I - beta_t k_t k_t^T)`` over tokens t0..t1-1 of value head h, float64, the latest first."""
    K = k.shape[-1]
    M = torch.eye(K, dtype=torch.float64)
    for t in range(t0, t1):
        kt = k[0, t, h // group].double()
        step = torch.eye(K, dtype=torch.float64) - beta[0, t, h].double() * torch.outer(kt, kt)
        M = math.exp(float(g[0, t, h])) * step @ M
    return M


def _inputs(T, Hqk, Hv, K, seed, normalised=True, beta_hi=1.0, g_scale=1.0 / 16, zero_gate_heads=()):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, T, Hqk, K, generator=gen)
    if normalised:
        k = torch.nn.functional.normalize(k, dim=-1)
    k = k.to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen)) * g_scale
    for h in zero_gate_heads:
        g[..., h] = 0
    beta = torch.rand(1, T, Hv, generator=gen) * beta_hi
    return k, g, beta


@pytest.mark.parametrize("case", [
    dict(normalised=True, beta_hi=1.0),
    dict(normalised=False, beta_hi=1.0),           # |k|^2 ~ K: beta |k|^2 far past 2, growth on every token
    dict(normalised=True, beta_hi=2.5, zero_gate_heads=(1,)),  # beta past 2, a head without decay
    dict(normalised=True, beta_hi=1.0, g_scale=2.0),           # strong decay
])
def test_the_bound_holds_against_the_transition(case):
    T, Hqk, Hv, K = 90, 2, 4, 16
    k, g, beta = _inputs(T, Hqk, Hv, K, seed=3, **case)
    seg_cu = torch.tensor([0, 1, 30, 30, 90])  # one token, 29, an empty segment, 60
    bounds = transition_log_bounds(k, g, beta, seg_cu)
    assert bounds.shape == (4, Hv) and bounds.dtype == torch.float32
    for s in range(4):
        for h in range(Hv):
            M = _transition(k, g, beta, h, Hv // Hqk, int(seg_cu[s]), int(seg_cu[s + 1]))
            norm = torch.linalg.matrix_norm(M, ord=2)
            assert math.log(float(norm)) <= float(bounds[s, h]) + 1e-5, (s, h)
            if s == 0:  # one token: the bound is its transition's norm
                assert math.log(float(norm)) == pytest.approx(float(bounds[s, h]), abs=1e-5)
    assert (bounds[2] == 0).all()  # the empty segment's M is the identity


def test_normalised_keys_and_small_beta_bound_by_the_summed_decay():
    k, g, beta = _inputs(200, 2, 4, 32, seed=5)
    want = g[0].sum(0)
    got = transition_log_bounds(k, g, beta, torch.tensor([0, 200]))[0]
    assert torch.allclose(got, want, rtol=1e-5)
    assert torch.equal(token_log_growth(k, g, beta), g[0])  # no token's factor above 1


def test_the_chunked_transition_obeys_the_bound():
    """The chunked form's M (state_pass and compose_transitions, as context parallelism splices it) is the
    token-by-token product: the bound that holds for one holds for the other."""
    T, Hqk, Hv, K = 128, 1, 2, 16
    k, g, beta = _inputs(T, Hqk, Hv, K, seed=7, normalised=False, beta_hi=0.3)
    kd, gd, bd = k.double(), g.double(), beta.double()
    gcum = chunk_local_cumsum(gd)
    A = kkt_inverse(kd, bd)
    _, M, b = state_pass(kd, torch.zeros(1, T, Hv, K, dtype=torch.float64), gcum, A, bd)
    M_run, _ = compose_transitions(M, b)  # [Hv, K, K] after both chunks
    bounds = transition_log_bounds(k, g, beta, torch.tensor([0, T]))[0]
    for h in range(Hv):
        want = _transition(k, g, beta, h, Hv // Hqk, 0, T)
        assert torch.allclose(M_run[0, h] if M_run.dim() == 4 else M_run[h], want, rtol=1e-8, atol=1e-12)
        assert math.log(float(torch.linalg.matrix_norm(want, ord=2))) <= float(bounds[h]) + 1e-5


def test_below_the_threshold_the_transition_is_below_float32s_range():
    # decay ~ -0.05 a token (the benchmark's gates): 2048 tokens sum to ~ -104
    k, g, beta = _inputs(2048, 1, 2, 16, seed=11)
    bounds = transition_log_bounds(k, g, beta, torch.tensor([0, 2048]))[0]
    assert (bounds < NEGLIGIBLE_LOG_NORM).all()
    for h in range(2):
        M = _transition(k, g, beta, h, 2, 0, 2048)
        assert float(M.abs().max()) < torch.finfo(torch.float32).tiny


def test_non_finite_gates_never_look_negligible():
    k, g, beta = _inputs(8, 1, 1, 16, seed=1)
    g[0, 2, 0] = float("nan")
    assert not (transition_log_bounds(k, g, beta, torch.tensor([0, 8])) < NEGLIGIBLE_LOG_NORM).any()


def test_bounds_need_no_host_read():
    """On meta tensors (no values anywhere) the bound is made: it reads nothing back to the host."""
    k = torch.empty(1, 64, 2, 16, dtype=torch.bfloat16, device="meta")
    g = torch.empty(1, 64, 4, device="meta")
    out = transition_log_bounds(k, g, torch.empty_like(g), torch.empty(3, dtype=torch.int32, device="meta"))
    assert out.shape == (2, 4) and out.device.type == "meta"


def test_a_splice_with_the_negligible_transitions_zeroed_gives_the_unsplit_states():
    """The use the Hopper transition pass makes of the bound, in float64 by the reference's chunked form: one
    sequence in four 2-chunk segments, each segment's (M, b) composed from its chunks, M set to zero where its bound
    is below NEGLIGIBLE_LOG_NORM, spliced from a random initial state: the final state equals the unsplit one to
    float64 rounding. Strong gates on two heads (their M negligible), a g = 0 head and one of the normal gates
    (never), keys not normalised."""
    T, Hqk, Hv, K, V = 512, 1, 4, 16, 8
    gen = torch.Generator().manual_seed(2)
    k = (torch.randn(1, T, Hqk, K, generator=gen) * K ** -0.5).to(torch.bfloat16)
    v = torch.randn(1, T, Hv, V, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen)) / 16
    g[..., :2] = -8 * torch.nn.functional.softplus(torch.randn(1, T, 2, generator=gen))
    g[..., 3] = 0
    beta = torch.sigmoid(torch.randn(1, T, Hv, generator=gen))
    h0 = torch.randn(1, Hv, K, V, generator=gen, dtype=torch.float64)
    kd, gd, bd = k.double(), g.double(), beta.double()
    gcum = chunk_local_cumsum(gd)
    A = kkt_inverse(kd, bd)
    _, M, b = state_pass(kd, v, gcum, A, bd)  # per chunk: [8, Hv, K, K], [8, Hv, K, V]
    seg_cu = torch.tensor([0, 128, 256, 384, 512])
    bounds = transition_log_bounds(k, g, beta, seg_cu)
    gone = bounds < NEGLIGIBLE_LOG_NORM
    assert gone[:, :2].all() and not gone[:, 2:].any()
    S_split = h0[0]
    for s in range(4):
        Ms, bs = compose_transitions(M[2 * s:2 * s + 2], b[2 * s:2 * s + 2])
        Ms = torch.where(gone[s][:, None, None], torch.zeros_like(Ms), Ms)
        S_split = Ms @ S_split + bs
    S_whole = h0[0]
    for c in range(8):
        S_whole = M[c] @ S_whole + b[c]
    scale = S_whole.abs().max()
    assert float((S_split - S_whole).abs().max() / scale) < 1e-13


def test_bounds_into_a_given_tensor():
    k, g, beta = _inputs(100, 2, 4, 16, seed=9)
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    out = torch.full((2, 4), float("nan"))
    assert transition_log_bounds(k, g, beta, cu, out=out) is out
    assert torch.equal(out, transition_log_bounds(k, g, beta, cu))


def _walk(k, v, g, beta, h, group, t0, t1, S, inject=True):
    """The recurrence's state ``[K, V]`` float64 after tokens t0..t1-1 of value head h from ``S`` at t0
    (``inject=False``: the transitions alone, no ``beta k v^T``)."""
    for t in range(t0, t1):
        kt, vt, bt = k[0, t, h // group].double(), v[0, t, h].double(), float(beta[0, t, h])
        S = math.exp(float(g[0, t, h])) * S
        S = S - bt * torch.outer(kt, kt @ S)
        if inject:
            S = S + bt * torch.outer(kt, vt)
    return S


def _late_b_case(seed=11, g_scale=1.0, h0_scale=1.0):
    """Two sequences (700 and 450 tokens) cut into segments of 4 chunks (256 tokens): 3 + 2 segments, strong decay
    on heads 0-2, none on head 3, unnormalised keys on qk head 1, initial states of size ``h0_scale``."""
    T, Hqk, Hv, K, V = 1150, 2, 4, 8, 8
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(1, T, Hqk, K, generator=gen)
    k[:, :, 0] = torch.nn.functional.normalize(k[:, :, 0], dim=-1)
    k = k.to(torch.bfloat16)
    v = torch.randn(1, T, Hv, V, generator=gen).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen)) * g_scale
    g[..., 3] = 0
    beta = torch.rand(1, T, Hv, generator=gen)
    h0 = torch.randn(2, Hv, K, V, generator=gen, dtype=torch.float64) * h0_scale
    seg_cu = torch.tensor([0, 256, 512, 700, 956, 1150])
    seg_seq = torch.tensor([0, 0, 0, 1, 1])
    first = torch.tensor([0, 3])
    return k, v, g, beta, h0, seg_cu, seg_seq, first


def _assert_late_starts_leave_out_only_negligible(starts, k, v, g, beta, h0, seg_cu, seg_seq):
    """For every segment and head of ``_late_b_case``, the chunks ``starts`` leaves out of b's walk: within the
    segment, none on value heads 2 and 3 (no decay, or keys that grow the state), and where some are, the state they
    leave behind (from zero, or from h0 on a sequence's first segment, made token by token in float64) carried to the
    segment's end by the transitions alone below e^-88 in every entry."""
    for s in range(5):
        a, e = int(seg_cu[s]), int(seg_cu[s + 1])
        for h in range(4):
            c = int(starts[s, h])
            assert 0 <= c <= (e - a + 63) // 64
            if h >= 2:
                assert c == 0, "no decay, or keys that grow the state: the whole history is kept"
                continue
            if c == 0:  # the walk from the segment's start state: nothing left out
                continue
            S0 = h0[int(seg_seq[s]), h] if s in (0, 3) else torch.zeros(8, 8, dtype=torch.float64)
            p = min(a + 64 * c, e)
            dropped = _walk(k, v, g, beta, h, 2, p, e, _walk(k, v, g, beta, h, 2, a, p, S0), inject=False)
            assert dropped.abs().max() < math.exp(NEGLIGIBLE_LOG_NORM), (s, h, c)


@pytest.mark.parametrize("g_scale,h0_scale", [(1.0, 0.0), (1.0, 1.0), (0.6, 1e30)])
def test_late_b_drops_only_what_is_below_float32s_range(g_scale, h0_scale):
    """``b_start_chunks``: for every segment and head, the tokens before the chunk where b's walk starts owe b (from
    zero, or from h0 on a sequence's first segment) less than e^-88 in every entry, made token by token in float64:
    their state at that point carried to the segment's end by the transitions alone. Strong decay lets most of a
    segment go; heads without decay or with unnormalised keys (value heads 2 and 3 of qk head 1) keep every chunk; a
    huge h0 keeps more of a first segment."""
    from flashgdn.cp.bounds import b_start_chunks, chunk_count

    k, v, g, beta, h0, seg_cu, seg_seq, first = _late_b_case(g_scale=g_scale, h0_scale=h0_scale)
    chunks = [(int(b) - int(a) + 63) // 64 for a, b in zip(seg_cu[:-1], seg_cu[1:])]
    starts = b_start_chunks(k, v, g, beta, seg_cu, sum(chunks), h0=h0, seg_seq=seg_seq, first=first)
    assert starts.shape == (5, 4) and starts.dtype == torch.int32
    assert chunk_count(seg_cu) == sum(chunks) == 19 and chunk_count(torch.tensor([0, 0, 1, 66])) == 3
    _assert_late_starts_leave_out_only_negligible(starts, k, v, g, beta, h0, seg_cu, seg_seq)
    if g_scale == 1.0:  # ~-50 a chunk: every segment starts late on the decaying heads, whatever h0
        assert (starts[:, :2] > 0).all(), starts
    else:  # ~-30 a chunk: the first segments keep more of their start with an h0 of 1e30
        lean = b_start_chunks(k, v, g, beta, seg_cu, sum(chunks), h0=h0 * 0, seg_seq=seg_seq, first=first)
        assert (starts[[0, 3], :2] <= lean[[0, 3], :2]).all() and (starts[[0, 3], :2] < lean[[0, 3], :2]).any()
        assert torch.equal(starts[[1, 2, 4]], lean[[1, 2, 4]])


def test_late_b_is_b_up_to_float32s_range_in_the_chunked_form():
    """What the Hopper pass computes with ``late_b``: each segment's b by the chunked form (``state_pass`` and
    ``compose_transitions``, float64) over its chunks from ``b_start_chunks``'s on, from zero, equals b over all its
    chunks from its start state, to float64's rounding of b plus e^-88."""
    from flashgdn.cp.bounds import b_start_chunks

    k, v, g, beta, h0, seg_cu, seg_seq, first = _late_b_case(seed=12)
    chunks = [(int(b) - int(a) + 63) // 64 for a, b in zip(seg_cu[:-1], seg_cu[1:])]
    starts = b_start_chunks(k, v, g, beta, seg_cu, sum(chunks), h0=h0, seg_seq=seg_seq, first=first)
    assert (starts > 0).any()
    for s in range(5):
        a, e = int(seg_cu[s]), int(seg_cu[s + 1])
        pad = chunks[s] * 64 - (e - a)
        sl = lambda x: torch.nn.functional.pad(x[:, a:e].double(), (0, 0) * (x.dim() - 2) + (0, pad))
        kd, vd, gd, bd = sl(k), sl(v), sl(g), sl(beta)
        gcum = chunk_local_cumsum(gd)
        A = kkt_inverse(kd, bd)
        _, M, b = state_pass(kd, vd, gcum, A, bd)  # per chunk: S' = M S + b
        for h in range(4):
            S_full = h0[int(seg_seq[s]), h] if s in (0, 3) else torch.zeros(8, 8, dtype=torch.float64)
            S_late = S_full.clone() if int(starts[s, h]) == 0 else torch.zeros(8, 8, dtype=torch.float64)
            for c in range(chunks[s]):
                Mc, bc = M[0, c, h] if M.dim() == 5 else M[c, h], b[0, c, h] if b.dim() == 5 else b[c, h]
                S_full = Mc @ S_full + bc
                if c >= int(starts[s, h]):
                    S_late = Mc @ S_late + bc
            tol = 1e-12 * float(S_full.abs().max()) + math.exp(NEGLIGIBLE_LOG_NORM)
            assert (S_late - S_full).abs().max() <= tol, (s, h, int(starts[s, h]))


def _walk_back(q, k, g, beta, do, scale, h, group, t0, t1, dS, sources=True):
    """The state gradient before token t0 of value head h ``[K, V]`` float64, from ``dS`` after token t1 - 1, walked
    back through tokens t1 - 1 .. t0 (``sources=False``: the transposed transitions alone, no ``scale q_t dO_t^T``)."""
    for t in reversed(range(t0, t1)):
        if sources:
            dS = dS + scale * torch.outer(q[0, t, h // group].double(), do[0, t, h].double())
        kt, bt = k[0, t, h // group].double(), float(beta[0, t, h])
        dS = math.exp(float(g[0, t, h])) * (dS - bt * torch.outer(kt, kt @ dS))
    return dS


def _walk_case(g_scale=1.0):
    """``_late_b_case`` (seed 13) with queries (normalised on qk head 0) and output gradients beside it:
    ``(q, k, g, beta, do, seg_cu, chunks)``, ``chunks`` each segment's chunk count."""
    k, v, g, beta, h0, seg_cu, seg_seq, first = _late_b_case(seed=13, g_scale=g_scale)
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(k.shape, generator=gen)
    q[:, :, 0] = torch.nn.functional.normalize(q[:, :, 0], dim=-1)
    q = q.to(torch.bfloat16)
    do = torch.randn(v.shape, generator=gen).to(torch.bfloat16)
    chunks = [(int(b) - int(a) + 63) // 64 for a, b in zip(seg_cu[:-1], seg_cu[1:])]
    return q, k, g, beta, do, seg_cu, chunks


def _assert_early_stops_leave_out_only_negligible(cover, q, k, g, beta, do, scale, seg_cu, chunks):
    """For every segment and head, the tokens past the chunks its walk from zero covers (``cover [S, Hv]``) owe the
    start gradient less than e^-88 in every entry, made token by token in float64: their walk from zero, carried back
    to the segment's start by the transposed transitions alone; heads 2 and 3 (no decay, keys that grow the state)
    walk every chunk."""
    for s in range(len(chunks)):
        a, e = int(seg_cu[s]), int(seg_cu[s + 1])
        for h in range(4):
            c = int(cover[s, h])
            assert 0 <= c <= chunks[s]
            if h >= 2:
                assert c == chunks[s], "no decay, or keys that grow the state: every chunk is walked"
                continue
            p = min(a + 64 * c, e)
            if p == e:
                continue
            tail = _walk_back(q, k, g, beta, do, scale, h, 2, p, e, torch.zeros(8, 8, dtype=torch.float64))
            dropped = _walk_back(q, k, g, beta, do, scale, h, 2, a, p, tail, sources=False)
            assert dropped.abs().max() < math.exp(NEGLIGIBLE_LOG_NORM), (s, h, c)


@pytest.mark.parametrize("g_scale", [1.0, 0.6])
def test_early_stop_drops_only_what_is_below_float32s_range(g_scale):
    """``walk_stop_chunks``: what the walks from zero leave out owes the start gradients less than e^-88
    (``_assert_early_stops_leave_out_only_negligible``). Strong decay stops the walk early on every segment."""
    from flashgdn.cp.bounds import walk_stop_chunks

    q, k, g, beta, do, seg_cu, chunks = _walk_case(g_scale)
    cover = walk_stop_chunks(q, k, g, beta, do, 0.3, seg_cu, sum(chunks))
    assert cover.shape == (5, 4) and cover.dtype == torch.int32
    _assert_early_stops_leave_out_only_negligible(cover, q, k, g, beta, do, 0.3, seg_cu, chunks)
    full = torch.tensor(chunks)
    if g_scale == 1.0:  # ~-50 a chunk: every segment of 3-4 chunks stops early on the decaying heads
        assert (cover[:, :2] < full[:, None]).all(), cover
    else:
        assert (cover[:, :2] <= full[:, None]).all() and (cover[:, :2] < full[:, None]).any(), cover


def _chunkwise_walk_stops(q, k, g, beta, do, scale, seg_cu):
    from flashgdn.cp.bounds import chunk_log_bounds, chunk_log_emits, segment_walk_stops

    slots, first_slot = _slots_of(seg_cu)
    return segment_walk_stops(chunk_log_bounds(k, g, beta, slots), chunk_log_emits(q, k, g, beta, do, scale, slots),
                              first_slot, seg_cu)


def test_chunk_log_emits_bound_each_chunks_emission_from_above():
    """``chunk_log_emits``: per chunk and value head at or above the log of sum scale |q||dO| carried back to the
    chunk's start by the per-token bounds, made in float64 token by token, and above it by no more than its margin;
    an idle slot gives -inf."""
    from flashgdn.cp.bounds import CHUNK_BOUND_ABS, CHUNK_BOUND_REL, chunk_log_emits

    q, k, g, beta, do, seg_cu, _ = _walk_case()
    slots, _ = _slots_of(seg_cu)
    slots = torch.cat([slots, torch.zeros(1, 2, dtype=torch.int32)])
    got = chunk_log_emits(q, k, g, beta, do, -0.3, slots)  # (the scale's magnitude)
    assert got.shape == (4, slots.shape[0]) and got.dtype == torch.float32
    assert torch.isneginf(got[:, -1]).all()
    lu = token_log_growth(k, g, beta).double()
    emit = (0.3 * q[0].double().norm(dim=-1).repeat_interleave(2, dim=1) * do[0].double().norm(dim=-1)).log()
    for j, (a, n) in enumerate(slots[:-1].tolist()):
        want = (emit[a:a + n] + lu[a:a + n].cumsum(0)).logsumexp(0)
        mag = (g[0, a:a + n].double().abs() + lu[a:a + n] - g[0, a:a + n].double()).sum(0)
        slack = mag * CHUNK_BOUND_REL + CHUNK_BOUND_ABS
        assert (got[:, j].double() >= want - 1e-5).all() and (got[:, j].double() - want <= slack + 1e-4).all(), j


@pytest.mark.parametrize("g_scale", [1.0, 0.6])
def test_chunkwise_early_stop_drops_only_what_is_below_float32s_range(g_scale):
    """``segment_walk_stops`` over ``chunk_log_bounds`` and ``chunk_log_emits`` (the per-chunk form a kernel can make):
    what the walks from zero leave out owes the start gradients less than e^-88
    (``_assert_early_stops_leave_out_only_negligible``), and they cover what the token-by-token ``walk_stop_chunks``
    does up to one chunk either way (its own margins against the other's sum over later segments)."""
    from flashgdn.cp.bounds import walk_stop_chunks

    q, k, g, beta, do, seg_cu, chunks = _walk_case(g_scale)
    cover = _chunkwise_walk_stops(q, k, g, beta, do, 0.3, seg_cu)
    assert cover.shape == (5, 4) and cover.dtype == torch.int32
    _assert_early_stops_leave_out_only_negligible(cover, q, k, g, beta, do, 0.3, seg_cu, chunks)
    token_wise = walk_stop_chunks(q, k, g, beta, do, 0.3, seg_cu, sum(chunks))
    assert (cover - token_wise).abs().max() <= 1, (cover, token_wise)
    if g_scale == 1.0:
        assert (cover[:, :2] < torch.tensor(chunks)[:, None]).all(), cover


def test_walk_stop_in_kernel_is_gated_by_the_longest_segment(monkeypatch):
    """``backward.walk_stop_in_kernel``: off without WALK_STOP_IN_KERNEL or the host's offsets; with it, on where the
    longest segment has WALK_STOP_MIN_CHUNKS chunks or more (a partial last chunk counts), on every split plan at 0."""
    from flashgdn.kernels.hopper import backward

    monkeypatch.setattr(backward, "WALK_STOP_MIN_CHUNKS", 128)
    monkeypatch.setattr(backward, "WALK_STOP_IN_KERNEL", False)
    long = torch.tensor([0, 8192, 8192 + 64])
    assert not backward.walk_stop_in_kernel(long)
    monkeypatch.setattr(backward, "WALK_STOP_IN_KERNEL", True)
    assert backward.walk_stop_in_kernel(long) and not backward.walk_stop_in_kernel(None)
    assert backward.walk_stop_in_kernel(torch.tensor([0, 64, 64 + 127 * 64 + 1]))
    assert not backward.walk_stop_in_kernel(torch.tensor([0, 127 * 64, 254 * 64]))
    monkeypatch.setattr(backward, "WALK_STOP_MIN_CHUNKS", 0)
    assert backward.walk_stop_in_kernel(torch.tensor([0, 64])) and not backward.walk_stop_in_kernel(torch.tensor([0]))
    assert backward.longest_chunks(torch.tensor([0, 3000, 3001, 3001 + 64 * 47])) == 47


def test_chunkwise_early_stop_covers_little_of_a_long_segment_under_the_benchmarks_gates():
    """What the per-chunk form would save: one 256-chunk segment (16384 tokens, normalised queries and keys of 128,
    beta in (0, 1), the benchmark's gates of about -0.05 a token) walks only its first ~30 chunks from zero on every
    head, as the token-by-token bound has it; the same segment without decay walks them all."""
    from flashgdn.cp.bounds import walk_stop_chunks

    T, Hqk, Hv, K = 16384, 1, 2, 128
    gen = torch.Generator().manual_seed(4)
    q = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, generator=gen), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, generator=gen), dim=-1).to(torch.bfloat16)
    do = torch.randn(1, T, Hv, K, generator=gen).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen)) / 16
    beta = torch.rand(1, T, Hv, generator=gen)
    seg_cu = torch.tensor([0, T])
    cover = _chunkwise_walk_stops(q, k, g, beta, do, K ** -0.5, seg_cu)
    token_wise = walk_stop_chunks(q, k, g, beta, do, K ** -0.5, seg_cu, 256)
    assert (cover <= 40).all() and (cover > 0).all(), cover
    assert (cover - token_wise).abs().max() <= 1, (cover, token_wise)
    assert (_chunkwise_walk_stops(q, k, g * 0, beta, do, K ** -0.5, seg_cu) == 256).all()


def test_chunkwise_early_stop_keeps_everything_on_non_finite_inputs():
    """A gate that is not finite makes its segment's chunk bounds so: that segment's walk covers every chunk. A NaN
    output gradient makes its chunk's emission NaN: the walk covers that chunk and every one before it."""
    q, k, g, beta, do, seg_cu, chunks = _walk_case()
    clean = _chunkwise_walk_stops(q, k, g, beta, do, 0.3, seg_cu)
    assert clean[1, 0] < chunks[1] and clean[1, 1] < 3
    g[0, 300, 0] = float("nan")  # in the second segment (256-511) of the first sequence
    cover = _chunkwise_walk_stops(q, k, g, beta, do, 0.3, seg_cu)
    assert cover[1, 0] == chunks[1] and torch.equal(cover[0], clean[0])
    do[0, 256 + 3 * 64 + 5, 1] = float("nan")  # the fourth chunk of the same segment, value head 1
    assert _chunkwise_walk_stops(q, k, g, beta, do, 0.3, seg_cu)[1, 1] == 4


@pytest.mark.parametrize("T", [0, 1, 255, 256, 257, 1000, 70001])  # 70001: the blocks' totals in blocks again
@pytest.mark.parametrize("log", [False, True])
def test_the_blocked_token_scan_is_pytorchs_scan(T, log):
    """``_token_scan`` (two levels along contiguous rows, for speed on the GPU) against PyTorch's one-level scan over
    dim 0, in float64: the same values up to rounding, -inf, +inf and NaN carried to the same tokens."""
    from flashgdn.cp.bounds import _token_scan

    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, 5, generator=gen, dtype=torch.float64) * 30
    if T > 600:
        x[300:700, 1] = -math.inf  # a head whose tokens leave every later sum unchanged (log) for a while
        x[T // 2, 2] = math.nan
        x[T - 3, 3] = math.inf
    want = x.logcumsumexp(0) if log else x.cumsum(0)
    got = _token_scan(x, log)
    assert got.shape == want.shape == (T, 5) and got.dtype == torch.float64
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    assert torch.equal(got[~finite & ~want.isnan()], want[~finite & ~want.isnan()])
    scale = want[finite].abs().max() if finite.any() else torch.tensor(1.0)
    assert ((got[finite] - want[finite]).abs() <= 1e-12 * scale).all()


def test_bounds_over_many_blocks_need_no_host_read():
    """The blocked scan on meta tensors: a prefix over more tokens than a block reads nothing back either."""
    from flashgdn.cp.bounds import TOKEN_SCAN_BLOCK

    T = 3 * TOKEN_SCAN_BLOCK + 5
    k = torch.empty(1, T, 2, 16, dtype=torch.bfloat16, device="meta")
    g = torch.empty(1, T, 4, device="meta")
    out = transition_log_bounds(k, g, torch.empty_like(g), torch.empty(3, dtype=torch.int32, device="meta"))
    assert out.shape == (2, 4) and out.device.type == "meta"


@pytest.mark.parametrize("case", [
    dict(normalised=True, beta_hi=1.0),
    dict(normalised=False, beta_hi=1.0),           # growth on every token
    dict(normalised=True, beta_hi=2.5, zero_gate_heads=(1,)),  # beta past 2, a head without decay
    dict(normalised=True, beta_hi=1.0, g_scale=2.0),           # strong decay
])
def test_the_kernels_bound_is_above_the_bound(case):
    """``chunk_log_bounds`` and ``segment_log_bounds``, what the Hopper stage 1 and transition pass make with
    ``chunk_bounds``: each segment's rounded-up sum of its chunks at or above ``transition_log_bounds`` (itself a
    bound, above), by no more than the rounding margins; idle slots and a partial last chunk included."""
    from flashgdn.cp.bounds import (CHUNK_BOUND_ABS, CHUNK_BOUND_REL, SEGMENT_SUM_ABS, SEGMENT_SUM_REL,
                                    chunk_log_bounds, segment_log_bounds)

    T, Hqk, Hv, K = 400, 2, 4, 16
    k, g, beta = _inputs(T, Hqk, Hv, K, seed=7, **case)
    seg_cu = torch.tensor([0, 1, 130, 130, 400])  # one token, 129 (a partial chunk), an empty segment, 270
    chunks = [(int(b) - int(a) + 63) // 64 for a, b in zip(seg_cu[:-1], seg_cu[1:])]
    # the slots as the chunk plan lays them out (each segment's chunks in turn), one idle slot after them
    slots, first_slot = [], []
    for a, n in zip(seg_cu[:-1].tolist(), chunks):
        first_slot.append(len(slots))
        e = int(seg_cu[len(first_slot)])
        slots += [[a + 64 * c, min(64, e - a - 64 * c)] for c in range(n)]
    slots.append([0, 0])
    slots, first_slot = torch.tensor(slots, dtype=torch.int32), torch.tensor(first_slot, dtype=torch.int32)
    cb = chunk_log_bounds(k, g, beta, slots)
    assert cb.shape == (Hv, slots.shape[0]) and cb.dtype == torch.float32
    assert (cb[:, -1] == CHUNK_BOUND_ABS).all()  # the idle slot
    got = segment_log_bounds(cb, first_slot, seg_cu)
    want = transition_log_bounds(k, g, beta, seg_cu).double()
    assert got.shape == want.shape == (4, Hv)
    assert (got >= want).all()
    # the margins: a share of each chunk's magnitudes and a constant a chunk, then the segment's rounding
    per_token = token_log_growth(k, g, beta).double()
    for s, n in enumerate(chunks):
        a, e = int(seg_cu[s]), int(seg_cu[s + 1])
        mag = (g[0, a:e].double().abs() + (per_token[a:e] - g[0, a:e].double())).sum(0)
        slack = mag * CHUNK_BOUND_REL + n * CHUNK_BOUND_ABS + SEGMENT_SUM_ABS
        slack = slack + (n + 64) * SEGMENT_SUM_REL * (mag + n * CHUNK_BOUND_ABS) * 1.01 + 1e-4 * (1 + mag)
        assert (got[s] - want[s] <= slack).all(), (s, got[s] - want[s], slack)


def test_where_the_kernels_bound_says_negligible_the_transition_is_below_float32s_range():
    """Below NEGLIGIBLE_LOG_NORM by ``segment_log_bounds`` over ``chunk_log_bounds`` (one 2048-token segment of the
    benchmark's decay, ~ -104): the transition made token by token in float64 is below float32's smallest normal."""
    from flashgdn.cp.bounds import chunk_log_bounds, segment_log_bounds

    k, g, beta = _inputs(2048, 1, 2, 16, seed=11)
    slots = torch.tensor([[64 * c, 64] for c in range(32)], dtype=torch.int32)
    got = segment_log_bounds(chunk_log_bounds(k, g, beta, slots), torch.tensor([0]), torch.tensor([0, 2048]))[0]
    assert (got < NEGLIGIBLE_LOG_NORM).all()
    for h in range(2):
        assert float(_transition(k, g, beta, h, 2, 0, 2048).abs().max()) < torch.finfo(torch.float32).tiny


def test_the_kernels_bound_never_looks_negligible_on_non_finite_inputs():
    from flashgdn.cp.bounds import chunk_log_bounds, segment_log_bounds

    k, g, beta = _inputs(128, 1, 1, 16, seed=1, g_scale=50.0)
    g[0, 70, 0] = float("nan")
    slots = torch.tensor([[0, 64], [64, 64]], dtype=torch.int32)
    cb = chunk_log_bounds(k, g, beta, slots)
    assert cb[0, 0] < NEGLIGIBLE_LOG_NORM and cb[0, 1].isnan()
    assert not (segment_log_bounds(cb, torch.tensor([0]), torch.tensor([0, 128])) < NEGLIGIBLE_LOG_NORM).any()


def _slots_of(seg_cu):
    """The chunk slots as the chunk plan lays them out (each segment's chunks in turn) and each segment's first."""
    slots, first_slot = [], []
    for s, a in enumerate(seg_cu[:-1].tolist()):
        e = int(seg_cu[s + 1])
        first_slot.append(len(slots))
        slots += [[a + 64 * c, min(64, e - a - 64 * c)] for c in range((e - a + 63) // 64)]
    return torch.tensor(slots, dtype=torch.int32), torch.tensor(first_slot, dtype=torch.int32)


def _chunkwise_b_starts(k, v, g, beta, h0, seg_cu, seg_seq, first):
    from flashgdn.cp.bounds import chunk_log_bounds, chunk_log_injects, segment_b_starts

    slots, first_slot = _slots_of(seg_cu)
    h0_log_norm = None if h0 is None else torch.linalg.vector_norm(h0, dim=(-2, -1)).log()
    return segment_b_starts(chunk_log_bounds(k, g, beta, slots), chunk_log_injects(k, v, g, beta, slots),
                            first_slot, seg_cu, h0_log_norm, seg_seq, first)


def test_chunk_log_injects_bound_each_chunks_injection_from_above():
    """``chunk_log_injects``: per chunk and value head at or above the log of sum |beta||k||v| carried to the
    chunk's end by the per-token bounds, made in float64 token by token, and above it by no more than its margin;
    an idle slot gives -inf."""
    from flashgdn.cp.bounds import CHUNK_BOUND_ABS, CHUNK_BOUND_REL, chunk_log_injects

    k, v, g, beta, h0, seg_cu, seg_seq, first = _late_b_case(seed=5)
    slots, _ = _slots_of(seg_cu)
    slots = torch.cat([slots, torch.zeros(1, 2, dtype=torch.int32)])
    got = chunk_log_injects(k, v, g, beta, slots)
    assert got.shape == (4, slots.shape[0]) and got.dtype == torch.float32
    assert torch.isneginf(got[:, -1]).all()
    lu = token_log_growth(k, g, beta).double()
    inj = (beta[0].double().abs() * k[0].double().norm(dim=-1).repeat_interleave(2, dim=1)
           * v[0].double().norm(dim=-1)).log()
    for j, (a, n) in enumerate(slots[:-1].tolist()):
        after = lu[a:a + n].sum(0) - lu[a:a + n].cumsum(0)
        want = (inj[a:a + n] + after).logsumexp(0)
        mag = (g[0, a:a + n].double().abs() + lu[a:a + n] - g[0, a:a + n].double()).sum(0)
        slack = mag * CHUNK_BOUND_REL + CHUNK_BOUND_ABS
        assert (got[:, j].double() >= want - 1e-5).all() and (got[:, j].double() - want <= slack + 1e-4).all(), j


@pytest.mark.parametrize("g_scale,h0_scale", [(1.0, 0.0), (1.0, 1.0), (0.6, 1e30), (0.6, 1.0)])
def test_chunkwise_late_b_drops_only_what_is_below_float32s_range(g_scale, h0_scale):
    """``segment_b_starts`` over ``chunk_log_bounds`` and ``chunk_log_injects`` (the per-chunk form a kernel can
    make): the tokens before the chunk where b's walk starts owe b less than e^-88 in every entry, made token by
    token in float64; heads without decay or with keys that grow the state keep every chunk; and it leaves out what
    the token-by-token ``b_start_chunks`` does, up to one chunk either way (its own margins against the other's sum
    over earlier segments)."""
    from flashgdn.cp.bounds import b_start_chunks

    k, v, g, beta, h0, seg_cu, seg_seq, first = _late_b_case(g_scale=g_scale, h0_scale=h0_scale)
    starts = _chunkwise_b_starts(k, v, g, beta, h0, seg_cu, seg_seq, first)
    chunks = [(int(b) - int(a) + 63) // 64 for a, b in zip(seg_cu[:-1], seg_cu[1:])]
    assert starts.shape == (5, 4) and starts.dtype == torch.int32
    _assert_late_starts_leave_out_only_negligible(starts, k, v, g, beta, h0, seg_cu, seg_seq)
    token_wise = b_start_chunks(k, v, g, beta, seg_cu, sum(chunks), h0=h0, seg_seq=seg_seq, first=first)
    assert (starts - token_wise).abs().max() <= 1, (starts, token_wise)
    if g_scale == 1.0:
        assert (starts[:, :2] > 0).all(), starts


def test_chunkwise_late_b_leaves_most_of_a_long_segment_under_the_benchmarks_gates():
    """What the per-chunk form would save: one 256-chunk segment (16384 tokens, normalised keys of 128, beta in
    (0, 1), the benchmark's gates of about -0.05 a token) leaves out all but the last ~30 chunks of b's walk on every
    head, as the token-by-token bound does; the same segment without decay keeps them all."""
    from flashgdn.cp.bounds import b_start_chunks

    T, Hqk, Hv, K = 16384, 1, 2, 128
    gen = torch.Generator().manual_seed(4)
    k = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, T, Hv, K, generator=gen).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, generator=gen)) / 16
    beta = torch.rand(1, T, Hv, generator=gen)
    seg_cu, seg_seq, first = torch.tensor([0, T]), torch.tensor([0]), torch.tensor([0])
    starts = _chunkwise_b_starts(k, v, g, beta, None, seg_cu, seg_seq, first)
    token_wise = b_start_chunks(k, v, g, beta, seg_cu, 256)
    assert (starts >= 256 - 40).all() and (starts < 256).all(), starts
    assert (starts - token_wise).abs().max() <= 1, (starts, token_wise)
    assert (_chunkwise_b_starts(k, v, g * 0, beta, None, seg_cu, seg_seq, first) == 0).all()


def test_chunkwise_late_b_leaves_nothing_out_on_non_finite_inputs():
    """A gate that is not finite makes its segment's chunk bounds so: that segment's b leaves out nothing. A NaN
    value makes its chunk's injection NaN: the count stops before that chunk (the kernel's rule), whose NaN the
    walk then takes in."""
    k, v, g, beta, h0, seg_cu, seg_seq, first = _late_b_case()
    clean = _chunkwise_b_starts(k, v, g, beta, h0, seg_cu, seg_seq, first)
    g[0, 300, 0] = float("nan")  # in the second segment of the first sequence
    starts = _chunkwise_b_starts(k, v, g, beta, h0, seg_cu, seg_seq, first)
    assert starts[1, 0] == 0 and starts[1, 1] > 0 and starts[0, 0] > 0
    v[0, 256 + 64 + 5, 1] = float("nan")  # the second chunk of the same segment, value head 1
    assert clean[1, 1] >= 2
    assert _chunkwise_b_starts(k, v, g, beta, h0, seg_cu, seg_seq, first)[1, 1] == 1
