def _late_b_pass_case(cuda, injects=False, seqlens=(3000, 64, 2000), segment_chunks=8, poison_gate=None):
    """The transition pass's inputs for the late-b tests: sequences of ``seqlens`` tokens (three by default) of strong
    gates with a g = 0 head (3) on ``segment_chunks``-chunk segments, at 2/4, stage 1 with its chunk bounds and
    injections where ``injects``: ``(inputs, index, seg_cu, stage1, pass arguments, h0, last)``, ``last [segments]``
    (on the GPU) the segments last in their sequence, whose b no splice reads."""
    from flashgdn.cp.plan import segment_index_tensors, split_sequences
    from flashgdn.kernels.hopper.forward import hopper_stage1

    seqlens = list(seqlens)
    inp = make_inputs(seqlens, Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, gate="strong",
                      zero_gate_heads=(3,))
    if poison_gate is not None:  # (token, head): a gate of +inf there
        inp["g"] = inp["g"].clone()
        inp["g"][0, poison_gate[0], poison_gate[1]] = float("inf")
    plan = split_sequences(seqlens, segment_chunks)
    index = segment_index_tensors(plan, inp["cu_seqlens"])
    seg_cu = index.seg_cu.to(torch.int32)
    late = dict(chunk_bounds=True, inject_v=inp["v"]) if injects else {}
    stage1 = hopper_stage1(inp["k"], inp["g"], inp["beta"], seg_cu, cu_cpu=plan.seg_cu, **late)
    h0 = inp["initial_state"].float().contiguous()
    seg = torch.arange(plan.num_segments)
    last = (seg == plan.first[plan.seg_seq] + plan.count[plan.seg_seq] - 1).to(cuda)
    return inp, index, seg_cu, stage1, (inp["q"], inp["k"], inp["v"], stage1, None, seg_cu), h0, last


def _assert_late_b_walks_to_the_same_ends(plain, got, starts, last):
    """Some b items of the decaying heads leave chunks out (``starts``), the g = 0 head's none; every M and every b
    a splice reads the same bits with and without it."""
    assert (starts[~last, :3] > 0).any() and not starts[:, 3].any()
    assert torch.equal(plain[:, 1::2], got[:, 1::2]), "M"
    assert torch.equal(plain[~last][:, 0::2], got[~last][:, 0::2]), "b of the segments a splice reads"


def test_late_b_items_walk_from_their_start_chunk_to_the_same_ends(cuda):
    """The pass itself (``forward.hopper_transition_pairs``) with the bounds, without and with ``b_start``, on the
    same segments: every M and every b a splice reads the same bits, where b items of the decaying heads leave out
    chunks (the g = 0 head none)."""
    from flashgdn.cp.bounds import b_start_chunks, chunk_count, transition_log_bounds
    from flashgdn.kernels.hopper.forward import hopper_transition_pairs

    inp, index, seg_cu, _, args, h0, last = _late_b_pass_case(cuda)
    k, v, g, beta = inp["k"], inp["v"], inp["g"], inp["beta"]
    bounds = transition_log_bounds(k, g, beta, seg_cu)
    starts = b_start_chunks(k, v, g, beta, seg_cu, chunk_count(seg_cu.cpu()), h0=h0, seg_seq=index.seg_seq,
                            first=index.first)
    plain = hopper_transition_pairs(*args, unread=(index, "forward"), h0=h0, m_bound=bounds)
    got = hopper_transition_pairs(*args, unread=(index, "forward"), h0=h0, m_bound=bounds, b_start=starts)
    _assert_late_b_walks_to_the_same_ends(plain, got, starts, last)


"""Exact context parallelism with the Hopper kernels (GPU), for strong decay, g = 0 heads and unnormalised keys.

Two bars. The machinery is checked at 1e-2: with bf16 tensor-core operands the runs with and without segments
are two different roundings of the same result, each ~4e-3 from float64 when nothing decays
(``benchmarks/numerics_study.py``), so they differ by about that much. The issue's bar, 1e-3, needs the state
path's register operands (S, W, Vn) at more than bf16 precision (a bf16 hi + lo pair brings the difference to
~1e-5 in the study); until the kernels have that mode, that test is an expected failure."""
import pytest
import torch

from flashgdn import chunk_gated_delta_rule
from helpers import make_inputs, rel_rms

pytestmark = pytest.mark.gpu

CP_BAR = 1e-3  # the bar
MACHINERY_BAR = 1e-2


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000], gate="strong", zero_gate_heads=(1,)),
    dict(seqlens=[4096, 4096], dense=True, normalize_qk=False),
    dict(seqlens=[3000, 1], state_v_first=True, initial_state=False),
])
@pytest.mark.parametrize("segment_chunks", [4, 16])
def test_hopper_cp_matches_no_cp(opts, segment_chunks, cuda):
    o0, h0, o1, h1 = _both(opts, segment_chunks, cuda)
    assert rel_rms(o1.float(), o0.float()) < MACHINERY_BAR
    assert rel_rms(h1, h0) < MACHINERY_BAR


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="bf16 register operands: CP and no CP differ by ~4e-3 (benchmarks/numerics_study.py)")
@pytest.mark.parametrize("segment_chunks", [4])
def test_hopper_cp_equals_no_cp_to_1e_3(segment_chunks, cuda):
    o0, h0, o1, h1 = _both(dict(seqlens=[8192], zero_gate_heads=(0, 1, 2, 3)), segment_chunks, cuda)
    assert rel_rms(o1.float(), o0.float()) < CP_BAR
    assert rel_rms(h1, h0) < CP_BAR


def _both(opts, segment_chunks, cuda):
    inp = make_inputs(Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, **opts)
    if inp.get("cu_seqlens") is not None:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    with torch.no_grad():
        o0, h0 = chunk_gated_delta_rule(**inp, output_final_state=True, backend="hopper", cp="off")
        o1, h1 = chunk_gated_delta_rule(**inp, output_final_state=True, backend="hopper", cp=segment_chunks)
    return o0, h0, o1, h1


@pytest.mark.parametrize("segment_chunks", [4, 16])
def test_hopper_cp_equals_no_cp_to_1e_3_in_the_precise_mode(segment_chunks, cuda, monkeypatch):
    """The precise mode (register operands as bf16 hi + lo pairs) makes the two runs agree to the issue's bar."""
    from flashgdn.kernels.hopper import forward

    monkeypatch.setattr(forward, "PRECISE", True)
    o0, h0, o1, h1 = _both(dict(seqlens=[8192, 3000], zero_gate_heads=(0, 1, 2, 3)), segment_chunks, cuda)
    assert rel_rms(o1.float(), o0.float()) < CP_BAR
    assert rel_rms(h1, h0) < CP_BAR


def _replayed(fn):
    """``fn()`` (its outputs a sequence of tensors) captured in a CUDA graph after a warm-up on a side stream, the
    captured outputs zeroed, then the graph replayed: ``(graph, outputs)``, the graph kept for as long as they are
    read."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    for x in outputs:
        x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return graph, outputs


def _assert_training_step_is_sync_free_and_replays(opts, cuda):
    """A training step (``_training_step``, cp=4), after a first call that loads the kernels, reads nothing back from
    the GPU (sync debug mode "error") and gives the first call's bits, and a CUDA graph of it replays to them."""
    names, step = _training_step(opts, cuda)
    want = step(4)  # compiles and loads the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step(4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, x, w in zip(["o", "final state"] + names, got, want):
        assert torch.equal(x, w), ("eager", name)
    graph, captured = _replayed(lambda: step(4))
    for name, x, w in zip(["o", "final state"] + names, captured, want):
        assert torch.equal(x, w), ("graph", name)


def _training_step(opts, cuda):
    """A training step on one set of inputs (2/4 heads, ``opts`` as ``make_inputs``'s, the host copy of the
    offsets given): ``(names, step)``, ``step(cp)`` running the op with that ``cp`` and its backward from fixed
    output gradients, and giving ``[o, final state] + the gradients of names`` (fresh tensors each call)."""
    inp = make_inputs(Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, **opts)
    if inp.get("cu_seqlens") is not None:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if inp.get(n) is not None]
    xs = {n: inp[n].detach().clone().requires_grad_(True) for n in names}
    gen = torch.Generator(device=cuda)
    do = torch.randn(inp["v"].shape, generator=gen.manual_seed(5), device=cuda).to(inp["v"].dtype)
    dht = torch.randn((len(opts["seqlens"]), 4, 128, 128), generator=gen.manual_seed(6), device=cuda)

    def step(cp):
        for x in xs.values():
            x.grad = None
        o, ht = chunk_gated_delta_rule(**(inp | xs), output_final_state=True, backend="hopper", cp=cp)
        torch.autograd.backward([o, ht], [do, dht])
        return [o.detach(), ht.detach()] + [xs[n].grad for n in names]

    return names, step


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000, 1], gate="strong"),
    dict(seqlens=[4096, 4096], dense=True),
])
def test_hopper_cp_is_sync_free_and_replays_in_a_cuda_graph(opts, cuda):
    """cp=4 reads nothing back from the GPU (sync debug mode "error"), and a CUDA graph of it, captured after
    a warm-up on a side stream, replays to the eager result bit for bit (same kernels, same inputs)."""
    inp = make_inputs(Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, **opts)
    if inp.get("cu_seqlens") is not None:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()

    def run():
        return chunk_gated_delta_rule(**inp, output_final_state=True, backend="hopper", cp=4)

    with torch.no_grad():
        o0, h0 = run()  # compiles and loads the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            o1, h1 = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph, (og, hg) = _replayed(run)
    assert torch.equal(o1, o0) and torch.equal(h1, h0)
    assert torch.equal(og, o1) and torch.equal(hg, h1)


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000], gate="strong", zero_gate_heads=(1,)),
])
def test_hopper_cp_matches_no_cp_with_the_uw_loop(opts, cuda, monkeypatch):
    """The uw chunk loop's state-only variant in the transition pass, its full loop in the forward."""
    from flashgdn.kernels.hopper import forward

    monkeypatch.setattr(forward, "DEFAULT_CHUNK_LOOP", "uw")
    o0, h0, o1, h1 = _both(opts, 4, cuda)
    assert rel_rms(o1.float(), o0.float()) < MACHINERY_BAR
    assert rel_rms(h1, h0) < MACHINERY_BAR


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),
    dict(seqlens=[4096, 4096], dense=True),
])
def test_paired_transition_pass_gives_the_same_bits(opts, cuda, monkeypatch):
    """FLASHGDN_HOPPER_CP_PAIRED: the transition pass on the rs loop's paired variant with stages 0 and 1 run
    once. Same kernels' arithmetic on the same values as the doubled-input pass, so the same bits."""
    from flashgdn.kernels.hopper import backend

    inp = make_inputs(Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, **opts)
    if inp.get("cu_seqlens") is not None:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    with torch.no_grad():
        o0, h0 = chunk_gated_delta_rule(**inp, output_final_state=True, backend="hopper", cp=4)
        monkeypatch.setattr(backend, "CP_PAIRED", True)
        o1, h1 = chunk_gated_delta_rule(**inp, output_final_state=True, backend="hopper", cp=4)
    assert torch.equal(o1, o0) and torch.equal(h1, h0)


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),
    dict(seqlens=[4096, 4096], dense=True),
])
@pytest.mark.parametrize("cp", [4, "auto"])
def test_transition_starts_made_in_the_kernel_give_the_same_bits(opts, cp, cuda, monkeypatch):
    """FLASHGDN_HOPPER_CP_STARTS_IN_KERNEL: the transition pass makes its start states from the sequences' initial
    states (h0, zero, the identity: the same float32 values the host's start tensor holds), in the forward and in
    the backward (cp=4: the backward's starts gathered, its pass without b; "auto": its own plan), so the output,
    the final state and every gradient are the same bits."""
    from flashgdn.kernels.hopper import backend

    inp = make_inputs(Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, **opts)
    if inp.get("cu_seqlens") is not None:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    names = ("q", "k", "v", "g", "beta", "initial_state")
    gen = torch.Generator(device=cuda).manual_seed(3)
    do = torch.randn(inp["v"].shape, generator=gen, device=cuda).to(inp["v"].dtype)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(backend, "CP_STARTS_IN_KERNEL", on)
        xs = {n: inp[n].detach().clone().requires_grad_(True) for n in names}
        o, ht = chunk_gated_delta_rule(**{**inp, **xs}, output_final_state=True, backend="hopper", cp=cp)
        torch.autograd.backward([o, ht], [do, torch.ones_like(ht)])
        runs.append([o, ht] + [xs[n].grad for n in names])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _splice_problem(seqlens, segment_chunks, cuda, seed):
    """The splice tests' shared set-up: the plan of ``seqlens`` cut into ``segment_chunks``-chunk segments, its
    segment index on the GPU, the sizes (segments, sequences, 4 value heads, K = 128) and a seeded generator."""
    from flashgdn.cp import split_sequences
    from flashgdn.cp.plan import segment_index_tensors

    plan = split_sequences(seqlens, segment_chunks)
    cu = torch.tensor([0] + seqlens, device=cuda).cumsum(0)
    index = segment_index_tensors(plan, cu)
    gen = torch.Generator(device=cuda).manual_seed(seed)
    return plan, index, plan.num_segments, len(seqlens), 4, 128, gen


@pytest.mark.parametrize("build", ["plain", "blocked"])
@pytest.mark.parametrize("seqlens,segment_chunks", [([8192], 4), ([5000, 64, 3000, 1, 700], 3), ([640] * 4, 10),
                                                    ([192, 64, 256], 1)])
def test_splice_kernel_matches_the_torch_splice(seqlens, segment_chunks, build, cuda, monkeypatch):
    """``splice.py`` (forward and reverse plain; the reverse register-blocked over 512 threads with M prefetched at
    every column width: ``forward.SPLICE_BLOCKED``) against the torch splices on random transitions, float32 both: equal
    up to the order of the float32 sums. Sequences of one segment (no step), two (one step), three and many."""
    from flashgdn.cp.backward import splice_reverse
    from flashgdn.cp.exact import _splice
    from flashgdn.kernels.hopper import forward
    from flashgdn.kernels.hopper.forward import hopper_splice

    monkeypatch.setattr(forward, "SPLICE_BLOCKED", build == "blocked")
    widths = (8, 16, 32) if build == "blocked" else (None,)

    plan, index, S, N, Hv, K, gen = _splice_problem(seqlens, segment_chunks, cuda, seed=5)
    pairs = torch.randn((S, 2 * Hv, K, K), generator=gen, device=cuda) / K ** 0.5  # M of norm ~1
    D = torch.randn((S, Hv, K, K), generator=gen, device=cuda)
    start = torch.randn((N, Hv, K, K), generator=gen, device=cuda)
    b, M = pairs[:, 0::2], pairs[:, 1::2]
    with torch.no_grad():
        want_fwd = _splice(lambda src: (M.index_select(0, src), b.index_select(0, src)), start, plan, index)
        want_rev = splice_reverse(lambda src: (M.index_select(0, src).transpose(-1, -2), D.index_select(0, src)),
                                  start, plan, index)
        for width in widths:
            if width is not None:
                # the operator's reverse splice at each width (the forward stays plain)
                monkeypatch.setattr(forward, "splice_width", lambda *a, w=width: w)
                monkeypatch.setattr(forward, "splice_options",
                                    lambda reverse, *a, w=width: dict(blocked=True, BV=w) if reverse else {})
            got_fwd = hopper_splice(pairs, start, index.first, index.count, S)
            got_rev = hopper_splice(pairs, start, index.first, index.count, S, D=D)
            assert rel_rms(got_fwd, want_fwd) < 1e-5, width
            assert rel_rms(got_rev, want_rev) < 1e-5, width


@pytest.mark.parametrize("build", ["plain", "blocked"])
@pytest.mark.parametrize("seqlens,segment_chunks", [([8192], 2), ([5000, 64, 3000, 1, 700], 3), ([192, 64, 256], 1)])
def test_splice_kernel_leaves_out_the_products_of_flagged_m(seqlens, segment_chunks, build, cuda, monkeypatch):
    """The splices' ``m_zero`` builds (pairs with the transition pass's flags, ``forward.set_m_zero``): where a
    segment's M is flagged its step is its own term alone. The flagged M are zero in the pairs the build without flags
    splices, and NaN in those the ``m_zero`` build splices (so a product made with one shows): forward, reverse at
    every blocked width, and chains from known starts, the same values both ways."""
    from flashgdn.kernels.hopper import forward
    from flashgdn.kernels.hopper.forward import hopper_splice, m_zero_of, set_m_zero

    monkeypatch.setattr(forward, "SPLICE_BLOCKED", build == "blocked")
    widths = (8, 16, 32) if build == "blocked" else (None,)
    plan, index, S, N, Hv, K, gen = _splice_problem(seqlens, segment_chunks, cuda, seed=11)
    zeroed = torch.randn((S, 2 * Hv, K, K), generator=gen, device=cuda) / K ** 0.5
    D = torch.randn((S, Hv, K, K), generator=gen, device=cuda)
    start = torch.randn((N, Hv, K, K), generator=gen, device=cuda)
    flags = torch.randint(0, 2, (S, Hv), generator=gen, device=cuda, dtype=torch.int32)
    flags[:, 1] = 1  # a head of only flagged steps, and one of none
    flags[:, 2] = 0
    zeroed[:, 1::2][flags.bool()] = 0.0
    poisoned = zeroed.clone()
    poisoned[:, 1::2][flags.bool()] = float("nan")
    set_m_zero(poisoned, flags)
    assert m_zero_of(poisoned) is flags and m_zero_of(zeroed) is None
    from_known = torch.randint(0, 2, (N,), generator=gen, device=cuda)
    from_known[0] = 1
    for width in widths:
        if width is not None:
            monkeypatch.setattr(forward, "splice_options",
                                lambda reverse, *a, w=width: dict(blocked=True, BV=w) if reverse else {})
        for kw in (dict(), dict(D=D), dict(from_known=from_known)):
            want = hopper_splice(zeroed, start, index.first, index.count, S, **kw)
            got = hopper_splice(poisoned, start, index.first, index.count, S, **kw)
            assert not want.isnan().any(), (width, list(kw))
            assert torch.equal(got, want), (width, list(kw))
    with pytest.raises(ValueError, match="m_zero"):
        bad = zeroed.clone()
        set_m_zero(bad, flags[:, :2])
        hopper_splice(bad, start, index.first, index.count, S)


@pytest.mark.parametrize("seqlens,segment_chunks", [([8192], 4), ([5000, 64, 3000, 1, 700], 3), ([192, 64, 256], 1)])
def test_splice_chains_kernel_matches_the_loop(seqlens, segment_chunks, cuda):
    """The splice's ``chains`` build (the backward from the forward's segment starts): on every chain that the
    random ``from_known`` marks, the first step is ``M start + b``; elsewhere the plain forward splice's. Against the
    kernel's loop in float64 (random transitions, float32 kernel), with rows no chain writes NaN; the chains' M of
    unmarked first segments NaN too, as a skipping transition pass leaves them."""
    from flashgdn.kernels.hopper.forward import hopper_splice

    plan, index, S, N, Hv, K, gen = _splice_problem(seqlens, segment_chunks, cuda, seed=7)
    pairs = torch.randn((S, 2 * Hv, K, K), generator=gen, device=cuda) / K ** 0.5
    start = torch.randn((N, Hv, K, K), generator=gen, device=cuda)
    from_known = torch.randint(0, 2, (N,), generator=gen, device=cuda)
    from_known[0] = 1
    if N > 1:
        from_known[1] = 0
    first, count = plan.first.tolist(), plan.count.tolist()
    for n in range(N):
        if not from_known[n]:
            pairs[first[n], 1::2] = float("nan")  # never read
    got = hopper_splice(pairs, start, index.first, index.count, S, from_known=from_known)
    p, st = pairs.double().cpu(), start.double().cpu()
    b, M = p[:, 0::2], p[:, 1::2]
    for n in range(N):
        f, c = first[n], count[n]
        state = st[n]
        assert rel_rms(got[f].cpu().double(), state) < 1e-6
        for s in range(f, f + c - 1):
            state = M[s] @ state + b[s] if (s > f or from_known[n]) else b[s]
            assert rel_rms(got[s + 1].cpu().double(), state) < 1e-5, (n, s)
    with pytest.raises(ValueError, match="from_known"):
        hopper_splice(pairs, start, index.first, index.count, S, D=pairs[:, 0::2], from_known=from_known)


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),
])
def test_cp_with_the_fused_cp_kernels(opts, cuda, monkeypatch):
    """FLASHGDN_HOPPER_CP_FUSED=1: the op's CP forward with the segment index and splice kernels equals the torch
    version's up to the order of float32 sums in the splice (~1e-6 in the start states; o in bf16 then flips a
    few last bits)."""
    from flashgdn.kernels.hopper import backend

    inp = make_inputs(Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, **opts)
    if inp.get("cu_seqlens") is not None:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    with torch.no_grad():
        o0, h0 = chunk_gated_delta_rule(**inp, output_final_state=True, backend="hopper", cp=4)
        monkeypatch.setattr(backend, "CP_FUSED", True)
        o1, h1 = chunk_gated_delta_rule(**inp, output_final_state=True, backend="hopper", cp=4)
    assert rel_rms(o1.float(), o0.float()) < 1e-3
    assert rel_rms(h1, h0) < 1e-4


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("segment_chunks", [1, 4, 64])
def test_segment_index_kernel_equals_the_torch_index(segment_chunks, cu_dtype, cuda):
    """``segment_index.py`` against ``segment_index_tensors``: the same integers, for empty, short and long
    sequences and more than one block of 1024 sequences."""
    import random

    from flashgdn.cp import split_sequences
    from flashgdn.cp.plan import segment_index_tensors
    from flashgdn.kernels.hopper.forward import hopper_segment_index

    rnd = random.Random(segment_chunks)
    for seqlens in ([8192], [0, 5, 64, 65, 3000, 0, 1], [rnd.choice([0, 1, 64, rnd.randint(1, 5000)])
                                                       for _ in range(2500)]):
        plan = split_sequences(seqlens, segment_chunks)
        cu = torch.tensor([0] + seqlens, device=cuda).cumsum(0).to(cu_dtype)
        want = segment_index_tensors(plan, cu)
        got = hopper_segment_index(plan, cu)
        for name in ("seg_cu", "seg_seq", "first", "count"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("m", [2, 3, 16])
def test_chain_index_kernel_equals_the_torch_index(m, cuda):
    """``segment_index.build_chain_index`` against ``exact.chain_index_tensors``: the same integers, for empty,
    short and long sequences and more forward segments than one block of threads."""
    import random

    from flashgdn.cp import split_sequences
    from flashgdn.cp.exact import chain_index_tensors
    from flashgdn.cp.plan import segment_index_tensors
    from flashgdn.kernels.hopper.forward import hopper_chain_index

    rnd = random.Random(m)
    for seqlens in ([8192], [0, 5, 64, 65, 3000, 0, 1], [rnd.choice([0, 1, 64, rnd.randint(1, 20000)])
                                                       for _ in range(700)]):
        cu = torch.tensor([0] + seqlens, device=cuda).cumsum(0)
        index = segment_index_tensors(split_sequences(seqlens, 1), cu)
        known = segment_index_tensors(split_sequences(seqlens, m), cu)
        (want, want_jf), (got, got_jf) = chain_index_tensors(index, known, m), hopper_chain_index(index, known, m)
        assert known.seg_seq.numel() > 256 or len(seqlens) < 700
        for a, b in ((got.first, want.first), (got.count, want.count), (got_jf, want_jf)):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert got.seg_cu is index.seg_cu and got.seg_seq is index.seg_seq


def _cp_op_and_gradients(opts, cuda):
    """The op with CP on 4-chunk segments and its backward (fixed output gradients) on one set of inputs: returns
    ``(names, run)``, ``run()`` giving ``[o, final state] + the gradients of names``."""
    inp = make_inputs(Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, **opts)
    if inp.get("cu_seqlens") is not None:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if inp.get(n) is not None]
    gen = torch.Generator(device=cuda)

    def run():
        xs = {n: inp[n].detach().clone().requires_grad_(True) for n in names}
        o, ht = chunk_gated_delta_rule(**(inp | xs), output_final_state=True, backend="hopper", cp=4)
        do = torch.randn(o.shape, generator=gen.manual_seed(5), device=cuda).to(o.dtype)
        dht = torch.randn(ht.shape, generator=gen.manual_seed(6), device=cuda)
        torch.autograd.backward([o, ht], [do, dht])
        return [o.detach(), ht.detach()] + [xs[n].grad for n in names]

    return names, run


def _same_bits_both_ways(opts, cuda, monkeypatch, module, switch):
    """The op and its gradients (``_cp_op_and_gradients``) with ``module.<switch>`` False, then True: every tensor the
    same bits."""
    names, run = _cp_op_and_gradients(opts, cuda)
    monkeypatch.setattr(module, switch, False)
    want = run()
    monkeypatch.setattr(module, switch, True)
    got = run()
    for name, x, w in zip(["o", "final state"] + names, got, want):
        assert torch.equal(x, w), name


@pytest.mark.parametrize("opts", [dict(seqlens=[8192]), dict(seqlens=[5000, 64, 3000, 1], gate="strong")])
def test_cluster_sum_gives_the_same_bits_on_segments(opts, cuda, monkeypatch):
    """backward.FUSED_CLUSTER_SUM under CP (the fused kernel on 4-chunk segments, each segment's group of value
    heads one cluster): the op and every gradient the same bits as with the per-value-head dq and dk summed after."""
    from flashgdn.kernels.hopper import backward

    monkeypatch.setattr(backward, "FUSED_BACKWARD", True)
    monkeypatch.setattr(backward, "FUSED_FOLD_MMA", False)  # dg's fold as the cluster build makes it
    _same_bits_both_ways(opts, cuda, monkeypatch, backward, "FUSED_CLUSTER_SUM")


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),
    dict(seqlens=[4096, 4096], dense=True),
])
def test_skipping_unread_transitions_gives_the_same_bits(opts, cuda, monkeypatch):
    """FLASHGDN_HOPPER_CP_SKIP_UNREAD: the paired transition pass walks no chunk for the items no splice reads (b
    of a last segment, M of a first, in the forward M of a last). Everything that is read is computed as before,
    so the op and its gradients are the same bits with and without it."""
    from flashgdn.kernels.hopper import backend

    monkeypatch.setattr(backend, "CP_PAIRED", True)
    _same_bits_both_ways(opts, cuda, monkeypatch, backend, "CP_SKIP_UNREAD")


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),
])
def test_lean_rs_state_paths_give_the_same_bits(opts, cuda, monkeypatch):
    """``forward.LEAN_STATE_PASSES``: the state passes (the rs loop's: CP's transitions, the backward's chunk states;
    and the backward's walk) with gamma_j, d_j and exp(g~_last) read once per chunk into registers: the same
    products, so the op with CP and its gradients are the same bits with and without it."""
    from flashgdn.kernels.hopper import forward

    _same_bits_both_ways(opts, cuda, monkeypatch, forward, "LEAN_STATE_PASSES")


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),
    dict(seqlens=[4096, 4096], dense=True),
])
def test_backward_overlap_gives_the_same_bits_and_replays_in_a_cuda_graph(opts, cuda, monkeypatch):
    """``cp.backward.OVERLAP``: the CP backward's walks from zero on a second stream beside the transitions and the
    chunk states. The same kernels on the same inputs, so the op and every gradient are the same bits with and
    without it (cp=4: the backward's starts gathered from the forward's; "auto": its own plan); and a training step
    with it (forward, then backward on the overlapping streams), captured in a CUDA graph after a warm-up on a side
    stream, replays to the eager bits."""
    from flashgdn.cp import backward as cp_backward

    names, run = _training_step(opts, cuda)
    for cp in (4, "auto"):
        monkeypatch.setattr(cp_backward, "OVERLAP", False)
        want = run(cp)
        monkeypatch.setattr(cp_backward, "OVERLAP", True)
        got = run(cp)
        for name, x, w in zip(["o", "final state"] + names, got, want):
            assert torch.equal(x, w), (cp, name)
    graph, captured = _replayed(lambda: run("auto"))
    for name, x, w in zip(["o", "final state"] + names, captured, got):
        assert torch.equal(x, w), ("graph", name)


@pytest.mark.parametrize("opts", [
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),  # most heads' M negligible, one never
    dict(seqlens=[8192], gate="mixed", normalize_qk=False),  # keys of any norm: the bound's growth terms
    dict(seqlens=[4096, 4096], dense=True),  # the normal gates on 4-chunk segments: nothing negligible
])
def test_negligible_transitions_give_the_same_bits(opts, cuda, monkeypatch):
    """``backend.CP_NEGLIGIBLE_M``: the transition pass stores zero for an M whose bound (``flashgdn.cp.bounds``) is
    below float32's range, without walking it. The M it would have made is that small too, and the splices add it
    times a state of ordinary size to b: below float32's resolution there, so the op and every gradient (cp=4: the
    backward's reverse splice reads the forward's M) are the same bits with and without it."""
    from flashgdn.kernels.hopper import backend

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", False)  # (the kernels' own bound takes precedence)
    _same_bits_both_ways(opts, cuda, monkeypatch, backend, "CP_NEGLIGIBLE_M")


@pytest.mark.parametrize("segment_chunks", [8, 48])
def test_late_b_in_kernel_items_leave_out_the_chunks_the_bound_names(segment_chunks, cuda):
    """That the pass's own count (``chunk_late_b``) does leave chunks out, which the same bits alone cannot show: with
    stage 1's Ag made NaN in every chunk that ``segment_b_starts`` leaves out of a b item, but the last one it leaves
    out (the count is made in float32 in another order: one chunk of slack), every b a splice reads is still the
    same bits as the plain pass's on clean inputs; without the count the NaN reaches them. 48-chunk segments take the
    count over two rounds of 32 chunks, with their prefix carried."""
    import dataclasses

    from flashgdn.cp.bounds import segment_b_starts
    from flashgdn.kernels.hopper.forward import hopper_transition_pairs

    seqlens = (9000, 64, 5000) if segment_chunks == 48 else (3000, 64, 2000)
    inp, index, seg_cu, stage1, _, h0, last = _late_b_pass_case(cuda, True, seqlens, segment_chunks)
    h0_log_norm = torch.linalg.vector_norm(h0, dim=(-2, -1)).log()
    starts = segment_b_starts(stage1.chunk_bound, stage1.chunk_inject, stage1.first_slot, seg_cu, h0_log_norm,
                              index.seg_seq, index.first)
    assert int(starts[~last, :3].max()) >= 2 and not starts[:, 3].any()
    if segment_chunks == 48:
        assert int(starts[~last, :3].max()) > 33, "a count past the first round"
    poisoned = stage1.Ag.clone()
    for n in range(starts.shape[0]):
        for h in range(4):
            skip = int(starts[n, h]) - 1
            if skip > 0:
                first = int(stage1.first_slot[n])
                poisoned[first:first + skip, h] = float("nan")
    common = (inp["q"], inp["k"], inp["v"])
    kw = dict(unread=(index, "forward"), h0=h0, chunk_bound=stage1.chunk_bound)
    plain = hopper_transition_pairs(*common, stage1, None, seg_cu, **kw)
    late = dict(chunk_inject=stage1.chunk_inject, h0_log_norm=h0_log_norm)
    got = hopper_transition_pairs(*common, dataclasses.replace(stage1, Ag=poisoned), None, seg_cu, **kw, **late)
    assert torch.equal(plain[~last][:, 0::2], got[~last][:, 0::2]), "b of the segments a splice reads"
    walked = hopper_transition_pairs(*common, dataclasses.replace(stage1, Ag=poisoned), None, seg_cu, **kw)
    assert torch.isnan(walked[~last][:, 0::2]).any(), "the poison is read where b walks from its segment's start"


@pytest.mark.parametrize("opts", [
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),  # most b items start late, one head never
    dict(seqlens=[8192], gate="mixed", normalize_qk=False),  # keys of any norm: the bound's growth terms
    dict(seqlens=[4096, 4096], dense=True),  # the normal gates on 4-chunk segments: no b starts late
])
def test_late_b_gives_the_same_bits(opts, cuda, monkeypatch):
    """``backend.CP_LATE_B`` (beside CP_NEGLIGIBLE_M): the transition pass walks each b from the chunk on which its
    bound (``flashgdn.cp.bounds.b_start_chunks``) says the earlier tokens owe it less than float32's smallest normal
    number. What it leaves out is below the float32 resolution of every entry of b that is not itself that small, and
    the rounding it would have added decays with it, so the op and every gradient are the same bits."""
    from flashgdn.kernels.hopper import backend

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", False)  # (the kernels' own bound takes precedence)
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M", True)
    _same_bits_both_ways(opts, cuda, monkeypatch, backend, "CP_LATE_B")


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),
    dict(seqlens=[4096, 4096], dense=True),
])
def test_walks_from_zero_without_their_stores_give_the_same_bits(opts, cuda, monkeypatch):
    """``backward.WALK_STARTS_ONLY``: CP's walks from zero by the walk's starts-only build, which stores no per-chunk
    gradient. The start gradients are what the walk with its stores makes, so the op and every gradient are the same
    bits with and without it."""
    from flashgdn.kernels.hopper import backward

    _same_bits_both_ways(opts, cuda, monkeypatch, backward, "WALK_STARTS_ONLY")


@pytest.mark.parametrize("opts", [
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),  # most walks stop early, one head never
    dict(seqlens=[8192], gate="mixed", normalize_qk=False),  # keys of any norm: the bound's growth terms
    dict(seqlens=[4096, 4096], dense=True),  # the normal gates on 4-chunk segments: no walk stops early
])
def test_walks_from_zero_stopped_early_give_the_same_bits(opts, cuda, monkeypatch):
    """``backward.WALK_EARLY_STOP`` (beside WALK_STARTS_ONLY): each walk from zero covers only its segment's chunks
    before the point from which, by ``flashgdn.cp.bounds.walk_stop_chunks``, the later tokens owe its start
    gradient less than float32's smallest normal number. What it leaves out, and the rounding it would have added,
    decay on the way to the start, so the op and every gradient are the same bits."""
    from flashgdn.kernels.hopper import backward

    monkeypatch.setattr(backward, "WALK_STARTS_ONLY", True)
    _same_bits_both_ways(opts, cuda, monkeypatch, backward, "WALK_EARLY_STOP")


def test_walks_stopped_early_give_the_same_start_gradients(cuda):
    """The walk itself (``backward.hopper_walk_starts``) without and with ``walk_chunks``: every start gradient the
    same bits, where the walks of the decaying heads stop early (the g = 0 head's never)."""
    from flashgdn.cp.bounds import walk_stop_chunks
    from flashgdn.kernels.hopper.backward import hopper_walk_starts

    seqlens = [3000, 1, 0, 64, 65, 2000]
    inp = make_inputs(seqlens, Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, gate="strong",
                      zero_gate_heads=(3,))
    q, k, g, beta, cu = (inp[n] for n in ("q", "k", "g", "beta", "cu_seqlens"))
    do = torch.randn(inp["v"].shape, generator=torch.Generator(device=cuda).manual_seed(4), device=cuda)
    do = do.to(torch.bfloat16)
    chunks = [(n + 63) // 64 for n in seqlens]
    cover = walk_stop_chunks(q, k, g, beta, do, 0.3, cu, sum(chunks))
    full = torch.tensor(chunks, device=cuda)[:, None]
    assert (cover[:, :3] < full).any() and (cover[:, 3:] == full).all()
    want = hopper_walk_starts(q, k, g, beta, do, 0.3, cu)
    got = hopper_walk_starts(q, k, g, beta, do, 0.3, cu, walk_chunks=cover)
    assert torch.equal(got, want)


@pytest.mark.parametrize("precise", [False, True])
def test_walk_starts_are_the_walks_start_gradients(precise, cuda):
    """The starts-only build itself (``backward.hopper_walk_starts``) against the walk with its stores
    (``hopper_state_gradients`` from a zero end gradient): every start gradient the same bits, on sequences of 1, 64,
    65 and 3000 tokens and an empty one, strong and zero gates, in the precise mode too."""
    from flashgdn.kernels.hopper.backward import hopper_state_gradients, hopper_walk_starts

    inp = make_inputs(Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, seqlens=[3000, 1, 0, 64, 65],
                      gate="strong", zero_gate_heads=(2,))
    q, k, g, beta, cu = (inp[n] for n in ("q", "k", "g", "beta", "cu_seqlens"))
    do = torch.randn(inp["v"].shape, generator=torch.Generator(device=cuda).manual_seed(3), device=cuda)
    do = do.to(torch.bfloat16)
    want = hopper_state_gradients(q, k, g, beta, do, None, 0.3, cu, precise=precise)[1]
    got = hopper_walk_starts(q, k, g, beta, do, 0.3, cu, precise=precise)
    assert got.shape == want.shape == (5, 4, 128, 128) and got.dtype == torch.float32
    assert torch.equal(got, want)
    assert got.abs().amax() > 0  # a walk that ran


def _transition_pass_case(cuda, chunk_bounds=False):
    """The transition pass's inputs for the M-zero tests: three sequences (3000, 64, 2000 tokens) of mixed gates with
    a g = 0 head (3) on 8-chunk segments, at 2/4: ``(inputs, index, seg_cu, stage1, pass arguments, h0, read)``,
    ``read [segments, 1]`` the segments whose M the splice reads (neither first nor last in their sequence)."""
    from flashgdn.cp.plan import segment_index_tensors, split_sequences
    from flashgdn.kernels.hopper.forward import hopper_stage1

    inp = make_inputs([3000, 64, 2000], Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, gate="mixed",
                      zero_gate_heads=(3,))
    plan = split_sequences([3000, 64, 2000], 8)
    index = segment_index_tensors(plan, inp["cu_seqlens"])
    seg_cu = index.seg_cu.to(torch.int32)
    k, g, beta = inp["k"], inp["g"], inp["beta"]
    stage1 = hopper_stage1(k, g, beta, seg_cu, cu_cpu=plan.seg_cu, chunk_bounds=chunk_bounds)
    h0 = inp["initial_state"].float().contiguous()
    seg = torch.arange(plan.num_segments)
    first = plan.first[plan.seg_seq]
    read = ((seg != first) & (seg != first + plan.count[plan.seg_seq] - 1))[:, None]
    return inp, index, seg_cu, stage1, (inp["q"], k, inp["v"], stage1, None, seg_cu), h0, read


def test_negligible_transitions_are_zero_where_the_bound_says_and_unchanged_elsewhere(cuda):
    """The pass itself (``forward.hopper_transition_pairs``) with and without the bounds, on the same segments: every
    b and every M whose bound is at or above NEGLIGIBLE_LOG_NORM the same bits; each M below it all zeros, and the
    M the plain pass makes there below float32's smallest normal number (what the bound promises)."""
    from flashgdn.cp.bounds import NEGLIGIBLE_LOG_NORM, transition_log_bounds
    from flashgdn.kernels.hopper.forward import hopper_transition_pairs

    inp, index, seg_cu, _, args, h0, read = _transition_pass_case(cuda)
    bounds = transition_log_bounds(inp["k"], inp["g"], inp["beta"], seg_cu)
    plain = hopper_transition_pairs(*args, unread=(index, "forward"), h0=h0)
    got = hopper_transition_pairs(*args, unread=(index, "forward"), h0=h0, m_bound=bounds)
    gone = bounds < NEGLIGIBLE_LOG_NORM  # [S, Hv]
    assert gone.any() and not gone.all() and not gone[:, 3].any()  # the g = 0 head never
    m_plain, m_got = plain[:, 1::2], got[:, 1::2]
    assert torch.equal(plain[:, 0::2], got[:, 0::2]), "b"
    assert torch.equal(m_got[~gone], m_plain[~gone]), "M at or above the threshold"
    assert not m_got[gone].any(), "M below the threshold is stored as zero"
    # the M the splice reads (a segment neither first nor last in its sequence; the others keep their identity start)
    walked = gone & read.to(cuda)
    assert walked.any()
    assert float(m_plain[walked].abs().max()) < torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("opts", [dict(seqlens=[5000, 64, 3000, 1], gate="strong")])
def test_negligible_transitions_replay_in_a_cuda_graph(opts, cuda, monkeypatch):
    """With ``backend.CP_NEGLIGIBLE_M`` the forward (its bounds made on a stream of their own) reads nothing back
    from the GPU and a CUDA graph of it replays to the eager result bit for bit."""
    from flashgdn.kernels.hopper import backend

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", False)  # (the kernels' own bound takes precedence)
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M", True)
    test_hopper_cp_is_sync_free_and_replays_in_a_cuda_graph(opts, cuda)


@pytest.mark.parametrize("opts", [
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),  # most heads' M negligible, one never
    dict(seqlens=[8192], gate="mixed", normalize_qk=False),  # keys of any norm: the bound's growth terms
    dict(seqlens=[4096, 4096], dense=True),  # the normal gates on 4-chunk segments: nothing negligible
])
def test_negligible_transitions_by_the_kernels_bounds_give_the_same_bits(opts, cuda, monkeypatch):
    """``backend.CP_NEGLIGIBLE_M_IN_KERNEL``: the same M items dropped by a bound that stage 1 makes per chunk and the
    transition pass sums per segment. The op and every gradient are the same bits with and without it (cp=4: the
    backward's reverse splice reads the forward's M; "auto": its own plan)."""
    from flashgdn.kernels.hopper import backend

    _same_bits_both_ways(opts, cuda, monkeypatch, backend, "CP_NEGLIGIBLE_M_IN_KERNEL")


def _assert_stage1_writes_the_same(got, plain, store_inverse):
    """Two stage 1 builds' outputs (``hopper_stage1``) the same bits where stage 1 writes them: the chunk slots, and
    each slot's rows of its chunk's tokens in g~, Ag and A (the rows past a short chunk's end, and idle slots, are
    left as allocated)."""
    assert torch.equal(got.bounds, plain.bounds)
    lengths = got.bounds[:, 1].long()
    C = got.Ag.shape[-1]
    rows = torch.arange(got.gcum.shape[1], device=lengths.device)
    written = (rows % C) < lengths[rows // C]
    assert torch.equal(got.gcum[:, written], plain.gcum[:, written])
    inside = (torch.arange(C, device=lengths.device)[None, :] < lengths[:, None])  # [S, C]
    block = inside[:, None, :, None] & inside[:, None, None, :]  # [S, 1, C, C]
    for name in ("Ag",) + (("A",) if store_inverse else ()):
        a, b = getattr(got, name), getattr(plain, name)
        assert torch.equal(a[block.expand_as(a)], b[block.expand_as(b)]), name


@pytest.mark.parametrize("store_inverse", [False, True])
def test_stage1_chunk_bounds_bound_each_chunks_transition(store_inverse, cuda):
    """``kkt_inverse``'s ``chunk_bounds``: per chunk slot and value head at least the float64 sum over the chunk's
    tokens of ``g + log max(1, |1 - beta |k|^2|)`` (``flashgdn.cp.bounds``' per-token bound), and above it by no more
    than the margin the kernel adds; the build's other outputs the same bits as without it."""
    from flashgdn.cp.bounds import CHUNK_BOUND_ABS, CHUNK_BOUND_REL
    from flashgdn.kernels.hopper.forward import hopper_stage1

    inp = make_inputs([3000, 1, 64, 65, 2000], Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda,
                      gate="mixed", normalize_qk=False, zero_gate_heads=(3,))
    k, g, beta, cu = inp["k"], inp["g"], inp["beta"], inp["cu_seqlens"].to(torch.int32)
    beta = beta * 2.5  # beta |k|^2 outside [0, 2] on many tokens: growth terms
    plain = hopper_stage1(k, g, beta, cu, store_inverse=store_inverse)
    got = hopper_stage1(k, g, beta, cu, store_inverse=store_inverse, chunk_bounds=True)
    _assert_stage1_writes_the_same(got, plain, store_inverse)
    # the bound in float64 from the stored keys: g + log max(1, |1 - beta |k|^2|) per token and value head
    kk = k[0].double().square().sum(-1).repeat_interleave(2, dim=1)  # [T, Hv]: value head h reads qk head h // 2
    growth = (1 - beta[0].double() * kk).abs().log().clamp(min=0)
    bounds = got.bounds.long().cpu()  # [S, 2]: first token, length
    real = torch.nonzero(bounds[:, 1] > 0).flatten().tolist()
    want, mag, grew = [], [], []
    for s in real:
        t0, n = bounds[s].tolist()
        gs, ws = g[0, t0:t0 + n].double(), growth[t0:t0 + n]
        want.append((gs + ws).sum(0))
        mag.append(gs.abs().sum(0) + ws.sum(0))
        grew.append(ws.sum(0))
    want, mag, grew = (torch.stack(x).cpu() for x in (want, mag, grew))  # [chunks, Hv]
    have = got.chunk_bound.t().double().cpu()[real]
    assert float(grew.max()) > 1, "no growth terms: the test's beta does not reach them"
    assert bool((have >= want).all()), "not a bound"
    # above the bound by the kernel's margin, give or take float32's rounding of the sums
    assert bool((have - want - mag * CHUNK_BOUND_REL - CHUNK_BOUND_ABS <= 1e-5 * (1 + mag)).all()), \
        "more margin than the kernel adds"
    assert bool((have[:, 3] > 0).all()), "the g = 0 head: no decay to bound"  # its terms: growth + margin
    # and what its PyTorch counterpart makes, to float32's rounding of the sums (the idle slots: never written)
    from flashgdn.cp.bounds import chunk_log_bounds

    model = chunk_log_bounds(k, g, beta, got.bounds).t().double().cpu()[real]
    assert bool(((have - model).abs() <= 1e-5 * (1 + mag)).all())


def test_negligible_transitions_by_the_kernels_bounds_are_zero_where_the_sums_say(cuda):
    """The pass itself with stage 1's chunk bounds (``chunk_bound=``): every b the same bits as the plain pass, each M
    zero where the segment's summed bound (rounded up as the kernel does) is below NEGLIGIBLE_LOG_NORM and the same
    bits elsewhere; some M dropped, the g = 0 head's never."""
    from flashgdn.cp.bounds import NEGLIGIBLE_LOG_NORM, segment_log_bounds
    from flashgdn.kernels.hopper.forward import hopper_transition_pairs

    _, index, seg_cu, stage1, args, h0, read = _transition_pass_case(cuda, chunk_bounds=True)
    plain = hopper_transition_pairs(*args, unread=(index, "forward"), h0=h0)
    got = hopper_transition_pairs(*args, unread=(index, "forward"), h0=h0, chunk_bound=stage1.chunk_bound)
    # the segments' rounded-up sums as the pass makes them (segment_log_bounds in float64: the kernel's float32 sum
    # may fall either side of the threshold only within its rounding)
    edge = segment_log_bounds(stage1.chunk_bound, stage1.first_slot, seg_cu).cpu()  # [N, Hv]
    clear = (edge - NEGLIGIBLE_LOG_NORM).abs() > 1e-3 * (1 + edge.abs())
    gone = (edge < NEGLIGIBLE_LOG_NORM) & read & clear
    kept = (edge >= NEGLIGIBLE_LOG_NORM) & read & clear
    assert gone.any() and kept.any() and not gone[:, 3].any()  # the g = 0 head never
    m_plain, m_got = plain[:, 1::2].cpu(), got[:, 1::2].cpu()
    assert torch.equal(plain[:, 0::2], got[:, 0::2]), "b"
    assert torch.equal(m_got[kept], m_plain[kept]), "M at or above the threshold"
    assert not m_got[gone].any(), "M below the threshold is stored as zero"
    assert float(m_plain[gone].abs().max()) < torch.finfo(torch.float32).tiny
    # the flags the splices read: 1 exactly where the pass stored M as zero that way, never on unwalked items
    from flashgdn.kernels.hopper.forward import m_zero_of

    assert m_zero_of(plain) is None
    flags = m_zero_of(got).cpu()
    assert flags.shape == edge.shape and flags.dtype == torch.int32
    assert bool((flags[gone] == 1).all()) and bool((flags[kept] == 0).all())
    assert bool((flags[~read.expand_as(flags)] == 0).all())
    assert not m_got[flags.bool()].any()


@pytest.mark.parametrize("opts", [dict(seqlens=[5000, 64, 3000, 1], gate="strong")])
def test_negligible_transitions_by_the_kernels_bounds_replay_in_a_cuda_graph(opts, cuda, monkeypatch):
    """With ``backend.CP_NEGLIGIBLE_M_IN_KERNEL`` the forward reads nothing back from the GPU and a CUDA graph of it
    replays to the eager result bit for bit."""
    from flashgdn.kernels.hopper import backend

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", True)
    test_hopper_cp_is_sync_free_and_replays_in_a_cuda_graph(opts, cuda)


BOUND_SWITCHES = (("backend", "CP_NEGLIGIBLE_M"), ("backend", "CP_LATE_B"), ("backward", "WALK_STARTS_ONLY"),
                  ("backward", "WALK_EARLY_STOP"))


@pytest.mark.parametrize("opts", [dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,))])
def test_cp_on_float32s_range_reads_nothing_back_and_replays_in_a_cuda_graph(opts, cuda, monkeypatch):
    """With every switch that leaves out what float32 cannot hold (``BOUND_SWITCHES``: M and b in the forward's
    transition pass by PyTorch bounds, the walks from zero without stores and stopped early), the forward alone and a
    training step (forward, then backward, cp=4) read nothing back from the GPU (sync debug mode "error"), and a CUDA
    graph of the training step replays to its eager bits: their bounds are device ops on streams of their own. (The
    kernels' own bound, the default, runs in every other CP test.)"""
    from flashgdn.kernels.hopper import backend, backward

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", False)  # (it takes precedence over the PyTorch bounds)
    for module, name in BOUND_SWITCHES:
        monkeypatch.setattr(backend if module == "backend" else backward, name, True)
    test_hopper_cp_is_sync_free_and_replays_in_a_cuda_graph(opts, cuda)

    _assert_training_step_is_sync_free_and_replays(opts, cuda)


@pytest.mark.parametrize("store_inverse", [False, True])
def test_stage1_chunk_injects_match_their_counterpart(store_inverse, cuda):
    """``kkt_inverse``'s ``chunk_injects`` (``hopper_stage1(..., inject_v=v)``): per chunk slot and value head what
    ``flashgdn.cp.bounds.chunk_log_injects`` makes, to float32's rounding of the sums (-inf where it is -inf: the g = 0
    head injects like any other, a zero value row injects nothing); the build's other outputs the same bits as with
    ``chunk_bounds`` alone."""
    from flashgdn.cp.bounds import chunk_log_injects
    from flashgdn.kernels.hopper.forward import hopper_stage1

    inp = make_inputs([3000, 1, 64, 65, 2000], Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda,
                      gate="mixed", normalize_qk=False, zero_gate_heads=(3,))
    k, v, g, beta, cu = inp["k"], inp["v"].clone(), inp["g"], inp["beta"] * 2.5, inp["cu_seqlens"].to(torch.int32)
    v[0, 64:128, 1] = 0  # a whole chunk of value head 1 without values (the second chunk of the first sequence)
    plain = hopper_stage1(k, g, beta, cu, store_inverse=store_inverse, chunk_bounds=True)
    got = hopper_stage1(k, g, beta, cu, store_inverse=store_inverse, chunk_bounds=True, inject_v=v)
    _assert_stage1_writes_the_same(got, plain, store_inverse)
    real = got.bounds[:, 1] > 0
    assert torch.equal(got.chunk_bound[:, real], plain.chunk_bound[:, real])
    have = got.chunk_inject[:, real].double().cpu()
    want = chunk_log_injects(k, v, g, beta, got.bounds).double().cpu()[:, real.cpu()]
    assert torch.isneginf(want).any(), "the zero value rows: nothing injected"
    assert torch.equal(torch.isneginf(have), torch.isneginf(want))
    finite = torch.isfinite(want)
    assert bool(((have[finite] - want[finite]).abs() <= 1e-4 * (1 + want[finite].abs())).all())


def test_late_b_in_kernel_items_walk_to_the_same_ends(cuda):
    """The pass itself with stage 1's chunk bounds, without and with its injections (``chunk_inject=``, the kernel's
    ``chunk_late_b``): every M and every b a splice reads the same bits, where by ``segment_b_starts`` b items of the
    decaying heads leave out chunks (the g = 0 head none)."""
    from flashgdn.cp.bounds import segment_b_starts
    from flashgdn.kernels.hopper.forward import hopper_transition_pairs

    inp, index, seg_cu, stage1, args, h0, last = _late_b_pass_case(cuda, injects=True)
    h0_log_norm = torch.linalg.vector_norm(h0, dim=(-2, -1)).log()
    starts = segment_b_starts(stage1.chunk_bound, stage1.chunk_inject, stage1.first_slot, seg_cu, h0_log_norm,
                              index.seg_seq, index.first)
    plain = hopper_transition_pairs(*args, unread=(index, "forward"), h0=h0, chunk_bound=stage1.chunk_bound)
    got = hopper_transition_pairs(*args, unread=(index, "forward"), h0=h0, chunk_bound=stage1.chunk_bound,
                                  chunk_inject=stage1.chunk_inject, h0_log_norm=h0_log_norm)
    _assert_late_b_walks_to_the_same_ends(plain, got, starts, last)


@pytest.mark.parametrize("opts", [
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),  # most b items start late, one head never
    dict(seqlens=[8192], gate="mixed", normalize_qk=False),  # keys of any norm: the bound's growth terms
    dict(seqlens=[4096, 4096], dense=True),  # the normal gates on 4-chunk segments: no b starts late
])
def test_late_b_in_kernel_gives_the_same_bits(opts, cuda, monkeypatch):
    """``backend.CP_LATE_B_IN_KERNEL``: the forward's transition pass starts each b where stage 1's per-chunk terms
    say the earlier tokens owe it less than float32's smallest normal number; the op and every gradient the same bits
    with and without it, as for ``CP_LATE_B``. These segments are a few chunks long: CP_LATE_B_MIN_CHUNKS at 0 (every
    length) so that they take it."""
    from flashgdn.kernels.hopper import backend

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", True)
    monkeypatch.setattr(backend, "CP_LATE_B_MIN_CHUNKS", 0)
    _same_bits_both_ways(opts, cuda, monkeypatch, backend, "CP_LATE_B_IN_KERNEL")


@pytest.mark.parametrize("opts", [dict(seqlens=[5000, 64, 3000, 1], gate="strong")])
def test_late_b_in_kernel_replays_in_a_cuda_graph(opts, cuda, monkeypatch):
    """With ``backend.CP_LATE_B_IN_KERNEL`` (its one host op the initial states' norms) the forward reads nothing back
    from the GPU and a CUDA graph of it replays to the eager result bit for bit (CP_LATE_B_MIN_CHUNKS at 0: these
    segments are a few chunks long)."""
    from flashgdn.kernels.hopper import backend

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", True)
    monkeypatch.setattr(backend, "CP_LATE_B_IN_KERNEL", True)
    monkeypatch.setattr(backend, "CP_LATE_B_MIN_CHUNKS", 0)
    test_hopper_cp_is_sync_free_and_replays_in_a_cuda_graph(opts, cuda)


def _emits_case(cuda):
    """Inputs for the emission pass's tests: five sequences (1 to 3000 tokens) at 2/4, mixed gates, keys of any norm,
    a g = 0 head (3), and a whole chunk of dO zero for value head 1 (the first sequence's second chunk): ``(q, k, g,
    beta, do, cu)``."""
    inp = make_inputs([3000, 1, 64, 65, 2000], Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda,
                      gate="mixed", normalize_qk=False, zero_gate_heads=(3,))
    do = torch.randn(inp["v"].shape, generator=torch.Generator(device=cuda).manual_seed(7), device=cuda)
    do = do.to(torch.bfloat16)
    do[0, 64:128, 1] = 0
    return inp["q"], inp["k"], inp["g"], inp["beta"] * 2.5, do, inp["cu_seqlens"].to(torch.int32)


def test_chunk_emits_match_their_counterpart(cuda):
    """``chunk_emits.py`` (``backward.hopper_chunk_emits``): per chunk slot and value head what
    ``flashgdn.cp.bounds.chunk_log_emits`` makes, to float32's rounding of the sums; -inf exactly where it is -inf (a
    chunk whose dO is zero emits nothing, the g = 0 head emits like any other)."""
    from flashgdn.cp.bounds import chunk_log_emits
    from flashgdn.kernels.hopper.backward import hopper_chunk_emits
    from flashgdn.kernels.hopper.forward import hopper_stage1

    q, k, g, beta, do, cu = _emits_case(cuda)
    st1 = hopper_stage1(k, g, beta, cu, cu_cpu=cu.cpu(), chunk_bounds=True)
    have32 = hopper_chunk_emits(q, k, g, beta, do, 0.3, st1.bounds).cpu()
    have = have32.double()
    want = chunk_log_emits(q, k, g, beta, do, 0.3, st1.bounds).double().cpu()
    assert have.shape == want.shape == (4, st1.bounds.shape[0])
    assert torch.isneginf(want).any(), "the zero dO chunk: nothing emitted"
    assert torch.equal(torch.isneginf(have), torch.isneginf(want))
    assert not torch.isnan(have).any()
    finite = torch.isfinite(want)
    assert bool(((have[finite] - want[finite]).abs() <= 1e-4 * (1 + want[finite].abs())).all())
    # a NaN gate makes its chunk's term NaN (a walk then keeps every chunk before it)
    g_nan = g.clone()
    g_nan[0, 70, 2] = float("nan")
    bad = hopper_chunk_emits(q, k, g_nan, beta, do, 0.3, st1.bounds).cpu()
    nan = torch.zeros_like(bad, dtype=torch.bool)
    nan[2, 1] = True
    assert torch.equal(torch.isnan(bad), nan)
    assert torch.equal(bad[~nan], have32[~nan])


def _walk_stop_case(cuda, segment_chunks=8):
    """Strong gates with a g = 0 head (3) over three sequences cut into ``segment_chunks``-chunk segments, at 2/4,
    stage 1 with its chunk bounds on the segments: ``(q, k, g, beta, do, seg_cu, seg_cu_cpu, stage1)``."""
    from flashgdn.cp.plan import segment_index_tensors, split_sequences
    from flashgdn.kernels.hopper.forward import hopper_stage1

    seqlens = [3000, 64, 2000]
    inp = make_inputs(seqlens, Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, gate="strong",
                      zero_gate_heads=(3,))
    plan = split_sequences(seqlens, segment_chunks)
    seg_cu = segment_index_tensors(plan, inp["cu_seqlens"]).seg_cu.to(torch.int32)
    do = torch.randn(inp["v"].shape, generator=torch.Generator(device=cuda).manual_seed(8), device=cuda)
    do = do.to(torch.bfloat16)
    stage1 = hopper_stage1(inp["k"], inp["g"], inp["beta"], seg_cu, cu_cpu=plan.seg_cu, chunk_bounds=True)
    return inp["q"], inp["k"], inp["g"], inp["beta"], do, seg_cu, plan.seg_cu, stage1


def test_walks_stopped_by_the_emission_pass_give_the_same_start_gradients(cuda):
    """The walks' covers from the kernels (``hopper_chunk_emits``, then ``hopper_walk_covers`` with stage 1's chunk
    bounds): within one chunk of ``segment_walk_stops`` on ``chunk_log_emits``, short of the segment's end for the
    decaying heads, never for the g = 0 head. The walk stopped there gives every start gradient the same bits as the
    walk over whole segments, also where dO is NaN in the chunks past those covers: it reads none of them."""
    from flashgdn.cp.bounds import chunk_log_emits, segment_walk_stops
    from flashgdn.kernels.hopper.backward import hopper_chunk_emits, hopper_walk_covers, hopper_walk_starts

    q, k, g, beta, do, seg_cu, seg_cu_cpu, st1 = _walk_stop_case(cuda)
    emit = hopper_chunk_emits(q, k, g, beta, do, 0.3, st1.bounds)
    got = hopper_walk_covers(st1.chunk_bound, emit, seg_cu, st1.first_slot)
    want = segment_walk_stops(st1.chunk_bound, chunk_log_emits(q, k, g, beta, do, 0.3, st1.bounds), st1.first_slot,
                              seg_cu)
    assert got.dtype == torch.int32 and got.shape == want.shape == (seg_cu.shape[0] - 1, 4)
    assert int((got.long() - want.long()).abs().max()) <= 1
    full = torch.div(seg_cu[1:] - seg_cu[:-1] + 63, 64, rounding_mode="floor")[:, None].to(got.device)
    assert (got[:, :3] < full).any() and (got[:, 3:] == full).all()
    plain = hopper_walk_starts(q, k, g, beta, do, 0.3, seg_cu)
    assert plain.abs().amax() > 0
    assert torch.equal(hopper_walk_starts(q, k, g, beta, do, 0.3, seg_cu, walk_chunks=got), plain)
    poisoned = do.clone()
    starts, cover = seg_cu_cpu.tolist(), got.cpu().tolist()
    for s_, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        for h in range(4):
            poisoned[0, min(b, a + 64 * cover[s_][h]):b, h] = float("nan")
    assert torch.isnan(poisoned).any()
    assert torch.equal(hopper_walk_starts(q, k, g, beta, poisoned, 0.3, seg_cu, walk_chunks=got), plain)


def test_walk_and_pass_counts_keep_every_chunk_where_a_chunk_bound_is_not_finite(cuda):
    """A gate of +inf (or -inf) in a late chunk makes that chunk's bound infinite (or NaN) and the counts' sums NaN
    or infinite: the walks' covers (``hopper_walk_covers``) and the transition pass's b start (``chunk_late_b``) then
    leave out nothing in that segment, as ``segment_walk_stops`` and ``segment_b_starts`` say, and the walk and the
    pass give the same values (NaN where NaN) as without a count."""
    from flashgdn.cp.bounds import segment_b_starts
    from flashgdn.kernels.hopper.backward import hopper_chunk_emits, hopper_walk_covers, hopper_walk_starts
    from flashgdn.kernels.hopper.forward import hopper_stage1, hopper_transition_pairs

    for bad in (float("inf"), -float("inf")):
        q, k, g, beta, do, seg_cu, seg_cu_cpu, _ = _walk_stop_case(cuda)
        g = g.clone()
        g[0, 64 * 6 + 5, 0] = bad  # the first segment's seventh chunk, head 0
        st1 = hopper_stage1(k, g, beta, seg_cu, cu_cpu=seg_cu_cpu, chunk_bounds=True)
        assert not torch.isfinite(st1.chunk_bound[0, 6])
        covers = hopper_walk_covers(st1.chunk_bound, hopper_chunk_emits(q, k, g, beta, do, 0.3, st1.bounds), seg_cu,
                                    st1.first_slot)
        assert covers[0, 0] == 8, (bad, covers[0])  # every chunk of the first segment, head 0
        plain = hopper_walk_starts(q, k, g, beta, do, 0.3, seg_cu)
        got = hopper_walk_starts(q, k, g, beta, do, 0.3, seg_cu, walk_chunks=covers)
        torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True)

    inp, index, seg_cu, stage1, args, h0, last = _late_b_pass_case(cuda, injects=True, poison_gate=(64 * 5 + 3, 0))
    assert not torch.isfinite(stage1.chunk_bound[0]).all()
    h0_log_norm = torch.linalg.vector_norm(h0, dim=(-2, -1)).log()
    starts = segment_b_starts(stage1.chunk_bound, stage1.chunk_inject, stage1.first_slot, seg_cu, h0_log_norm,
                              index.seg_seq, index.first)
    assert starts[0, 0] == 0  # the poisoned segment's head 0 leaves out nothing
    plain = hopper_transition_pairs(*args, unread=(index, "forward"), h0=h0, chunk_bound=stage1.chunk_bound)
    got = hopper_transition_pairs(*args, unread=(index, "forward"), h0=h0, chunk_bound=stage1.chunk_bound,
                                  chunk_inject=stage1.chunk_inject, h0_log_norm=h0_log_norm)
    torch.testing.assert_close(got[~last][:, 0::2], plain[~last][:, 0::2], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("opts", [
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),  # most walks stop early, one head never
    dict(seqlens=[8192], gate="mixed", normalize_qk=False),  # keys of any norm: the bound's growth terms
    dict(seqlens=[4096, 4096], dense=True),  # the normal gates on 4-chunk segments: no walk stops early
])
def test_walks_stopped_by_the_emission_pass_give_the_same_bits(opts, cuda, monkeypatch):
    """``backward.WALK_STOP_IN_KERNEL`` (beside WALK_STARTS_ONLY and the kernels' chunk bounds): each walk from zero
    stops where the emission pass's and stage 1's terms say the later tokens owe its start gradient less than
    float32's smallest normal number; the op and every gradient the same bits with and without it.
    WALK_STOP_MIN_CHUNKS at 0: these segments are a few chunks long."""
    from flashgdn.kernels.hopper import backend, backward

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", True)
    monkeypatch.setattr(backward, "WALK_STARTS_ONLY", True)
    monkeypatch.setattr(backward, "WALK_STOP_MIN_CHUNKS", 0)
    _same_bits_both_ways(opts, cuda, monkeypatch, backward, "WALK_STOP_IN_KERNEL")


@pytest.mark.parametrize("opts", [dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,))])
def test_walks_stopped_by_the_emission_pass_read_nothing_back_and_replay_in_a_cuda_graph(opts, cuda, monkeypatch):
    """With ``backward.WALK_STOP_IN_KERNEL`` (the gate from the host's offsets, the covers by a kernel) a training step
    (cp=4) reads nothing back from the GPU, and a CUDA graph of it replays to its eager bits."""
    from flashgdn.kernels.hopper import backend, backward

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", True)
    monkeypatch.setattr(backward, "WALK_STARTS_ONLY", True)
    monkeypatch.setattr(backward, "WALK_STOP_IN_KERNEL", True)
    monkeypatch.setattr(backward, "WALK_STOP_MIN_CHUNKS", 0)
    _assert_training_step_is_sync_free_and_replays(opts, cuda)
