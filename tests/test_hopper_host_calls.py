"""The Hopper host code calls every kernel with what its compiled signature asks for (CPU, no GPU needed).

The kernels are compiled for sm_90a here (as in test_kernels_compile.py), then replaced by stand-ins that check
each call against the kernel's TileLang signature (argument count, dtype, rank, static sizes, one value per
dynamic size across all arguments, contiguity) and record it instead of running. The host code then runs on CPU
tensors end to end: a wrong argument order, dtype, layout or size fails here instead of on the GPU.
"""
import os
import shutil

import pytest
import torch

tilelang = pytest.importorskip("tilelang", reason="the Hopper kernels need TileLang (pip install -e .[hopper])")
if shutil.which("nvcc") is None:
    pytest.skip("nvcc is not on the PATH: TileLang cannot compile kernels here", allow_module_level=True)
os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")

from flashgdn.kernels.hopper.common import TORCH_TO_TL  # noqa: E402
from helpers import make_inputs  # noqa: E402


class SignatureCheck:
    """Stands in for a compiled kernel: checks a call against its prim_func's parameters, records the call."""

    def __init__(self, name, kernel, calls):
        self.name, self.kernel, self.calls = name, kernel, calls

    def __call__(self, *args):
        pf = self.kernel.prim_func
        assert len(args) == len(pf.params), f"{self.name}: {len(args)} arguments for {len(pf.params)} parameters"
        sizes = {}
        for a, p in zip(args, pf.params):
            where = f"{self.name}, argument {p.name}"
            if p not in pf.buffer_map:
                assert isinstance(a, (int, float)) and not isinstance(a, bool), f"{where}: a scalar, got {type(a)}"
                continue
            buf = pf.buffer_map[p]
            assert isinstance(a, torch.Tensor), f"{where}: a tensor, got {type(a)}"
            assert TORCH_TO_TL.get(a.dtype) == str(buf.dtype), f"{where}: dtype {a.dtype}, kernel wants {buf.dtype}"
            assert a.dim() == len(buf.shape), f"{where}: shape {tuple(a.shape)}, kernel wants {list(buf.shape)}"
            assert a.is_contiguous(), f"{where}: not contiguous"
            for size, dim in zip(a.shape, buf.shape):
                if hasattr(dim, "value"):
                    assert int(dim.value) == size, f"{where}: shape {tuple(a.shape)}, kernel wants {list(buf.shape)}"
                else:
                    bound = sizes.setdefault(str(dim), size)
                    assert bound == size, f"{where}: {dim} = {size} here, {bound} in an earlier argument"
        self.calls.append((self.name, sizes))
        if self.name == "segment_index":  # later host code indexes with its outputs: give them their values
            _fill_segment_index(*args)
        if self.name == "chain_index":  # the same, for the chains' index
            _fill_chain_index(*args)
        if self.name == "group_sum":  # its outputs are the gradients returned: their values, as the kernel's
            dq_v, dk_v, dq, dk = args
            dq.copy_(dq_v.float().sum(1))
            dk.copy_(dk_v.float().sum(1))


def _fill_segment_index(cu, step, seg_cu, seg_seq, first, count):
    """What ``segment_index.py`` writes: its PyTorch counterpart's values, for the sizes of this call."""
    from types import SimpleNamespace

    from flashgdn.cp.plan import segment_index_tensors
    from flashgdn.kernels.hopper.common import CHUNK

    plan = SimpleNamespace(first=first, num_segments=seg_seq.numel(), segment_chunks=step // CHUNK)
    index = segment_index_tensors(plan, cu)
    for out, value in ((seg_cu, index.seg_cu), (seg_seq, index.seg_seq), (first, index.first),
                       (count, index.count)):
        out.copy_(value)


def _fill_chain_index(known_seq, known_first, first, count, m, jf, chain_first, chain_count):
    """What ``segment_index.build_chain_index`` writes: ``chain_index_tensors``'s values."""
    from types import SimpleNamespace

    from flashgdn.cp.exact import chain_index_tensors

    chains, want_jf = chain_index_tensors(SimpleNamespace(seg_cu=None, seg_seq=None, first=first, count=count),
                                          SimpleNamespace(seg_seq=known_seq, first=known_first), m)
    for out, value in ((jf, want_jf), (chain_first, chains.first), (chain_count, chains.count)):
        out.copy_(value)


def _slot_counts(calls):
    """The chunk-slot counts S the calls were made with (every per-slot tensor's first size)."""
    return {sizes["num_slots"] for _, sizes in calls if "num_slots" in sizes}


def _chunks(seqlens):
    return sum((n + 63) // 64 for n in seqlens)


@pytest.fixture
def checked_kernels(monkeypatch):
    """Every kernel builder the host code uses, returning SignatureCheck stand-ins; yields the call log."""
    from flashgdn.kernels.hopper import (chunk_emits, chunk_forward_rs, chunk_forward_rso, chunk_grad, fused_backward,
                                         group_sum, kkt_inverse, segment_index, splice, state_grad_walk)

    calls = []
    for module, attr in ((chunk_emits, "build_chunk_emits"), (chunk_emits, "build_walk_covers"),
                         (kkt_inverse, "build_kkt_inverse"), (chunk_forward_rs, "build_chunk_forward_rs"),
                         (chunk_forward_rso, "build_chunk_forward_rso"), (state_grad_walk, "build_state_grad_walk"),
                         (chunk_grad, "build_chunk_grad"), (fused_backward, "build_fused_backward"),
                         (splice, "build_splice"), (segment_index, "build_segment_index"),
                         (segment_index, "build_chain_index"), (group_sum, "build_group_sum")):
        real = getattr(module, attr)

        def builder(*args, _real=real, _name=attr[len("build_"):], **kwargs):
            return SignatureCheck(_name, _real(*args, **kwargs), calls)

        monkeypatch.setattr(module, attr, builder)
    return calls


# 2/8 is the configuration test_kernels_compile.py compiles (no extra compile in one pytest run); 2/2 adds the
# configuration where each qk head has one value head (q and k gradients written in the io dtype)
@pytest.mark.parametrize("opts,heads,with_dht", [
    (dict(seqlens=[300, 1, 64], pad=7), (2, 8), True),
    (dict(seqlens=[128, 128], dense=True, state_v_first=True), (2, 8), True),
    (dict(seqlens=[200], initial_state=False), (2, 8), False),
    (dict(seqlens=[70, 5], pad=64), (2, 2), True),
])
@pytest.mark.parametrize("fused", [False, True])
def test_backward_calls_match_the_kernels(opts, heads, with_dht, fused, checked_kernels, monkeypatch):
    """The backward's kernel calls, with the walk and chunk_grad or with the fused kernel in their place
    (backward.FUSED_BACKWARD forced each way)."""
    from flashgdn.kernels.hopper import backward
    from flashgdn.kernels.hopper.backward import hopper_backward

    monkeypatch.setattr(backward, "FUSED_BACKWARD", fused)
    inp = make_inputs(Hqk=heads[0], Hv=heads[1], K=128, V=128, dtype=torch.bfloat16, **opts)
    q, k, v, g, beta, h0 = (inp.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state"))
    do = torch.randn(v.shape).to(torch.bfloat16)
    dht = torch.randn((len(opts["seqlens"]), heads[1], 128, 128)) if with_dht else None
    dq, dk, dv, dg, dbeta, dh0 = hopper_backward(q, k, v, g, beta, do, dht, 0.1, h0, inp.get("cu_seqlens"),
                                                 opts.get("state_v_first", False))
    # and dq, dk summed over each qk head's value heads when it has more than one
    sums = ["group_sum"] if heads[1] > heads[0] else []
    walk = ["fused_backward"] if fused else ["state_grad_walk", "chunk_grad"]
    assert [c[0] for c in checked_kernels] == ["kkt_inverse", "chunk_forward_rs"] + walk + sums
    for x, ref in ((dq, q), (dk, k), (dv, v)):
        assert x.shape == ref.shape and x.dtype == ref.dtype
    assert dg.shape == g.shape and dbeta.shape == beta.shape
    assert (dh0 is None) == (h0 is None)
    if h0 is not None:
        assert dh0.shape == h0.shape and dh0.dtype == torch.float32
    if inp.get("cu_seqlens") is not None:
        end = int(inp["cu_seqlens"][-1])
        assert all((x[:, end:] == 0).all() for x in (dq, dk, dv, dg, dbeta)), "the padded tail's gradients are 0"
    # dense input: exactly one slot per chunk (the host knows the offsets); varlen without a host copy: the bound
    seqlens = opts["seqlens"]
    T = q.shape[0] * q.shape[1]
    bound = (T + 63 * len(seqlens) + 63) // 64
    S = _chunks(seqlens) if opts.get("dense") else bound
    assert _slot_counts(checked_kernels) == {S}
    # the chunk states: every slot for chunk_grad; for the fused kernel (backward.FIRST_STATES_APART) all but each
    # sequence's first where the host knows that none is empty (dense input), else the slots' numbering
    states = {sizes.get("num_states", sizes.get("n_ht")) for name, sizes in checked_kernels
              if name in ("chunk_forward_rs", "fused_backward")}
    apart = fused and backward.FIRST_STATES_APART
    assert states == {S - len(seqlens) if apart and opts.get("dense") else S}


def test_fused_backward_longest_first_gets_the_order(checked_kernels, monkeypatch):
    """FLASHGDN_HOPPER_FUSED_LONGEST_FIRST: the fused kernel's build with ``longest_first`` gets the sequences' order,
    longest first, as its last argument (checked against the build's signature)."""
    from flashgdn.kernels.hopper import backward, fused_backward
    from flashgdn.kernels.hopper.backward import hopper_backward

    monkeypatch.setattr(backward, "FUSED_BACKWARD", True)
    monkeypatch.setattr(backward, "FUSED_LONGEST_FIRST", True)
    orders = []
    real = fused_backward.build_fused_backward  # the fixture's stand-in

    def capture(*a, **kw):
        inner = real(*a, **kw)

        def call(*args):
            orders.append((kw.get("longest_first"), args[-1]))
            return inner(*args)
        return call

    monkeypatch.setattr(fused_backward, "build_fused_backward", capture)
    seqlens = [300, 1, 640, 64]
    inp = make_inputs(Hqk=2, Hv=8, K=128, V=128, dtype=torch.bfloat16, seqlens=seqlens)
    q, k, v, g, beta, h0 = (inp.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state"))
    do = torch.randn(v.shape).to(torch.bfloat16)
    hopper_backward(q, k, v, g, beta, do, None, 0.1, h0, inp["cu_seqlens"], False,
                    cu_seqlens_cpu=inp["cu_seqlens"].clone())
    ((on, order),) = orders
    assert on is True and order.dtype == torch.int32 and order.tolist() == [2, 0, 3, 1]
    assert [c[0] for c in checked_kernels if c[0] == "fused_backward"] == ["fused_backward"]


@pytest.mark.parametrize("split", [False, True])
def test_fused_backward_ag_from_a_lets_stage1s_ag_go_first(split, checked_kernels, monkeypatch):
    """FLASHGDN_HOPPER_FUSED_AG_FROM_A: the fused kernel's build with ``ag_from_a`` gets A in both inverse arguments,
    and stage 1's Ag tensor (made by ``kkt_inverse`` with A, read by the states pass and, with CP, the walks) no
    longer exists when the kernel's outputs are allocated: the memory the option is for."""
    import gc
    import weakref

    from flashgdn.cp import split_sequences
    from flashgdn.kernels.hopper import backend, backward, fused_backward, kkt_inverse
    from flashgdn.kernels.hopper.backward import hopper_backward

    monkeypatch.setattr(backward, "FUSED_BACKWARD", True)
    monkeypatch.setattr(backward, "FUSED_AG_FROM_A", True)
    monkeypatch.setattr(backend, "CP_PAIRED", True)  # the 2/8 kernels test_kernels_compile.py has compiled
    ags, seen = [], []
    stage1, fused = kkt_inverse.build_kkt_inverse, fused_backward.build_fused_backward  # the fixture's stand-ins

    def stage1_capture(*a, **kw):
        inner = stage1(*a, **kw)

        def call(*args):
            if kw.get("store_inverse"):  # the backward's stage 1: its Ag (k, g, beta, bounds, gcum, Ag, A, ...)
                ags.append(weakref.ref(args[5]))
            return inner(*args)
        return call

    def fused_capture(*a, **kw):
        inner = fused(*a, **kw)

        def call(*args):
            gc.collect()
            seen.append((kw.get("ag_from_a"), args[6] is args[7], [ref() is None for ref in ags]))
            return inner(*args)
        return call

    monkeypatch.setattr(kkt_inverse, "build_kkt_inverse", stage1_capture)
    monkeypatch.setattr(fused_backward, "build_fused_backward", fused_capture)
    seqlens = [700, 30, 300]
    inp = make_inputs(Hqk=2, Hv=8, K=128, V=128, dtype=torch.bfloat16, seqlens=seqlens)
    q, k, v, g, beta, h0, cu = (inp.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    plan = split_sequences(seqlens, 4) if split else None
    do = torch.randn(v.shape).to(torch.bfloat16)
    hopper_backward(q, k, v, g, beta, do, torch.randn((3, 8, 128, 128)), 0.1, h0, cu, False, plan, cu.clone(),
                    fused=True)
    assert len(ags) == 1, "one stage 1 with A"
    assert seen == [(True, True, [True])]
    names = [c[0] for c in checked_kernels]
    assert names.index("kkt_inverse") < names.index("chunk_forward_rs") < names.index("fused_backward")
    if split:
        assert "state_grad_walk" in names[:names.index("fused_backward")]


@pytest.mark.parametrize("seqlens,host_copy,expected", [
    ([300, 1, 64], True, 7 - 3),   # every sequence known non-empty: S - N states
    ([300, 0, 64], True, 6),       # an empty sequence: the slots' own numbering
    ([300, 1, 64], False, None),   # no host copy: the slots' bound, numbered as the slots
    ([64, 64], True, 1),           # one chunk each: no state but the first ones (one row for the tensor map)
])
def test_fused_backward_takes_first_states_from_the_d_initial_state_buffer(seqlens, host_copy, expected,
                                                                          checked_kernels, monkeypatch):
    """backward.FIRST_STATES_APART: the states pass writes each sequence's first chunk state into the fused
    kernel's dh0 buffer (seen as 2-byte values), the fused kernel reads it there, and the states tensor has S - N
    slots only where the host copy of the offsets shows no empty sequence (``shift`` 1)."""
    from flashgdn.kernels.hopper import backward, fused_backward
    from flashgdn.kernels.hopper.backward import hopper_backward

    monkeypatch.setattr(backward, "FUSED_BACKWARD", True)
    monkeypatch.setattr(backward, "FIRST_STATES_APART", True)
    seen = []
    stand_in = fused_backward.build_fused_backward

    def capture(*a, **kw):
        check = stand_in(*a, **kw)

        def call(*args):
            seen.append((kw, args))
            return check(*args)
        return call

    monkeypatch.setattr(fused_backward, "build_fused_backward", capture)
    inp = make_inputs(Hqk=2, Hv=8, K=128, V=128, dtype=torch.bfloat16, seqlens=seqlens, pad=5)
    q, k, v, g, beta, h0 = (inp.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state"))
    do = torch.randn(v.shape).to(torch.bfloat16)
    cu = inp["cu_seqlens"]
    _, _, _, _, _, dh0 = hopper_backward(q, k, v, g, beta, do, None, 0.1, h0, cu, False,
                                         cu_seqlens_cpu=cu.clone() if host_copy else None)
    (kw, args), = seen
    assert kw.get("first_apart") is True
    states, dh0_buf, first_states, shift = args[10], args[18], args[19], args[20]
    T = q.shape[1]
    S = _chunks(seqlens) if host_copy else (T + 63 * len(seqlens) + 63) // 64
    assert states.shape[0] == (expected if expected is not None else S)
    assert shift == (1 if expected is not None and 0 not in seqlens else 0)
    # the first states live in dh0's memory: the same bytes, seen as [N, Hv, 2 V, K] bf16
    assert first_states.data_ptr() == dh0_buf.data_ptr() and first_states.shape == (len(seqlens), 8, 256, 128)
    assert dh0_buf.dtype == torch.float32 and dh0_buf.shape == (len(seqlens), 8, 128, 128)
    rs = [sizes for name, sizes in checked_kernels if name == "chunk_forward_rs"]
    assert len(rs) == 1 and rs[0]["n_ht"] == states.shape[0]


@pytest.mark.parametrize("starts_in_kernel", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("output_final_state", [True, False])
def test_paired_cp_forward_calls_match_the_kernels(output_final_state, fused, starts_in_kernel, checked_kernels,
                                                    monkeypatch):
    """Context parallelism's paired transition pass (stage 1 run once, shared with the forward over the
    segments; FLASHGDN_HOPPER_CP_PAIRED) and the forward after it, with the segment index and the splice in torch
    or by their kernels (FLASHGDN_HOPPER_CP_FUSED); the pass's start states read, or made by it from the sequences'
    initial states (FLASHGDN_HOPPER_CP_STARTS_IN_KERNEL)."""
    from flashgdn.api.validate import validate
    from flashgdn.cp import plan_for_problem
    from flashgdn.cp.exact import cp_problem_forward
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.backend import _HopperSegmentsForward

    monkeypatch.setattr(backend, "CP_STARTS_IN_KERNEL", starts_in_kernel)

    inp = make_inputs(Hqk=2, Hv=8, K=128, V=128, dtype=torch.bfloat16, seqlens=[700, 30, 300], pad=5)
    inp["cu_seqlens_cpu"] = inp["cu_seqlens"].clone()
    p = validate(**inp, output_final_state=output_final_state, cp=4)
    plan = plan_for_problem(p, auto=True)
    assert plan is not None and plan.split
    o, final = cp_problem_forward(_HopperSegmentsForward(paired=True, fused=fused), p, plan, p.q, p.k)
    names = [c[0] for c in checked_kernels]
    # stage 1 once, then the two loops (the paired state-only pass, the default loop with its output), the splice
    # between them
    assert names == (["segment_index"] * fused + ["kkt_inverse", "chunk_forward_rs"] + ["splice"] * fused
                     + ["chunk_forward_rso"])
    assert all(sizes["num_seqs"] == plan.num_segments for name, sizes in checked_kernels
               if name.startswith("chunk_forward"))
    # the pass's first states: one per segment and pair head, or the sequences' initial states
    assert [sizes["n_h0"] for name, sizes in checked_kernels if name == "chunk_forward_rs"] == \
        [3 if starts_in_kernel else plan.num_segments]
    # one slot per chunk, counted from the segments' host offsets (the bound would add 63 tokens per segment)
    assert _slot_counts(checked_kernels) == {_chunks([700, 30, 300])}
    assert o.shape == p.v.shape
    assert (final is None) != output_final_state


def _cp_forward_seeing_pairs(monkeypatch, record):
    """The Hopper CP forward (paired, fused, starts made in the kernel) on a 2/8 varlen mix with mixed gates, cp=4,
    its calls of ``forward.hopper_transition_pairs`` passed through ``record(args, kwargs)``:
    ``(problem, plan, records)``."""
    from flashgdn.api.validate import validate
    from flashgdn.cp import plan_for_problem
    from flashgdn.cp.exact import cp_problem_forward
    from flashgdn.kernels.hopper import backend, forward
    from flashgdn.kernels.hopper.backend import _HopperSegmentsForward

    monkeypatch.setattr(backend, "CP_STARTS_IN_KERNEL", True)
    seen = []
    real = forward.hopper_transition_pairs

    def pairs(*args, **kwargs):
        seen.append(record(args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(forward, "hopper_transition_pairs", pairs)
    inp = make_inputs(Hqk=2, Hv=8, K=128, V=128, dtype=torch.bfloat16, seqlens=[700, 30, 300], pad=5, gate="mixed")
    inp["cu_seqlens_cpu"] = inp["cu_seqlens"].clone()
    p = validate(**inp, output_final_state=True, cp=4)
    plan = plan_for_problem(p, auto=True)
    cp_problem_forward(_HopperSegmentsForward(paired=True, fused=True), p, plan, p.q, p.k)
    return p, plan, seen


def test_negligible_m_gives_the_transition_pass_its_bounds(checked_kernels, monkeypatch):
    """FLASHGDN_HOPPER_CP_NEGLIGIBLE_M: the paired pass that makes its start states gets the bounds as its last
    argument ([segments, Hv] float32, checked against the build's signature), the ones ``flashgdn.cp.bounds`` makes
    for the segments it runs on."""
    from flashgdn.cp.bounds import transition_log_bounds
    from flashgdn.kernels.hopper import backend

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", False)  # (the kernels' own bound takes precedence)
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M", True)
    p, plan, seen = _cp_forward_seeing_pairs(monkeypatch, lambda args, kwargs: (args[5].clone(), kwargs.get("m_bound")))
    assert [c[0] for c in checked_kernels] == ["segment_index", "kkt_inverse", "chunk_forward_rs", "splice",
                                               "chunk_forward_rso"]
    ((seg_cu, m_bound),) = seen
    assert m_bound is not None and m_bound.shape == (plan.num_segments, 8) and m_bound.dtype == torch.float32
    T = p.q.shape[1]
    assert torch.equal(m_bound, transition_log_bounds(p.k.reshape(1, T, 2, 128), p.g.reshape(1, T, 8),
                                                      p.beta.reshape(1, T, 8), seg_cu))


def test_negligible_m_in_kernel_gives_the_pass_stage1s_chunk_bounds(checked_kernels, monkeypatch):
    """FLASHGDN_HOPPER_CP_NEGLIGIBLE_M_IN_KERNEL: stage 1 is the build that writes each chunk's bound and the paired
    pass that makes its start states takes those bounds as its last argument ([Hv, S] float32, both checked against
    the builds' signatures); no bound is made by PyTorch ops."""
    from flashgdn.cp import bounds
    from flashgdn.kernels.hopper import backend

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", True)
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M", True)  # taken over by the kernels' bounds

    def no_bounds(*args, **kwargs):
        raise AssertionError("a bound made by PyTorch ops")

    monkeypatch.setattr(bounds, "transition_log_bounds", no_bounds)
    from flashgdn.kernels.hopper import forward

    flags_seen, m_zero_of = [], forward.m_zero_of
    monkeypatch.setattr(forward, "m_zero_of", lambda pairs: flags_seen.append(m_zero_of(pairs)) or flags_seen[-1])
    _, _, seen = _cp_forward_seeing_pairs(monkeypatch, lambda args, kwargs: (
        args[3], kwargs.get("chunk_bound"), kwargs.get("m_bound"), kwargs.get("b_start")))
    assert [c[0] for c in checked_kernels] == ["segment_index", "kkt_inverse", "chunk_forward_rs", "splice",
                                               "chunk_forward_rso"]
    ((stage1, chunk_bound, m_bound, b_start),) = seen
    assert m_bound is None and b_start is None
    assert chunk_bound is stage1.chunk_bound
    assert chunk_bound.shape == (8, stage1.Ag.shape[0]) and chunk_bound.dtype == torch.float32
    # the pass's flags of the M it stored as zero reach the splice (its m_zero build: the signature checked above)
    ((flags,),) = [flags_seen]
    assert flags is not None and flags.dtype == torch.int32 and flags.shape == (checked_kernels[2][1]["num_seqs"], 8)


@pytest.mark.parametrize("min_chunks", [0, 128])
def test_late_b_in_kernel_gives_the_pass_stage1s_injections(min_chunks, checked_kernels, monkeypatch):
    """FLASHGDN_HOPPER_CP_LATE_B_IN_KERNEL (with CP_NEGLIGIBLE_M_IN_KERNEL): stage 1 is the build that reads v and
    writes each chunk's injection, and the paired pass takes them with the initial states' log norms as its last two
    arguments ([Hv, S] and [sequences, Hv] float32, both checked against the builds' signatures). Segments shorter
    than CP_LATE_B_MIN_CHUNKS (these are a few chunks) take the builds without them."""
    from flashgdn.kernels.hopper import backend

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", True)
    monkeypatch.setattr(backend, "CP_LATE_B_IN_KERNEL", True)
    monkeypatch.setattr(backend, "CP_LATE_B_MIN_CHUNKS", min_chunks)
    _, _, seen = _cp_forward_seeing_pairs(monkeypatch, lambda args, kwargs: (
        args[3], kwargs.get("chunk_bound"), kwargs.get("chunk_inject"), kwargs.get("h0_log_norm"), kwargs.get("h0")))
    assert [c[0] for c in checked_kernels] == ["segment_index", "kkt_inverse", "chunk_forward_rs", "splice",
                                               "chunk_forward_rso"]
    ((stage1, chunk_bound, chunk_inject, h0_log_norm, h0),) = seen
    assert chunk_bound is stage1.chunk_bound is not None
    if min_chunks:
        assert chunk_inject is None and h0_log_norm is None and stage1.chunk_inject is None
        return
    assert chunk_inject is stage1.chunk_inject
    assert chunk_inject.shape == (8, stage1.Ag.shape[0]) and chunk_inject.dtype == torch.float32
    assert torch.equal(h0_log_norm, torch.linalg.vector_norm(h0.float(), dim=(-2, -1)).log())


def test_late_b_in_kernel_takes_segments_of_its_shortest_length_on():
    """``backend._late_b_in_kernel``: from the host's offsets, the longest segment CP_LATE_B_MIN_CHUNKS chunks or
    more (its last chunk may be partial); none without the offsets, every length at 0, none with the switch off."""
    from flashgdn.kernels.hopper import backend

    assert backend.CP_LATE_B_MIN_CHUNKS == 128
    short = torch.tensor([0, 127 * 64, 2 * 127 * 64])
    long = torch.tensor([0, 100, 127 * 64 + 101])  # a 127-chunk segment and one token
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "CP_LATE_B_IN_KERNEL", True)
        assert not backend._late_b_in_kernel(short) and backend._late_b_in_kernel(long)
        assert not backend._late_b_in_kernel(None) and not backend._late_b_in_kernel(torch.tensor([0]))
        mp.setattr(backend, "CP_LATE_B_MIN_CHUNKS", 0)
        assert backend._late_b_in_kernel(short) and backend._late_b_in_kernel(None)
        mp.setattr(backend, "CP_LATE_B_IN_KERNEL", False)
        assert not backend._late_b_in_kernel(long)


def test_late_b_gives_the_transition_pass_its_starts(checked_kernels, monkeypatch):
    """FLASHGDN_HOPPER_CP_LATE_B (beside CP_NEGLIGIBLE_M): the paired pass gets the chunks each b item leaves out as
    its last argument ([segments, Hv] int32, checked against the late_b build's signature), the ones
    ``flashgdn.cp.bounds.b_start_chunks`` makes for its segments, the sequences' initial states and the chunk count
    the host's offsets give."""
    from flashgdn.api.validate import validate
    from flashgdn.cp import plan_for_problem
    from flashgdn.cp.bounds import b_start_chunks
    from flashgdn.cp.exact import cp_problem_forward, segment_indices
    from flashgdn.kernels.hopper import backend, forward
    from flashgdn.kernels.hopper.backend import _HopperSegmentsForward

    monkeypatch.setattr(backend, "CP_STARTS_IN_KERNEL", True)
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", False)  # (the kernels' own bound takes precedence)
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M", True)
    monkeypatch.setattr(backend, "CP_LATE_B", True)
    seen = []
    real = forward.hopper_transition_pairs

    def pairs(*args, **kwargs):
        seen.append((args[5].clone(), kwargs.get("h0").clone(), kwargs.get("b_start")))
        return real(*args, **kwargs)

    monkeypatch.setattr(forward, "hopper_transition_pairs", pairs)
    inp = make_inputs(Hqk=2, Hv=8, K=128, V=128, dtype=torch.bfloat16, seqlens=[700, 30, 300], pad=5, gate="strong")
    inp["cu_seqlens_cpu"] = inp["cu_seqlens"].clone()
    p = validate(**inp, output_final_state=True, cp=4)
    plan = plan_for_problem(p, auto=True)
    forward_ = _HopperSegmentsForward(paired=True, fused=True)
    cp_problem_forward(forward_, p, plan, p.q, p.k)
    assert [c[0] for c in checked_kernels] == ["segment_index", "kkt_inverse", "chunk_forward_rs", "splice",
                                               "chunk_forward_rso"]
    ((seg_cu, h0, b_start),) = seen
    assert b_start is not None and b_start.shape == (plan.num_segments, 8) and b_start.dtype == torch.int32
    T = p.q.shape[1]
    index = segment_indices(forward_, plan, p.cu_seqlens)
    chunks = sum((n + 63) // 64 for n in (plan.seg_cu[1:] - plan.seg_cu[:-1]).tolist())
    want = b_start_chunks(p.k.reshape(1, T, 2, 128), p.v.reshape(1, T, 8, 128), p.g.reshape(1, T, 8),
                          p.beta.reshape(1, T, 8), seg_cu, chunks, h0=h0, seg_seq=index.seg_seq, first=index.first)
    assert torch.equal(b_start, want)


@pytest.mark.parametrize("fused,starts_in_kernel", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("with_h0", [True, False])
def test_backward_with_context_parallelism_calls_match_the_kernels(with_h0, fused, starts_in_kernel, checked_kernels,
                                                                   monkeypatch):
    """The backward on the forward's segments (``cp.cp_backward``): stage 1 once (with A) for the paired transition
    pass and every stage after it, the walk from zero, then the stages from the spliced states and gradients; the
    segment index and the splices in torch or by their kernels (FLASHGDN_HOPPER_CP_FUSED); the transition pass's
    start states made by it (FLASHGDN_HOPPER_CP_STARTS_IN_KERNEL)."""
    from flashgdn.cp import split_sequences
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.backward import hopper_backward

    monkeypatch.setattr(backend, "CP_PAIRED", True)  # the 2/8 kernels test_kernels_compile.py has compiled
    monkeypatch.setattr(backend, "CP_FUSED", fused)
    monkeypatch.setattr(backend, "CP_STARTS_IN_KERNEL", starts_in_kernel)
    seqlens = [700, 30, 300]
    inp = make_inputs(Hqk=2, Hv=8, K=128, V=128, dtype=torch.bfloat16, seqlens=seqlens, pad=5,
                      initial_state=with_h0)
    q, k, v, g, beta, h0, cu = (inp.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    plan = split_sequences(seqlens, 4)
    assert plan.split
    do = torch.randn(v.shape).to(torch.bfloat16)
    dht = torch.randn((3, 8, 128, 128))
    grads = hopper_backward(q, k, v, g, beta, do, dht, 0.1, h0, cu, False, plan, cu.clone())
    names = [c[0] for c in checked_kernels]
    splices = ["splice"] if fused else []
    assert names == (["segment_index"] * fused  # the plan's index tensors
                     + ["kkt_inverse", "chunk_forward_rs"]  # stage 1 with A on the segments, the paired pass
                     + splices  # the segments' start states
                     + ["state_grad_walk"]  # the walk from zero, on the same stage 1
                     + splices  # the segments' end gradients
                     + ["chunk_forward_rs", "state_grad_walk", "chunk_grad", "group_sum"])
    for name, sizes in checked_kernels:  # the loops run on segments; the splice on sequences, writing segments
        if name == "group_sum":  # over every token of the packed input, per qk head
            assert sizes["rows"] == q.shape[1] * 2
        elif name in ("splice", "segment_index"):
            assert sizes["num_seqs"] == len(seqlens) and sizes["num_segments"] == plan.num_segments
        else:
            assert sizes.get("num_seqs", plan.num_segments) == plan.num_segments, name
    transition = [sizes for name, sizes in checked_kernels if name == "chunk_forward_rs"][0]
    assert transition["n_h0"] == (len(seqlens) if starts_in_kernel else plan.num_segments)
    assert _slot_counts(checked_kernels) == {_chunks(seqlens)}  # from the segments' host offsets
    assert grads[0].shape == q.shape and (grads[5] is None) == (h0 is None)


def _walk_calls(monkeypatch):
    """The walk's builder (the fixture's signature-checking one) wrapped to record each call's build options and
    arguments, and a CP backward of 2/8 heads on 700, 30 and 300 tokens of strong gates cut into 4-chunk segments:
    ``(calls, run, inputs, plan)``, ``run()`` running that backward."""
    from flashgdn.cp import split_sequences
    from flashgdn.kernels.hopper import state_grad_walk
    from flashgdn.kernels.hopper.backward import hopper_backward

    calls = []
    checked = state_grad_walk.build_state_grad_walk

    def recording(*args, **kwargs):
        kernel = checked(*args, **kwargs)

        def call(*cargs):
            calls.append((kwargs, cargs))
            return kernel(*cargs)
        return call

    monkeypatch.setattr(state_grad_walk, "build_state_grad_walk", recording)
    seqlens = [700, 30, 300]
    inp = make_inputs(Hqk=2, Hv=8, K=128, V=128, dtype=torch.bfloat16, seqlens=seqlens, gate="strong")
    q, k, v, g, beta, h0, cu = (inp.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    plan = split_sequences(seqlens, 4)
    do = torch.randn(v.shape).to(torch.bfloat16)

    def run():
        hopper_backward(q, k, v, g, beta, do, torch.randn((3, 8, 128, 128)), 0.1, h0, cu, False, plan, cu.clone())

    return calls, run, inp, plan


def test_walks_from_zero_stop_where_the_bound_says(checked_kernels, monkeypatch):
    """FLASHGDN_HOPPER_WALK_EARLY_STOP (beside WALK_STARTS_ONLY): CP's walk from zero is the starts-only build with
    ``early_stop``, whose last argument (checked against its signature) is ``flashgdn.cp.bounds.walk_stop_chunks`` of
    the segments, the inputs the walk reads and the chunk count the host's offsets give."""
    from flashgdn.cp.bounds import walk_stop_chunks
    from flashgdn.kernels.hopper import backward

    monkeypatch.setattr(backward, "WALK_STARTS_ONLY", True)
    monkeypatch.setattr(backward, "WALK_EARLY_STOP", True)
    monkeypatch.setattr(backward, "FUSED_BACKWARD", True)
    calls, run, inp, plan = _walk_calls(monkeypatch)
    g, beta = inp["g"], inp["beta"]
    run()
    ((kwargs, args),) = calls
    assert kwargs["starts_only"] and kwargs["early_stop"]
    qf, kf, dof, seg_cu, walk_chunks = args[0], args[1], args[2], args[5], args[-1]
    assert walk_chunks.shape == (plan.num_segments, 8) and walk_chunks.dtype == torch.int32
    chunks = sum((n + 63) // 64 for n in (plan.seg_cu[1:] - plan.seg_cu[:-1]).tolist())
    want = walk_stop_chunks(qf, kf, g, beta, dof, 0.1, seg_cu, chunks)
    assert torch.equal(walk_chunks, want)
    assert (want < torch.tensor([-(-int(n) // 64) for n in (plan.seg_cu[1:] - plan.seg_cu[:-1])])[:, None]).any()


def test_walks_from_zero_stop_where_the_emission_pass_says(checked_kernels, monkeypatch):
    """FLASHGDN_HOPPER_WALK_STOP_IN_KERNEL (beside WALK_STARTS_ONLY and the kernels' chunk bounds; its gate at 0): on
    the walks' path the emission pass, then the covers, then the walk's ``early_stop`` build, each called as its
    signature asks (the covers' output the walk's last argument); the PyTorch bound (WALK_EARLY_STOP) is not made.
    With the gate above the segments' length, none of the three."""
    from flashgdn.cp import bounds
    from flashgdn.kernels.hopper import backend, backward

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", True)
    monkeypatch.setattr(backward, "WALK_STARTS_ONLY", True)
    monkeypatch.setattr(backward, "WALK_EARLY_STOP", False)
    monkeypatch.setattr(backward, "WALK_STOP_IN_KERNEL", True)
    monkeypatch.setattr(backward, "FUSED_BACKWARD", True)

    def not_made(*args, **kwargs):
        raise AssertionError("the PyTorch bound over dO (WALK_EARLY_STOP's) is made")

    monkeypatch.setattr(bounds, "walk_stop_chunks", not_made)
    monkeypatch.setattr(bounds, "segment_walk_stops", not_made)
    walks, run, _, plan = _walk_calls(monkeypatch)
    for min_chunks, on in ((0, True), (5, False)):
        walks.clear()
        del checked_kernels[:]
        monkeypatch.setattr(backward, "WALK_STOP_MIN_CHUNKS", min_chunks)
        run()
        names = [name for name, _ in checked_kernels]
        ((kwargs, args),) = walks
        assert kwargs["starts_only"] and kwargs.get("early_stop", False) is on
        if not on:
            assert "chunk_emits" not in names and "walk_covers" not in names
            continue
        assert names.index("chunk_emits") < names.index("walk_covers") < names.index("state_grad_walk")
        covers = [sizes for name, sizes in checked_kernels if name == "walk_covers"][0]
        assert covers["num_seqs"] == plan.num_segments
        assert args[-1].shape == (plan.num_segments, 8) and args[-1].dtype == torch.int32


@pytest.mark.parametrize("precise", [False, True])
@pytest.mark.parametrize("starts_only", [False, True])
def test_walks_from_zero_follow_walk_starts_only(starts_only, precise, checked_kernels, monkeypatch):
    """FLASHGDN_HOPPER_WALK_STARTS_ONLY: CP's walk from zero is the walk's ``starts_only`` build (no ``ds_end``
    argument: checked against its signature), in the precise mode too; the walk from the true end gradients (step 4)
    keeps its stores. Off, no build has ``starts_only``."""
    from flashgdn.cp import split_sequences
    from flashgdn.kernels.hopper import backward, forward, state_grad_walk
    from flashgdn.kernels.hopper.backward import hopper_backward

    monkeypatch.setattr(backward, "WALK_STARTS_ONLY", starts_only)
    monkeypatch.setattr(backward, "FUSED_BACKWARD", False)  # so that step 4 runs the walk too
    monkeypatch.setattr(forward, "PRECISE", precise)
    built = []
    checked = state_grad_walk.build_state_grad_walk  # the fixture's signature-checking builder

    def recording(*args, **kwargs):
        built.append((args[5], kwargs.get("starts_only", False), kwargs["precise"]))
        return checked(*args, **kwargs)

    monkeypatch.setattr(state_grad_walk, "build_state_grad_walk", recording)
    seqlens = [700, 30, 300]
    inp = make_inputs(Hqk=2, Hv=8, K=128, V=128, dtype=torch.bfloat16, seqlens=seqlens)
    q, k, v, g, beta, h0, cu = (inp.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    plan = split_sequences(seqlens, 4)
    do = torch.randn(v.shape).to(torch.bfloat16)
    hopper_backward(q, k, v, g, beta, do, torch.randn((3, 8, 128, 128)), 0.1, h0, cu, False, plan, cu.clone())
    # (has_final_grad, starts_only, precise): the walk from zero, then step 4's from the spliced end gradients
    assert built == [(False, starts_only, precise), (True, False, precise)]
    walks = [sizes for name, sizes in checked_kernels if name == "state_grad_walk"]
    assert len(walks) == 2 and all(w["num_seqs"] == plan.num_segments for w in walks)


def test_precise_mode_reaches_every_loop_of_the_backward(checked_kernels, monkeypatch):
    """The precise mode (forward.PRECISE, FLASHGDN_HOPPER_PRECISE=1) also puts the backward's loops in theirs: with
    CP, the forward transitions, the walk from zero, the states pass and the walk are all built with
    ``precise=True`` (what exact CP at g = 0 needs, docs/context-parallel.md); float16 inputs are refused before
    any kernel is built."""
    from flashgdn.cp import split_sequences
    from flashgdn.kernels.hopper import chunk_forward_rs, forward, state_grad_walk
    from flashgdn.kernels.hopper.backward import hopper_backward

    monkeypatch.setattr(forward, "PRECISE", True)
    built = []
    for module, attr in ((chunk_forward_rs, "build_chunk_forward_rs"), (state_grad_walk, "build_state_grad_walk")):
        checked = getattr(module, attr)  # the fixture's signature-checking builder

        def recording(*args, _checked=checked, _name=attr, **kwargs):
            built.append((_name, args, kwargs))
            return _checked(*args, **kwargs)

        monkeypatch.setattr(module, attr, recording)
    seqlens = [700, 30, 300]
    inp = make_inputs(Hqk=2, Hv=8, K=128, V=128, dtype=torch.bfloat16, seqlens=seqlens, zero_gate_heads=(0, 1))
    q, k, v, g, beta, h0, cu = (inp.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    plan = split_sequences(seqlens, 4)
    do = torch.randn(v.shape).to(torch.bfloat16)
    hopper_backward(q, k, v, g, beta, do, torch.randn((3, 8, 128, 128)), 0.1, h0, cu, False, plan, cu.clone())
    names = [c[0] for c in checked_kernels]
    assert names.count("state_grad_walk") == 2 and names.count("chunk_forward_rs") >= 2, names
    assert len(built) == names.count("state_grad_walk") + names.count("chunk_forward_rs")
    for name, args, kwargs in built:
        # build_chunk_forward_rs(Hqk, Hv, K, V, io_dtype, has_h0, store_final, state_v_first, with_output, precise)
        precise = kwargs["precise"] if "precise" in kwargs else (args[9] if name.endswith("rs") else None)
        assert precise is True, (name, args, kwargs)

    checked_kernels.clear()
    with pytest.raises(NotImplementedError, match="bfloat16"):
        hopper_backward(q.half(), k.half(), v.half(), g, beta, do.half(), None, 0.1, h0, cu, False, plan, cu.clone())
    assert checked_kernels == []


def test_pair_sums_call_matches_the_kernel(checked_kernels, monkeypatch):
    """With pair sums (backward.CHUNK_GRAD_PAIR_SUMS) and two value heads per qk head, chunk_grad writes dq and dk
    per qk head into zeroed outputs (the kernel adds into them), and they come back without a group sum; other
    groups keep the per-value-head outputs."""
    from flashgdn.kernels.hopper import backward

    monkeypatch.setattr(backward, "CHUNK_GRAD_PAIR_SUMS", True)
    seen = []
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):
        out = real_zeros(*args, **kwargs)
        seen.append(tuple(out.shape))
        return out

    monkeypatch.setattr(backward.torch, "zeros", zeros)
    for heads in ((2, 4), (2, 8)):
        inp = make_inputs(Hqk=heads[0], Hv=heads[1], K=128, V=128, dtype=torch.bfloat16, seqlens=[300, 70])
        q, k, v, g, beta, h0 = (inp.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state"))
        do = torch.randn(v.shape).to(torch.bfloat16)
        seen.clear()
        cu = inp["cu_seqlens"]
        dq, dk, *_ = backward.hopper_backward(q, k, v, g, beta, do, None, 0.1, h0, cu, False, None, cu.clone())
        assert dq.shape == q.shape and dk.shape == k.shape
        T = q.shape[1]
        per_qk = (1, T, heads[0], 128)
        summed = [c[0] for c in checked_kernels].count("group_sum")
        checked_kernels.clear()
        if heads[1] == 2 * heads[0]:
            assert seen.count(per_qk) == 2, seen  # dq and dk, zeroed for the atomics
            assert summed == 0
        else:
            assert per_qk not in seen, seen
            assert summed == 1


def test_fused_pair_sums_call_matches_the_kernel(checked_kernels, monkeypatch):
    """With the fused kernel's pair sums (backward.FUSED_PAIR_SUMS), dq and dk are zeroed outputs with one head per
    pair of value heads, which the kernel adds into: a group of two comes back without a group sum, a group of
    four with one over its two pairs."""
    from flashgdn.kernels.hopper import backward, fused_backward

    monkeypatch.setattr(backward, "FUSED_BACKWARD", True)
    monkeypatch.setattr(backward, "FUSED_PAIR_SUMS", True)
    seen, options = [], []
    real_zeros = torch.zeros
    stand_in = fused_backward.build_fused_backward

    def zeros(*args, **kwargs):
        out = real_zeros(*args, **kwargs)
        seen.append(tuple(out.shape))
        return out

    def capture(*a, **kw):
        options.append(kw)
        return stand_in(*a, **kw)

    monkeypatch.setattr(backward.torch, "zeros", zeros)
    monkeypatch.setattr(fused_backward, "build_fused_backward", capture)
    for heads in ((2, 4), (2, 8)):
        inp = make_inputs(Hqk=heads[0], Hv=heads[1], K=128, V=128, dtype=torch.bfloat16, seqlens=[300, 70])
        q, k, v, g, beta, h0 = (inp.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state"))
        do = torch.randn(v.shape).to(torch.bfloat16)
        seen.clear()
        options.clear()
        cu = inp["cu_seqlens"]
        dq, dk, *_ = backward.hopper_backward(q, k, v, g, beta, do, None, 0.1, h0, cu, False, None, cu.clone())
        assert dq.shape == q.shape and dk.shape == k.shape
        per_pair = (1, q.shape[1], heads[1] // 2, 128)
        sums = [sizes for name, sizes in checked_kernels if name == "group_sum"]
        checked_kernels.clear()
        assert [kw.get("pair_sums") for kw in options] == [True]
        assert seen.count(per_pair) == 2, seen  # dq and dk, zeroed for the reductions
        assert len(sums) == (0 if heads[1] == 2 * heads[0] else 1)


def _long_sequence_problem(seqlens=(16384,), grad=True, heads=(2, 8)):
    """``(problem, input names, leaves)``: ``heads`` (Hqk, Hv) sequences of ``seqlens`` tokens (one of 16384) under
    cp="auto", every input a leaf that wants its gradient with ``grad`` (the op's backward under autograd)."""
    from flashgdn.api.validate import validate

    inp = make_inputs(Hqk=heads[0], Hv=heads[1], K=128, V=128, dtype=torch.bfloat16, seqlens=list(seqlens))
    inp["cu_seqlens_cpu"] = inp["cu_seqlens"].clone()
    names = ("q", "k", "v", "g", "beta", "initial_state")
    xs = {n: inp[n].detach().clone().requires_grad_(grad) for n in names}
    p = validate(**xs, cu_seqlens=inp["cu_seqlens"], cu_seqlens_cpu=inp["cu_seqlens_cpu"], scale=0.1,
                 output_final_state=True, cp="auto", check_values=False)
    return p, names, xs


def test_op_backward_runs_on_its_own_plan(checked_kernels, monkeypatch):
    """Through autograd, the forward runs on the forward's plan and the backward on its own (``cp.plan_backward``):
    on 2/8 one 16384-token sequence, the forward's loop on 8 segments of 32 chunks, the backward's fused kernel on
    16 of 16 (the plans the cost model gives there, checked first), with the forward on its own plan
    (``CP_FORWARD_ON_BACKWARD_SEGMENTS`` off)."""
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.backend import HopperBackend

    monkeypatch.setattr(backend, "CP_FORWARD_ON_BACKWARD_SEGMENTS", False)

    p, names, xs = _long_sequence_problem()
    forward_plan, backward_plan = HopperBackend._plan(p), HopperBackend._backward_plan(p)
    assert forward_plan.num_segments == 8 and backward_plan.plan.num_segments == 16 and backward_plan.fused
    o, ht = HopperBackend()(p)
    loops = [sizes["num_seqs"] for name, sizes in checked_kernels if name == "chunk_forward_rso"]
    assert loops == [8]
    checked_kernels.clear()
    grads = torch.autograd.grad((o, ht), [xs[n] for n in names], (torch.ones_like(o), torch.ones_like(ht)))
    fused = [sizes["num_seqs"] for name, sizes in checked_kernels if name == "fused_backward"]
    assert fused == [16], [c[0] for c in checked_kernels]
    assert all(gr.shape == xs[n].shape for gr, n in zip(grads, names))


def test_forward_cuts_in_between_segments_only_without_a_backward(checked_kernels):
    """2/8 24576+8192 under cp="auto": without autograd the forward runs on 48-chunk segments (8 + 3, an in-between
    length, ``cp.plan.IN_BETWEEN_SEGMENT_CHUNKS``), under autograd on 32-chunk ones (12 + 4), whose starts the
    backward can take."""
    from flashgdn.kernels.hopper.backend import HopperBackend

    for grad, want in ((False, 11), (True, 16)):
        p, _, _ = _long_sequence_problem((24576, 8192), grad)
        checked_kernels.clear()
        HopperBackend()(p)
        assert [sizes["num_seqs"] for name, sizes in checked_kernels if name == "chunk_forward_rso"] == [want], grad


def test_op_backward_on_the_forwards_segments_takes_its_transitions(checked_kernels, monkeypatch):
    """``CP_REUSE_TRANSITIONS``: where the backward runs on the forward's own segments (2/8 8192x1: 8 of 16 chunks
    both), the forward's transition pass makes the M of the last segment besides and keeps its pairs, and the
    backward runs the states pass alone where it ran the transition pass first; off, as before."""
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.backend import HopperBackend

    monkeypatch.setattr(backend, "CP_REUSE_STARTS", True)
    passes = {}
    for on in (False, True):
        monkeypatch.setattr(backend, "CP_REUSE_TRANSITIONS", on)
        p, names, xs = _long_sequence_problem((8192,))
        forward_plan = HopperBackend._plan(p)
        backward_plan = HopperBackend._backward_plan(p, forward_plan)
        assert forward_plan.segment_chunks == 16 and backward_plan.plan.segment_chunks == 16
        assert backend._reuses_transitions(forward_plan, backward_plan) == on
        checked_kernels.clear()
        o, ht = HopperBackend()(p)
        forward_rs = [sizes for name, sizes in checked_kernels if name == "chunk_forward_rs"]
        checked_kernels.clear()
        grads = torch.autograd.grad((o, ht), [xs[n] for n in names], (torch.ones_like(o), torch.ones_like(ht)))
        passes[on] = [name for name, _ in checked_kernels if name == "chunk_forward_rs"]
        assert len(forward_rs) == 1  # the forward's transition pass, with or without the last M
        assert all(gr.shape == xs[n].shape for gr, n in zip(grads, names))
    assert len(passes[False]) == 2 and len(passes[True]) == 1, passes  # (transitions and) the states pass


def test_op_forward_under_autograd_runs_on_the_backwards_segments(checked_kernels, monkeypatch):
    """``CP_FORWARD_ON_BACKWARD_SEGMENTS``: on 2/8 16384x1 (the forward's own plan 8 segments of 32 chunks, the
    backward's 16 of 16) the forward under autograd runs on the backward's 16 segments, and the backward takes its
    starts and transitions: no splice and no transition pass of its own, only the states pass and the reverse splice.
    Without autograd, and with the switch off, the forward keeps its own 8."""
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.backend import HopperBackend

    for on, grad, want in ((True, True, 16), (False, True, 8), (True, False, 8)):
        monkeypatch.setattr(backend, "CP_FORWARD_ON_BACKWARD_SEGMENTS", on)
        p, names, xs = _long_sequence_problem(grad=grad)
        checked_kernels.clear()
        with torch.set_grad_enabled(grad):
            o, ht = HopperBackend()(p)
        loops = [sizes["num_seqs"] for name, sizes in checked_kernels if name == "chunk_forward_rso"]
        assert loops == [want], (on, grad, loops)
        if not grad:
            continue
        checked_kernels.clear()
        torch.autograd.grad((o, ht), [xs[n] for n in names], (torch.ones_like(o), torch.ones_like(ht)))
        rs = [name for name, _ in checked_kernels if name == "chunk_forward_rs"]
        splices = [sizes["num_seqs"] for name, sizes in checked_kernels if name == "splice"]
        if on:  # the states pass alone; the reverse splice alone
            assert len(rs) == 1 and splices == [1], (rs, splices)
        else:  # the transition pass (M only) and the states pass; the forward splice's chains and the reverse
            assert len(rs) == 2 and splices == [8, 1], (rs, splices)


def test_op_forward_under_autograd_splits_where_only_the_backward_splits(checked_kernels, monkeypatch):
    """``CP_FORWARD_ON_BACKWARD_SEGMENTS`` where the forward's own plan does not split: on 8/16 eight sequences of
    8192 tokens in all (the forward's plan whole, the backward's 16-chunk segments, the plans the cost model gives
    there, checked first) the forward under autograd runs the CP loop on the backward's segments and the backward
    takes its starts and transitions (the states pass alone, the reverse splice alone); with the switch off, and
    without autograd, the forward runs whole and the backward splices from nothing."""
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.backend import HopperBackend

    seqlens, heads = (949, 465, 545, 137, 799, 3437, 468, 1392), (8, 16)
    p, _, _ = _long_sequence_problem(seqlens, heads=heads)
    forward_plan, backward_plan = HopperBackend._plan(p), HopperBackend._backward_plan(p)
    assert forward_plan is None and backward_plan.plan.segment_chunks == 16, (forward_plan, backward_plan)
    segments = backward_plan.plan.num_segments
    assert segments != len(seqlens)
    for on, grad in ((True, True), (False, True), (True, False)):
        monkeypatch.setattr(backend, "CP_FORWARD_ON_BACKWARD_SEGMENTS", on)
        p, names, xs = _long_sequence_problem(seqlens, grad, heads)
        checked_kernels.clear()
        with torch.set_grad_enabled(grad):
            o, ht = HopperBackend()(p)
        # the one forward kernel's rows: a segment each, or a sequence each
        loops = [sizes["num_seqs"] for name, sizes in checked_kernels if name == "chunk_forward_rso"]
        assert loops == [segments if on and grad else len(seqlens)], (on, grad, loops)
        if not grad:
            continue
        checked_kernels.clear()
        grads = torch.autograd.grad((o, ht), [xs[n] for n in names], (torch.ones_like(o), torch.ones_like(ht)))
        rs = [name for name, _ in checked_kernels if name == "chunk_forward_rs"]
        splices = [sizes["num_seqs"] for name, sizes in checked_kernels if name == "splice"]
        if on:  # the reverse splice, one chain per sequence
            assert len(rs) == 1 and splices == [len(seqlens)], (rs, splices)
        else:  # the transition pass and the states pass; the forward splice and the reverse
            assert len(rs) == 2 and len(splices) == 2, (rs, splices)
        assert all(gr.shape == xs[n].shape for gr, n in zip(grads, names))


def test_op_backward_starts_from_the_forwards_segment_starts(checked_kernels, monkeypatch):
    """``CP_REUSE_STARTS``: the forward keeps its segments' start states and the backward's forward splice runs
    from them: on 2/8 16384 (the forward on 8 segments of 32 chunks, the backward on 16 of 16) chains of two
    segments, one per forward segment, instead of the sequence's chain of 16; the reverse splice as before."""
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.backend import HopperBackend

    monkeypatch.setattr(backend, "CP_REUSE_STARTS", True)
    monkeypatch.setattr(backend, "CP_FORWARD_ON_BACKWARD_SEGMENTS", False)
    p, names, xs = _long_sequence_problem()
    forward_plan = HopperBackend._plan(p)
    backward_plan = HopperBackend._backward_plan(p, forward_plan)
    assert forward_plan.segment_chunks == 32 and backward_plan.plan.segment_chunks == 16 and backward_plan.fused
    o, ht = HopperBackend()(p)
    checked_kernels.clear()
    grads = torch.autograd.grad((o, ht), [xs[n] for n in names], (torch.ones_like(o), torch.ones_like(ht)))
    splices = [sizes["num_seqs"] for name, sizes in checked_kernels if name == "splice"]
    assert splices == [8, 1], splices  # the forward splice over 8 chains, the reverse over the sequence
    # the chains' index by one kernel over the forward's 8 segments; the segment index built for both plans
    assert [sizes["num_known"] for name, sizes in checked_kernels if name == "chain_index"] == [8]
    assert [sizes["num_segments"] for name, sizes in checked_kernels if name == "segment_index"] == [16, 8]
    assert all(gr.shape == xs[n].shape for gr, n in zip(grads, names))
    monkeypatch.setattr(backend, "CP_CHAIN_INDEX", False)  # by torch ops: no kernel
    o, ht = HopperBackend()(p)
    checked_kernels.clear()
    torch.autograd.grad((o, ht), [xs[n] for n in names], (torch.ones_like(o), torch.ones_like(ht)))
    assert not [name for name, _ in checked_kernels if name == "chain_index"]
    assert [sizes["num_seqs"] for name, sizes in checked_kernels if name == "splice"] == [8, 1]


def test_forward_of_a_group_of_one_calls_stage1_at_seven_ctas_per_sm(checked_kernels, monkeypatch):
    """FLASHGDN_HOPPER_KKT_ODD_GROUP_BLOCKS on (the default), at Hqk = Hv (a group of one): the operator's forward,
    with and without context parallelism, builds stage 1 for seven CTAs per SM and calls it, and the rso loop, with
    the arguments their prim_funcs take."""
    from flashgdn.api.validate import validate
    from flashgdn.kernels.hopper import chunk_forward_rso, forward, kkt_inverse
    from flashgdn.kernels.hopper.backend import HopperBackend

    monkeypatch.setattr(forward, "KKT_ODD_GROUP_BLOCKS", True)
    built = []
    for module, attr in ((kkt_inverse, "build_kkt_inverse"), (chunk_forward_rso, "build_chunk_forward_rso")):
        stand_in = getattr(module, attr)  # the fixture's signature check

        def record(*args, _stand_in=stand_in, _name=attr, **kwargs):
            built.append((_name, kwargs))
            return _stand_in(*args, **kwargs)

        monkeypatch.setattr(module, attr, record)
    for cp in ("off", 4):
        inp = make_inputs(Hqk=2, Hv=2, K=128, V=128, dtype=torch.bfloat16, seqlens=[700, 30, 300], pad=5)
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].clone()
        built.clear()
        checked_kernels.clear()
        HopperBackend()(validate(**inp, output_final_state=True, cp=cp))
        kkt = [kw for name, kw in built if name == "build_kkt_inverse"]
        rso = [kw for name, kw in built if name == "build_chunk_forward_rso"]
        assert kkt and all(kw.get("blocks_per_sm") == 7 for kw in kkt), (cp, kkt)
        assert len(rso) == 1, (cp, rso)
        assert [name for name, _ in checked_kernels].count("chunk_forward_rso") == 1, cp
