"""Exact context parallelism for the backward on the CPU (``flashgdn.cp.backward``): the segment driver around the
float64 reference stages equals the backward without segments up to rounding, for any gate and unnormalised
keys, with and without initial state and final-state gradient; and it reads nothing back from the device."""
import weakref

import pytest
import torch

from flashgdn.cp import split_sequences
from flashgdn.cp.backward import cp_backward, splice_reverse
from flashgdn.cp.plan import segment_index_tensors
from flashgdn.reference.chunked_backward import ReferenceBackwardStages, chunk_gated_delta_rule_backward_reference
from helpers import assert_same_computation, rel_rms
from test_cp import (CASES, DeviceOps, _meta_forward, _meta_inputs, _packed_case, _SkippingPairedReferenceForward,
                     _StartsBuildingForward, ref_forward)

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _grads(case, K, V, with_h0=True, with_dht=True):
    q, k, v, g, beta, h0, cu = _packed_case(case, K, V)
    h0 = h0 if with_h0 else None
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn((cu.shape[0] - 1, v.shape[2], K, V), generator=gen, dtype=torch.float64) if with_dht else None
    want = chunk_gated_delta_rule_backward_reference(q, k, v, g, beta, do, dht, scale=0.3, initial_state=h0,
                                                     cu_seqlens=cu)
    return (q, k, v, g, beta, do, dht, h0, cu), want


@pytest.mark.parametrize("K,V", [(16, 16), (16, 8)])  # V = K: the forward transitions in one doubled pass; else two
@pytest.mark.parametrize("segment_chunks", [1, 3])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cp_backward_equals_the_backward_without_segments(case, segment_chunks, K, V):
    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(case, K, V)
    plan = split_sequences((cu[1:] - cu[:-1]).tolist(), segment_chunks)
    with torch.no_grad():
        got = cp_backward(ReferenceBackwardStages(), ref_forward, q, k, v, g, beta, do, dht, 0.3, h0, plan, cu, cu)
    for name, x, w in zip(NAMES, got, want):
        if w is not None:  # no initial state: no dh0 to compare
            assert rel_rms(x, w) < 1e-10, name


@pytest.mark.parametrize("with_h0,with_dht", [(False, True), (True, False), (False, False)])
@pytest.mark.parametrize("grad", [False, True])  # with autograd on, the reverse splice does not write in place
def test_cp_backward_without_initial_state_or_final_gradient(with_h0, with_dht, grad):
    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(1, 16, 16, with_h0, with_dht)
    plan = split_sequences((cu[1:] - cu[:-1]).tolist(), 2)
    assert plan.split
    with torch.set_grad_enabled(grad):
        got = cp_backward(ReferenceBackwardStages(), ref_forward, q, k, v, g, beta, do, dht, 0.3, h0, plan, cu, cu)
    for name, x, w in zip(NAMES[:5], got, want):
        assert rel_rms(x, w) < 1e-10, name
    if with_h0:
        assert rel_rms(got[5], want[5]) < 1e-10


class _FusingReferenceStages(ReferenceBackwardStages):
    """The reference stages with the walk and the per-chunk gradients offered as one stage (as the Hopper backend's
    fused kernel offers them): ``cp_backward`` must call it in step 4 instead of the two, with the same arguments'
    meaning. Counts the calls of each."""

    fuses_gradients = True

    def __init__(self):
        super().__init__()
        self.calls = {"state_gradients": 0, "chunk_gradients": 0, "fused_gradients": 0}

    def state_gradients(self, *args):
        self.calls["state_gradients"] += 1
        return super().state_gradients(*args)

    def chunk_gradients(self, *args):
        self.calls["chunk_gradients"] += 1
        return super().chunk_gradients(*args)

    def fused_gradients(self, q, k, v, g, beta, do, states, dht, scale, cu, cu_cpu):
        self.calls["fused_gradients"] += 1
        ds_end, ds_start = ReferenceBackwardStages.state_gradients(self, q, k, g, beta, do, dht, scale, cu, cu_cpu)
        return ReferenceBackwardStages.chunk_gradients(self, q, k, v, g, beta, do, states, ds_end, scale, cu,
                                                       cu_cpu), ds_start


@pytest.mark.parametrize("segment_chunks", [None, 2])
def test_cp_backward_runs_a_fused_stage_in_step_four(segment_chunks):
    """Stages that fuse the walk and the per-chunk gradients get one fused call in step 4 (the walk still runs
    once more from zero end gradients in step 2 when the plan splits) and give the same gradients."""
    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(1, 16, 16)
    plan = split_sequences((cu[1:] - cu[:-1]).tolist(), segment_chunks)
    stages = _FusingReferenceStages()
    with torch.no_grad():
        got = cp_backward(stages, ref_forward, q, k, v, g, beta, do, dht, 0.3, h0, plan, cu, cu)
    assert stages.calls == {"state_gradients": int(plan.split), "chunk_gradients": 0, "fused_gradients": 1}
    for name, x, w in zip(NAMES, got, want):
        assert rel_rms(x, w) < 1e-10, name


class _StartsWalkingReferenceStages(_FusingReferenceStages):
    """The fusing reference stages that also offer ``walk_starts`` (the walk from zero with its start gradients
    alone, as the Hopper backend's ``starts_only`` build gives them): ``cp_backward`` must take step 2's D from it
    and call ``state_gradients`` for nothing."""

    def __init__(self):
        super().__init__()
        self.calls["walk_starts"] = 0

    def walk_starts(self, q, k, g, beta, do, scale, cu, cu_cpu):
        self.calls["walk_starts"] += 1
        return ReferenceBackwardStages.state_gradients(self, q, k, g, beta, do, None, scale, cu, cu_cpu)[1]


@pytest.mark.parametrize("segment_chunks", [None, 2])
def test_cp_backward_takes_the_walks_from_zero_from_walk_starts(segment_chunks):
    """Stages with ``walk_starts`` give step 2's D by it (once, where the plan splits) and ``state_gradients`` is
    not called; the gradients are the same."""
    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(1, 16, 16)
    plan = split_sequences((cu[1:] - cu[:-1]).tolist(), segment_chunks)
    stages = _StartsWalkingReferenceStages()
    with torch.no_grad():
        got = cp_backward(stages, ref_forward, q, k, v, g, beta, do, dht, 0.3, h0, plan, cu, cu)
    assert stages.calls == {"state_gradients": 0, "chunk_gradients": 0, "fused_gradients": 1,
                            "walk_starts": int(plan.split)}
    for name, x, w in zip(NAMES, got, want):
        assert rel_rms(x, w) < 1e-10, name


class _EarlyStoppingReferenceStages(_StartsWalkingReferenceStages):
    """``walk_starts`` as the Hopper walk's ``early_stop`` build runs it: each segment's walk from zero covers only
    the chunks ``walk_stop_chunks`` gives, from its start; counts the walks it shortened."""

    def __init__(self):
        super().__init__()
        self.stopped = 0

    def walk_starts(self, q, k, g, beta, do, scale, cu, cu_cpu):
        from flashgdn.cp.bounds import chunk_count, walk_stop_chunks

        self.calls["walk_starts"] += 1
        cover = walk_stop_chunks(q, k, g, beta, do, scale, cu, chunk_count(cu_cpu))
        ends = torch.minimum(cu[:-1].unsqueeze(-1) + 64 * cover.to(cu.dtype), cu[1:].unsqueeze(-1))  # [S, Hv]
        D = None
        for h in range(g.shape[-1]):  # the segments cut at this head's ends, the tokens past them in no segment
            cut = torch.stack([cu[:-1], ends[:, h]], 1).flatten()
            d = ReferenceBackwardStages.state_gradients(self, q, k, g, beta, do, None, scale, cut, None)[1][0::2]
            D = d if D is None else D
            D[:, h] = d[:, h]
            self.stopped += int((ends[:, h] < cu[1:]).sum())
        return D


@pytest.mark.parametrize("segment_chunks", [2, 3])
@pytest.mark.parametrize("case", [1, 2])
def test_cp_backward_with_walks_stopped_early_is_the_backward(case, segment_chunks):
    """The CP backward with the walks from zero stopped where ``walk_stop_chunks`` says (the Hopper walk's
    ``early_stop``): the backward without segments to 1e-10 in float64, where strong decay stops walks (case 1:
    strong gates, a g = 0 head) and where keys of any norm keep them whole (case 2)."""
    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(case, 16, 16)
    plan = split_sequences((cu[1:] - cu[:-1]).tolist(), segment_chunks)
    stages = _EarlyStoppingReferenceStages()
    with torch.no_grad():
        got = cp_backward(stages, ref_forward, q, k, v, g, beta, do, dht, 0.3, h0, plan, cu, cu)
    assert stages.calls["walk_starts"] == 1 and stages.calls["state_gradients"] == 0
    for name, x, w in zip(NAMES, got, want):
        if w is not None:
            assert rel_rms(x, w) < 1e-10, name
    if case == 1:
        assert stages.stopped > 0


@pytest.mark.parametrize("plan_kind", ["none", "unsplit"])
def test_cp_backward_without_segments_runs_the_stages_once(plan_kind):
    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(0, 16, 16)
    plan = None if plan_kind == "none" else split_sequences((cu[1:] - cu[:-1]).tolist(), None)
    got = cp_backward(ReferenceBackwardStages(), None, q, k, v, g, beta, do, dht, 0.3, h0, plan, cu, cu)
    for name, x, w in zip(NAMES, got, want):
        assert_same_computation(x, w)  # the same computation as the backward itself (case 0 has h0)


def test_splice_reverse_matches_a_loop_over_each_sequence():
    seqlens = [640, 64, 0, 1000, 200]
    plan = split_sequences(seqlens, 3)
    cu = torch.tensor([0] + seqlens).cumsum(0)
    index = segment_index_tensors(plan, cu)
    S, N, H, K, V = plan.num_segments, len(seqlens), 2, 4, 3
    gen = torch.Generator().manual_seed(2)
    Mt = torch.randn((S, H, K, K), generator=gen, dtype=torch.float64)
    D = torch.randn((S, H, K, V), generator=gen, dtype=torch.float64)
    end = torch.randn((N, H, K, V), generator=gen, dtype=torch.float64)
    with torch.no_grad():
        got = splice_reverse(lambda src: (Mt.index_select(0, src), D.index_select(0, src)), end, plan, index)
    for n in range(N):
        first, count = int(plan.first[n]), int(plan.count[n])
        state = end[n]
        for s in reversed(range(first, first + count)):
            assert torch.allclose(got[s], state, atol=1e-12), (n, s)
            state = Mt[s] @ state + D[s]


class _MetaStages:
    """Backward stages on meta tensors with the shapes of the real ones; records what the driver hands them, and
    holds only weak references to the per-chunk tensors it hands out, so that ``finish_gradients`` sees whether the
    driver still holds them."""

    def __init__(self, plan):
        self.plan, self.calls, self.per_chunk, self.per_segment = plan, [], [], []

    def _check(self, name, cu, cu_cpu):
        assert cu.device.type == "meta" and cu_cpu.device.type == "cpu"
        assert cu_cpu.tolist() == self.plan.seg_cu.tolist()
        self.calls.append(name)

    def chunk_states(self, q, k, v, g, beta, h0, cu, cu_cpu):
        self._check("chunk_states", cu, cu_cpu)
        assert h0.shape[0] == self.plan.num_segments
        self.per_segment.append(weakref.ref(h0))  # the true starts
        states = q.new_empty((1,))
        self.per_chunk.append(weakref.ref(states))
        return states

    def state_gradients(self, q, k, g, beta, do, dht, scale, cu, cu_cpu):
        self._check("state_gradients" if dht is not None else "state_gradients_from_zero", cu, cu_cpu)
        S, Hv, K, V = self.plan.num_segments, do.shape[2], k.shape[3], do.shape[3]
        ds_end = q.new_empty((1,))
        self.per_chunk.append(weakref.ref(ds_end))  # from the walk from zero too, whose ds_end nothing needs
        ds_start = torch.empty((S, Hv, K, V), device="meta")
        if dht is None:
            self.per_segment.append(weakref.ref(ds_start))  # D, the walks from zero
        else:  # the per-segment tensors of steps 1-3 are no longer held by the driver
            assert all(ref() is None for ref in self.per_segment), "a per-segment tensor of steps 1-3 still held"
        return ds_end, ds_start

    def chunk_gradients(self, q, k, v, g, beta, do, states, ds_end, scale, cu, cu_cpu):
        self._check("chunk_gradients", cu, cu_cpu)
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
                torch.empty_like(beta))

    def finish_gradients(self, grads):
        self.calls.append("finish_gradients")
        # the driver let go of the states and state gradients (of both walks) before the last step allocates
        assert len(self.per_chunk) >= 2 and all(ref() is None for ref in self.per_chunk)
        return grads


@pytest.mark.parametrize("with_dht", [True, False])
def test_cp_backward_reads_nothing_back_from_the_device(with_dht):
    seqlens = [1000, 37, 0, 300, 64, 4096]
    plan = split_sequences(seqlens, 2)
    q, k, v, g, beta, h0 = _meta_inputs(sum(seqlens), 16, 16, False, N=len(seqlens))
    do = torch.empty(v.shape, device="meta", dtype=v.dtype)
    dht = torch.empty(h0.shape, device="meta") if with_dht else None
    cu = torch.tensor([0] + seqlens).cumsum(0).to(device="meta", dtype=torch.int32)
    stages, passes = _MetaStages(plan), []
    forward = _meta_forward(plan, passes)

    def transitions_watched(*args, **kwargs):  # the transition pass's pairs too, released before step 4's walk
        o, end = forward(*args, **kwargs)
        stages.per_segment.append(weakref.ref(end))
        return o, end

    with torch.no_grad(), DeviceOps():
        dq, dk, dv, dg, dbeta, dh0 = cp_backward(stages, transitions_watched, q, k, v, g, beta, do, dht,
                                                 0.1, h0, plan, cu, torch.tensor([0] + seqlens).cumsum(0))
    assert passes == [(8, False)], "the forward transitions: one state-only pass of twice the value heads"
    assert len(stages.per_segment) == 3  # pairs, D, starts
    assert stages.calls == ["state_gradients_from_zero", "chunk_states", "state_gradients", "chunk_gradients",
                            "finish_gradients"]
    assert dh0.shape == h0.shape and dq.shape == q.shape


def _splice_from_pairs(pairs, D, start, plan, reverse, from_known=None):
    """What the Hopper splice kernel computes (``kernels/hopper/splice.py``), written as its per-sequence loop:
    from the pairs ``[S, 2 Hv, K, V]`` (head 2h: b, 2h + 1: M); ``from_known`` its ``chains`` build (a chain with a
    nonzero entry takes its first step as ``M start + b``)."""
    out = torch.empty((plan.num_segments,) + tuple(start.shape[1:]), dtype=start.dtype)
    b, M = pairs[:, 0::2], pairs[:, 1::2]
    for n in range(start.shape[0]):
        f, c = int(plan.first[n]), int(plan.count[n])
        if reverse:
            state = start[n]
            out[f + c - 1] = state
            for s in range(f + c - 1, f, -1):
                state = M[s].transpose(-1, -2) @ state + D[s]
                out[s - 1] = state
        else:
            state = out[f] = start[n]
            for s in range(f, f + c - 1):
                mid = from_known is not None and bool(from_known[n])
                state = b[s] if s == f and not mid else M[s] @ state + b[s]
                out[s + 1] = state
    return out


class _ForwardWithOwnSplice:
    """The reference forward with ``segment_index`` / ``splice`` / ``splice_reverse`` hooks (as the Hopper forward
    offers with its CP kernels), the splices computed by the kernel's loop; records that the drivers used them."""

    def __init__(self):
        self.used = []

    def __call__(self, *args, **kwargs):
        return ref_forward(*args, **kwargs)

    def segment_index(self, plan, cu_seqlens):
        from flashgdn.cp.plan import segment_index_tensors

        self.used.append("segment_index")
        return segment_index_tensors(plan, cu_seqlens)

    def splice(self, pairs, h0, plan, index):
        self.used.append("splice")
        return _splice_from_pairs(pairs, None, h0, plan, reverse=False)

    def splice_reverse(self, pairs, D, end, plan, index):
        self.used.append("splice_reverse")
        return _splice_from_pairs(pairs, D, end, plan, reverse=True)


@pytest.mark.parametrize("segment_chunks", [1, 3])
@pytest.mark.parametrize("case", [1, 2, 4])
def test_cp_drivers_use_the_forwards_own_splice(case, segment_chunks):
    from flashgdn.cp import cp_forward

    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(case, 16, 16)
    plan = split_sequences((cu[1:] - cu[:-1]).tolist(), segment_chunks)
    fwd = _ForwardWithOwnSplice()
    with torch.no_grad():
        got = cp_backward(ReferenceBackwardStages(), fwd, q, k, v, g, beta, do, dht, 0.3, h0, plan, cu, cu)
        o, ht = cp_forward(fwd, q, k, v, g, beta, 0.3, h0, True, plan, cu)
        o_ref, ht_ref = ref_forward(q, k, v, g, beta, 0.3, h0, cu, True)
    assert fwd.used == ["segment_index", "splice", "splice_reverse", "segment_index", "splice"]
    for name, x, w in zip(NAMES, got, want):
        if w is not None:
            assert rel_rms(x, w) < 1e-10, name
    assert rel_rms(o, o_ref) < 1e-10 and rel_rms(ht, ht_ref) < 1e-10


class _SkippingForwardWithOwnSplice(_SkippingPairedReferenceForward):
    """The skipping paired forward with the splice kernels' loops as its own splices (``_ForwardWithOwnSplice``)."""

    def segment_index(self, plan, cu_seqlens):
        return segment_index_tensors(plan, cu_seqlens)

    def splice(self, pairs, h0, plan, index):
        return _splice_from_pairs(pairs, None, h0, plan, reverse=False)

    def splice_reverse(self, pairs, D, end, plan, index):
        return _splice_from_pairs(pairs, D, end, plan, reverse=True)


@pytest.mark.parametrize("own_splice", [False, True])
@pytest.mark.parametrize("segment_chunks", [1, 3])
@pytest.mark.parametrize("case", [1, 2, 4])
def test_cp_backward_reads_no_transition_it_can_skip(case, segment_chunks, own_splice):
    """The backward's transitions skip fewer items than the forward's (its reverse splice reads M of last segments):
    with every item the backward may skip NaN (b of last segments, M of first ones), the gradients are the
    reference's, by the torch splices and by the splice kernels' loops."""
    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(case, 16, 16)
    plan = split_sequences((cu[1:] - cu[:-1]).tolist(), segment_chunks)
    fwd = _SkippingForwardWithOwnSplice() if own_splice else _SkippingPairedReferenceForward()
    with torch.no_grad():
        got = cp_backward(ReferenceBackwardStages(), fwd, q, k, v, g, beta, do, dht, 0.3, h0, plan, cu, cu)
    assert fwd.modes == (["backward"] if plan.split else [])
    for name, x, w in zip(NAMES, got, want):
        if w is not None:
            assert rel_rms(x, w) < 1e-10, name


class _CountingSkippingForward(_SkippingForwardWithOwnSplice):
    """The skipping forward with the splice kernels' loops, counting each splice's longest chain."""

    def __init__(self):
        super().__init__()
        self.chains = []

    def splice(self, pairs, h0, plan, index):
        self.chains.append(int(plan.count.max()))
        return super().splice(pairs, h0, plan, index)


class _CountingChainsForward(_CountingSkippingForward):
    """``_CountingSkippingForward`` with the splice kernel's ``chains`` build as ``splice_chains`` (as the Hopper
    forward offers): the chains' first products are made in the splice, the pairs left as they are."""

    def __init__(self):
        super().__init__()
        self.pairs_seen = []
        self.chain_index_calls = 0
        self.index_plans = []

    def segment_index(self, plan, cu_seqlens):
        self.index_plans.append(plan.segment_chunks)
        return segment_index_tensors(plan, cu_seqlens)

    def chain_index(self, index, known_index, m):
        from flashgdn.cp.exact import chain_index_tensors

        self.chain_index_calls += 1
        return chain_index_tensors(index, known_index, m)

    def splice_chains(self, pairs, starts, plan, chains, from_known):
        self.chains.append(int(plan.count.max()))
        self.pairs_seen.append(pairs.clone())
        return _splice_from_pairs(pairs, None, starts, plan, reverse=False, from_known=from_known)


# V = K: the transitions' pairs (from the torch forward, the skipping paired pass, or it with its own splice); else
# two passes without pairs
@pytest.mark.parametrize("K,V,forward_kind", [(16, 16, "torch"), (16, 16, "skipping"), (16, 16, "skipping_own_splice"),
                                              (16, 16, "skipping_own_chains"), (16, 16, "starts_building"),
                                              (16, 8, "torch")])
@pytest.mark.parametrize("fwd_chunks,bwd_chunks", [(2, 1), (4, 1), (6, 2), (1, 2), (2, 2), (1, 3), (3, 2)])
@pytest.mark.parametrize("case", [1, 2, 3])
def test_cp_backward_from_the_forwards_starts(case, fwd_chunks, bwd_chunks, K, V, forward_kind):
    """``forward_starts`` (the forward's plan and its true segment starts, ``cp_forward(keep_starts=True)``): the
    backward's segments start from them, by a gather (its length a multiple of the forward's), by chains no longer
    than the ratio (the forward's a multiple of its own; a chain's first b made from the known start, except at a
    sequence's start), or, when neither divides the other, by the whole splice; the gradients are the reference's
    either way, with every transition the backward may skip NaN."""
    from flashgdn.cp import cp_forward
    from flashgdn.cp.exact import float_states, segment_starts

    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(case, K, V)
    seqlens = (cu[1:] - cu[:-1]).tolist()
    fplan, plan = split_sequences(seqlens, fwd_chunks), split_sequences(seqlens, bwd_chunks)
    fwd = {"torch": lambda: ref_forward, "skipping": _SkippingPairedReferenceForward,
           "skipping_own_splice": _CountingSkippingForward,
           "skipping_own_chains": _CountingChainsForward, "starts_building": _StartsBuildingForward}[forward_kind]()
    with torch.no_grad():
        o, ht, fstarts = cp_forward(ref_forward, q, k, v, g, beta, 0.3, h0, True, fplan, cu, keep_starts=True)
        if isinstance(fwd, _CountingSkippingForward):
            fwd.chains.clear()
        got = cp_backward(ReferenceBackwardStages(), fwd, q, k, v, g, beta, do, dht, 0.3, h0, plan, cu, cu,
                          forward_starts=(fplan, fstarts))
    assert (fstarts is None) == (not fplan.split)
    for name, x, w in zip(NAMES, got, want):
        if w is not None:
            assert rel_rms(x, w) < 1e-10, name
    if forward_kind != "torch" and plan.split:  # gathered starts: the transition pass makes no b (all NaN here)
        assert fwd.modes == (["m_only"] if fplan.split and bwd_chunks % fwd_chunks == 0 else ["backward"])
    if isinstance(fwd, _CountingChainsForward) and fplan.split and plan.split:
        # the forward's index is built again only for other cuts than the backward's own
        assert fwd.index_plans == [bwd_chunks] + ([fwd_chunks] if fwd_chunks != bwd_chunks else [])
    if isinstance(fwd, _CountingSkippingForward) and fplan.split and plan.split:
        if bwd_chunks % fwd_chunks == 0:
            assert fwd.chains == []  # gathered, no splice
        elif fwd_chunks % bwd_chunks == 0:
            assert fwd.chains == [fwd_chunks // bwd_chunks]  # chains of the ratio, not the whole sequence
            if isinstance(fwd, _CountingChainsForward):  # through splice_chains, with no b rewritten first
                assert fwd.chain_index_calls == 1  # the chains' index by the forward's own hook
                fresh = segment_starts(fwd, q, k, v, g, beta, 0.3, float_states(h0, q, v, len(seqlens)), plan,
                                       segment_index_tensors(plan, cu), for_backward=True)[2]
                assert torch.equal(fwd.pairs_seen[0].nan_to_num(), fresh.nan_to_num())
        else:
            assert fwd.chains == [int(plan.count.max())]


class _StatesWatchingStages(ReferenceBackwardStages):
    """The reference stages, checking at step 4 (the per-chunk states, where the backward's memory peaks) that a
    tensor the test watches is no longer alive, unless it is the start states step 4 is handed (the backward on the
    forward's own segments takes the forward's starts as they are, with no copy)."""

    def __init__(self, watched):
        super().__init__()
        self.watched = watched
        self.checked = 0
        self.reused = 0

    def chunk_states(self, q, k, v, g, beta, h0, *args, **kwargs):
        alive = self.watched()
        assert alive is None or alive is h0, "the forward's starts are still alive at step 4, beside a copy"
        self.reused += alive is not None
        del alive
        self.checked += 1
        return super().chunk_states(q, k, v, g, beta, h0, *args, **kwargs)


@pytest.mark.parametrize("fwd_chunks,bwd_chunks", [(2, 1), (1, 2), (2, 2)])
def test_handed_off_forward_starts_are_released_before_step_4(fwd_chunks, bwd_chunks):
    """``StartsHandoff``: the forward's starts, passed down as a handoff (as the op's autograd backward does), are
    let go once step 1 has made the backward's own starts; the gradients are the reference's."""
    from flashgdn.cp import cp_forward
    from flashgdn.cp.exact import StartsHandoff

    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(1, 16, 16)
    seqlens = (cu[1:] - cu[:-1]).tolist()
    fplan, plan = split_sequences(seqlens, fwd_chunks), split_sequences(seqlens, bwd_chunks)
    with torch.no_grad():
        _, _, fstarts = cp_forward(ref_forward, q, k, v, g, beta, 0.3, h0, True, fplan, cu, keep_starts=True)
        watched = weakref.ref(fstarts)
        handoff = StartsHandoff(fplan, fstarts)
        del fstarts
        stages = _StatesWatchingStages(watched)
        got = cp_backward(stages, _SkippingPairedReferenceForward(), q, k, v, g, beta, do, dht, 0.3, h0, plan, cu,
                          cu, forward_starts=handoff)
    assert stages.checked == 1 and handoff.take() is None
    # the same segments: the forward's starts themselves; otherwise gathered or spliced anew, and the forward's gone
    assert stages.reused == (fwd_chunks == bwd_chunks)
    for name, x, w in zip(NAMES, got, want):
        if w is not None:
            assert rel_rms(x, w) < 1e-10, name


@pytest.mark.parametrize("seqlens,fwd_chunks,m", [([8192], 4, 4), ([5000, 64, 3000, 1, 700, 0], 6, 3),
                                                   ([192, 64, 256], 2, 2), ([0], 3, 3)])
def test_chain_index_tensors_follow_the_plans(seqlens, fwd_chunks, m):
    """``exact.chain_index_tensors`` against the two host plans walked sequence by sequence: forward segment j of
    sequence n chains the backward's segments m j .. m j + m - 1 of n (fewer at its end; an empty sequence is one
    empty segment on both plans)."""
    from flashgdn.cp.exact import chain_index_tensors

    cu = torch.tensor([0] + seqlens).cumsum(0)
    plan, fplan = split_sequences(seqlens, fwd_chunks // m), split_sequences(seqlens, fwd_chunks)
    index = segment_index_tensors(plan, cu)
    chains, jf = chain_index_tensors(index, segment_index_tensors(fplan, cu), m)
    want_jf, want_first, want_count = [], [], []
    for n in range(len(seqlens)):
        for j in range(int(fplan.count[n])):
            want_jf.append(j)
            want_first.append(int(plan.first[n]) + m * j)
            want_count.append(min(int(plan.count[n]) - m * j, m))
    assert jf.tolist() == want_jf and chains.first.tolist() == want_first and chains.count.tolist() == want_count
    assert min(want_count) >= 1
    assert chains.seg_cu is index.seg_cu and chains.seg_seq is index.seg_seq


@pytest.mark.parametrize("grad", [False, True])  # with autograd on, the pairs are not written in place
def test_starts_from_known_equal_the_whole_splice(grad):
    """``exact.starts_from_known``: the start states from another plan's equal the whole splice's, and with autograd
    on the transitions' pairs are left as they were."""
    from flashgdn.cp import cp_forward
    from flashgdn.cp.exact import KnownStarts, float_states, segment_starts

    (q, k, v, g, beta, do, dht, h0, cu), _ = _grads(1, 16, 16)
    seqlens = (cu[1:] - cu[:-1]).tolist()
    fplan, plan = split_sequences(seqlens, 4), split_sequences(seqlens, 1)
    fwd = _SkippingForwardWithOwnSplice()
    with torch.set_grad_enabled(grad):
        _, _, fstarts = cp_forward(ref_forward, q, k, v, g, beta, 0.3, h0, False, fplan, cu, keep_starts=True)
        index = segment_index_tensors(plan, cu)
        h = float_states(h0, q, v, len(seqlens))
        want, _, _ = segment_starts(fwd, q, k, v, g, beta, 0.3, h, plan, index, for_backward=True)
        known = KnownStarts(fplan, segment_index_tensors(fplan, cu), fstarts)
        got, _, pairs = segment_starts(fwd, q, k, v, g, beta, 0.3, h, plan, index, for_backward=True, known=known)
    assert rel_rms(got, want) < 1e-12
    if grad:  # b of a chain's first segment is rewritten in a copy only
        b = pairs[:, 0::2]
        fresh = segment_starts(fwd, q, k, v, g, beta, 0.3, h, plan, index, for_backward=True)[2][:, 0::2]
        assert torch.equal(b.isnan(), fresh.isnan()) and torch.equal(b.nan_to_num(), fresh.nan_to_num())


@pytest.mark.parametrize("own_splice", [False, True])
@pytest.mark.parametrize("K,V", [(16, 16), (16, 8)])  # V != K: no pairs to keep; the backward makes its own
@pytest.mark.parametrize("fwd_chunks,bwd_chunks", [(2, 2), (1, 1), (3, 3), (2, 1), (1, 2)])
@pytest.mark.parametrize("case", [1, 2, 3])
def test_cp_backward_on_the_forwards_transitions(case, fwd_chunks, bwd_chunks, K, V, own_splice):
    """``cp_forward(keep_transitions=True)``: the forward's pass makes the M of every segment but a sequence's first
    (the backward's ``for_backward`` items; the ones it may skip NaN), keeps its pairs, and a backward on the same
    segments takes them instead of a transition pass of its own: the same bits as the backward that runs its own,
    the reference's gradients. On other segments the pairs are not used (the backward's own pass runs)."""
    from flashgdn.cp import cp_forward

    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(case, K, V)
    seqlens = (cu[1:] - cu[:-1]).tolist()
    fplan, plan = split_sequences(seqlens, fwd_chunks), split_sequences(seqlens, bwd_chunks)
    kind = _SkippingForwardWithOwnSplice if own_splice else _SkippingPairedReferenceForward  # modes: one per pass
    got = {}
    with torch.no_grad():
        for keep in (False, True):
            fwd = kind()
            o, ht, fstarts, *pairs = cp_forward(fwd, q, k, v, g, beta, 0.3, h0, True, fplan, cu, keep_starts=True,
                                                keep_transitions=keep)
            passes_in_forward = list(fwd.modes)
            assert len(pairs) == keep
            if keep:
                assert (pairs[0] is None) == (not fplan.split or V != K)
                assert passes_in_forward == (["backward"] if fplan.split and V == K else [])
            else:
                assert passes_in_forward == (["forward"] if fplan.split and V == K else [])
            fwd.modes.clear()
            got[keep] = cp_backward(ReferenceBackwardStages(), fwd, q, k, v, g, beta, do, dht, 0.3, h0, plan, cu,
                                    cu, forward_starts=(fplan, fstarts, *pairs))
            reused = keep and fplan.split and V == K and fwd_chunks == bwd_chunks
            own_pass = plan.split and V == K and not reused
            assert len(fwd.modes) == own_pass, (keep, fwd.modes)
    for name, x, y, w in zip(NAMES, got[False], got[True], want):
        if w is not None:
            assert rel_rms(y, w) < 1e-10, name
            assert torch.equal(x, y), name


def test_handed_off_forward_transitions_are_released_before_step_4():
    """``StartsHandoff`` with the forward's pairs: the backward on the forward's segments takes them and lets them go
    after its reverse splice, before step 4; the gradients are the reference's."""
    from flashgdn.cp import cp_forward
    from flashgdn.cp.exact import StartsHandoff

    (q, k, v, g, beta, do, dht, h0, cu), want = _grads(1, 16, 16)
    seqlens = (cu[1:] - cu[:-1]).tolist()
    plan = split_sequences(seqlens, 2)
    with torch.no_grad():
        fwd = _SkippingPairedReferenceForward()
        _, _, fstarts, pairs = cp_forward(fwd, q, k, v, g, beta, 0.3, h0, True, plan, cu, keep_starts=True,
                                          keep_transitions=True)
        watched = weakref.ref(pairs)
        handoff = StartsHandoff(plan, fstarts, pairs)
        del pairs, fstarts
        fwd.modes.clear()

        class _PairsWatchingStages(ReferenceBackwardStages):
            checked = 0

            def chunk_states(self, *args, **kwargs):
                assert watched() is None, "the forward's pairs are still alive at step 4"
                _PairsWatchingStages.checked += 1
                return super().chunk_states(*args, **kwargs)

        got = cp_backward(_PairsWatchingStages(), fwd, q, k, v, g, beta, do, dht, 0.3, h0, plan, cu, cu,
                          forward_starts=handoff)
    assert _PairsWatchingStages.checked == 1 and fwd.modes == [] and handoff.take() is None
    for name, x, w in zip(NAMES, got, want):
        if w is not None:
            assert rel_rms(x, w) < 1e-10, name
