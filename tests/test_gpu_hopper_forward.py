"""The Hopper forward against the float64 oracle, on the matrix of DESIGN.md §3 (GPU only).

The oracle is the chunked reference in float64 on the same bf16-rounded inputs (it equals the token recurrence
to ~1e-12, tests/test_reference_*.py); bars: o and final state <= 5e-3 relative RMS. Every output is filled
with NaN before the kernels run, so an element no kernel wrote fails.
"""
import os
import random

import pytest
import torch

from flashgdn import chunk_gated_delta_rule

from helpers import chunked64, make_inputs, rel_rms

pytestmark = pytest.mark.gpu

O_BAR = 5e-3
STATE_BAR = 5e-3


#: every chunk loop, or those listed in FLASHGDN_TEST_CHUNK_LOOPS (comma separated) for a quicker run;
#: "fused_registers" is the fused loop with its inverse by stage 1's register pieces (forward.FUSED_REGISTER_INVERSE),
#: "fused_state_p" the fused loop with P made by its state paths (forward.FUSED_STATE_P), "fused_state_p_both" that with
#: the register inverse and v's tile swizzled (forward.FUSED_SWIZZLED_V)
FUSED_OPTIONS = {"fused_registers": ("FUSED_REGISTER_INVERSE",), "fused_state_p": ("FUSED_STATE_P",),
                 "fused_state_p_both": ("FUSED_STATE_P", "FUSED_REGISTER_INVERSE", "FUSED_SWIZZLED_V")}
CHUNK_LOOPS = [loop for loop in ("rs", "rsd", "fused", *FUSED_OPTIONS, "uw", "ws", "simple", "rso")
               if loop in os.environ.get("FLASHGDN_TEST_CHUNK_LOOPS", loop).split(",")]


@pytest.fixture(autouse=True, params=CHUNK_LOOPS)
def chunk_loop(request, monkeypatch, cuda):
    """Every test runs on every chunk-loop kernel, with every output poisoned with NaN first."""
    from flashgdn.kernels.hopper import forward

    monkeypatch.setattr(forward, "POISON_OUTPUTS", True)
    for switch in FUSED_OPTIONS.get(request.param, ()):
        monkeypatch.setattr(forward, switch, True)
    monkeypatch.setattr(forward, "DEFAULT_CHUNK_LOOP", "fused" if request.param in FUSED_OPTIONS else request.param)
    return request.param


def run_hopper(inp, output_final_state=True):
    with torch.no_grad():
        return chunk_gated_delta_rule(**inp, output_final_state=output_final_state, backend="hopper")


def check(inp, output_final_state=True, o_bar=O_BAR, state_bar=STATE_BAR):
    o, ht = run_hopper(inp, output_final_state)
    o_ref, ht_ref = chunked64(inp, output_final_state)
    assert torch.isfinite(o).all(), "o has NaN/Inf (unwritten or overflowed elements)"
    e_o = rel_rms(o, o_ref)
    assert e_o <= o_bar, f"o: relative RMS {e_o:.2e} > {o_bar}"
    e_h = None
    if output_final_state:
        assert ht is not None and ht.dtype == torch.float32
        assert torch.isfinite(ht).all()
        e_h = rel_rms(ht, ht_ref)
        assert e_h <= state_bar, f"final state: relative RMS {e_h:.2e} > {state_bar}"
    else:
        assert ht is None
    return o, ht, e_o, e_h


def inputs(seqlens, Hqk=2, Hv=4, **kw):
    kw.setdefault("K", 128)
    kw.setdefault("V", 128)
    kw.setdefault("dtype", torch.bfloat16)
    return make_inputs(seqlens=seqlens, Hqk=Hqk, Hv=Hv, device="cuda", **kw)


# ---------------------------------------------------------------------------------------------------------
# the operator


@pytest.mark.parametrize("seqlens", [[1], [37], [63], [64], [65], [127], [128], [1000], [4096]])
def test_single_sequence_lengths(seqlens):
    check(inputs(seqlens))


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gva_ratios(group):
    check(inputs([300, 77, 1024], Hqk=2, Hv=2 * group))


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("initial_state", [False, True])
def test_layouts_and_initial_state(state_v_first, initial_state):
    check(inputs([500, 64, 129], state_v_first=state_v_first, initial_state=initial_state))


@pytest.mark.parametrize("output_final_state", [False, True])
def test_without_final_state(output_final_state):
    check(inputs([200, 300]), output_final_state=output_final_state)


def test_strong_decay_and_zero_gate_heads():
    check(inputs([700, 64, 5], Hqk=2, Hv=8, gate="strong", zero_gate_heads=(1, 6)))


def test_mixed_decay():
    check(inputs([2048, 100], Hqk=2, Hv=8, gate="mixed", zero_gate_heads=(3,)))


def test_padded_tail_is_zero():
    inp = inputs([300, 100], pad=200)
    o, _, _, _ = check(inp)
    assert (o[:, 400:] == 0).all(), "tokens after cu_seqlens[-1] must get o = 0"


def test_dense_batch():
    check(inputs([333, 333, 333], dense=True))


def test_l2norm_in_kernel_unnormalised_keys():
    check(inputs([400, 90], normalize_qk=False, use_qk_l2norm_in_kernel=True))


def test_unnormalised_keys_without_l2norm():
    check(inputs([256, 190], normalize_qk=False))


def test_float16():
    check(inputs([300, 129], dtype=torch.float16))


def test_bfloat16_gate_and_beta():
    inp = inputs([300, 129])
    inp["g"] = inp["g"].to(torch.bfloat16)
    inp["beta"] = inp["beta"].to(torch.bfloat16)
    check(inp)


def test_zero_length_sequences():
    inp = inputs([0, 100, 0, 64, 0])
    o, ht, _, _ = check(inp)
    torch.testing.assert_close(ht[0], inp["initial_state"][0], rtol=0, atol=0)


def test_many_short_sequences():
    rnd = random.Random(5)
    check(inputs([rnd.randint(1, 200) for _ in range(500)], Hqk=4, Hv=8))


def test_long_sequence_64k():
    check(inputs([65536], Hqk=1, Hv=2))


def test_scale_argument():
    inp = inputs([200])
    inp["scale"] = 0.37
    check(inp)


def test_deterministic():
    inp = inputs([1000, 77, 3000], Hqk=2, Hv=8)
    o1, h1 = run_hopper(inp)
    o2, h2 = run_hopper(inp)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


def test_new_sequence_mixes_do_not_compile_again():
    from flashgdn.kernels.hopper.chunk_forward import build_chunk_forward
    from flashgdn.kernels.hopper.chunk_forward_rs import build_chunk_forward_rs
    from flashgdn.kernels.hopper.chunk_forward_rso import build_chunk_forward_rso
    from flashgdn.kernels.hopper.chunk_forward_uw import build_chunk_forward_uw
    from flashgdn.kernels.hopper.chunk_forward_ws import build_chunk_forward_ws
    from flashgdn.kernels.hopper.kkt_inverse import build_kkt_inverse
    from flashgdn.kernels.hopper.segment_index import build_segment_index
    from flashgdn.kernels.hopper.splice import build_splice

    builders = (build_chunk_forward, build_chunk_forward_rs, build_chunk_forward_rso, build_chunk_forward_uw,
                build_chunk_forward_ws, build_kkt_inverse, build_splice, build_segment_index)
    # one mix run whole and one that cp="auto" splits: the latter compiles context parallelism's own variants
    # (the paired transition pass, the splice, the segment index) once; after both, no mix compiles anything
    run_hopper(inputs([100, 200], Hqk=2, Hv=4))
    run_hopper(inputs([16384], Hqk=2, Hv=4))
    before = [b.cache_info().misses for b in builders]
    for mix in ([5], [64, 64, 64], [1000, 1, 2, 3], [4096], [129] * 30, [20000, 9000]):
        run_hopper(inputs(mix, Hqk=2, Hv=4))
    assert [b.cache_info().misses for b in builders] == before


def test_cuda_graph_capture_on_first_call():
    warm = inputs([100, 50])
    run_hopper(warm)  # compiles this configuration; capture below uses new tensors and a new mix
    inp = inputs([700, 64, 9])
    inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        with torch.cuda.graph(graph, stream=stream):
            o_g, ht_g = chunk_gated_delta_rule(**inp, output_final_state=True, backend="hopper")
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    o, ht = run_hopper(inp)
    assert torch.equal(o_g, o) and torch.equal(ht_g, ht)


@pytest.mark.parametrize("kw", [dict(seqlens=[130, 70]), dict(seqlens=[700, 64, 5], gate="strong", zero_gate_heads=(1,)),
                                dict(seqlens=[300, 129], use_qk_l2norm_in_kernel=True, normalize_qk=False)])
def test_gradients_match_the_oracle(kw):
    """The Hopper backend's backward (today the written-out chunked backward in float32) against float64
    autograd on the bars of DESIGN.md §3, strong decay included (an anchor shipped a dg bug there)."""
    from helpers import BARS_16BIT, copy_inputs, grads_of

    inp = inputs(requires_grad=True, **kw)
    _, _, got = grads_of(lambda **a: chunk_gated_delta_rule(**a, backend="hopper"), inp)
    ref = copy_inputs(inp, dtype=torch.float64, requires_grad=True)
    ref.pop("cu_seqlens_cpu", None)
    _, _, want = grads_of(lambda **a: chunk_gated_delta_rule(**a, backend="reference"), ref)
    for name, w in want.items():
        assert rel_rms(got[name], w) <= BARS_16BIT[name], name


@pytest.mark.parametrize("seqlens", [[4096], [700, 64, 5, 300]])
def test_precise_mode_against_the_oracle(seqlens, chunk_loop, monkeypatch):
    """The rs loop's precise mode: within the bars, and the final state closer to float64 than the bf16 mode."""
    from flashgdn.kernels.hopper import forward

    if chunk_loop != "rs":
        pytest.skip("the precise mode is a mode of the rs loop; covered by its parametrisation")
    inp = inputs(seqlens, Hqk=2, Hv=4, zero_gate_heads=(0, 1))
    o_ref, ht_ref = chunked64(inp)
    o_fast, ht_fast = run_hopper(inp)
    monkeypatch.setattr(forward, "PRECISE", True)
    o, ht = run_hopper(inp)
    assert rel_rms(o, o_ref) < O_BAR and rel_rms(ht, ht_ref) < STATE_BAR
    assert rel_rms(ht, ht_ref) < rel_rms(ht_fast, ht_ref)


@pytest.mark.parametrize("kw", [dict(seqlens=[700, 64, 5, 300], Hqk=2, Hv=8, gate="strong", zero_gate_heads=(1,)),
                                dict(seqlens=[4096, 130], Hqk=2, Hv=4, gate="mixed", state_v_first=True),
                                dict(seqlens=[1000], Hqk=1, Hv=2, initial_state=False)])
def test_rso_lean_output_gives_the_same_bits(kw, chunk_loop, monkeypatch):
    """``forward.RSO_LEAN_OUTPUT`` (the default): the rso output path's row and column factors in registers and O
    staged by stmatrix: the same products of the same values and the same values stored, so o and the final state
    are the same bits as the untrimmed build."""
    from flashgdn.kernels.hopper import forward

    if chunk_loop != "rso":
        pytest.skip("a build option of the rso loop; covered by its parametrisation")
    inp = inputs(**kw)
    monkeypatch.setattr(forward, "RSO_LEAN_OUTPUT", False)
    o0, h0 = run_hopper(inp)
    monkeypatch.setattr(forward, "RSO_LEAN_OUTPUT", True)
    o1, h1 = run_hopper(inp)
    assert torch.equal(o0, o1) and torch.equal(h0, h1)
    o_ref, h_ref = chunked64(inp)
    assert rel_rms(o1, o_ref) <= O_BAR and rel_rms(h1, h_ref) <= STATE_BAR


def test_rso_trace_build_gives_the_same_bits_and_ordered_stamps(chunk_loop):
    """The rso loop's trace build (``trace=True``, benchmarks/rso_trace.py) computes what the default build does, bit
    for bit (it only adds the stamps' stores), and each role's stamps within a chunk come in program order, in the
    CTA of value head 0 and sequence 0 only, for as many chunks as that sequence has."""
    from flashgdn.kernels.hopper.chunk_forward_rso import (TRACE_CHUNKS, TRACE_POINTS, TRACE_POINTS_OF,
                                                           build_chunk_forward_rso)
    from flashgdn.kernels.hopper.forward import hopper_stage1, rso_options

    if chunk_loop != "rso":
        pytest.skip("a build of the rso loop; covered by its parametrisation")
    inp = inputs([700, 64, 9], Hqk=2, Hv=8, gate="mixed")
    q, k, v, g, beta, h0 = (inp[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    cu = inp["cu_seqlens"].to(torch.int32)  # the kernels' offsets (the op converts them so)
    st1 = hopper_stage1(k, g, beta, cu, cu_cpu=cu.cpu())
    T = q.shape[1]

    def run(trace):
        o = torch.full((1, T, 8, 128), float("nan"), dtype=q.dtype, device=q.device)
        ht = torch.full((3, 8, 128, 128), float("nan"), dtype=torch.float32, device=q.device)
        tr = torch.zeros((4, TRACE_CHUNKS, TRACE_POINTS), dtype=torch.int64, device=q.device)
        kernel = build_chunk_forward_rso(2, 8, 128, 128, "bfloat16", True, True, False, trace=trace, **rso_options())
        kernel(q, k, v, st1.gcum, st1.Ag, cu, st1.first_slot, h0, 0.1, o, ht, *([tr] if trace else []))
        return (o, ht), tr.cpu()

    plain, _ = run(False)
    traced, tr = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, traced))
    chunks = -(-700 // 64)
    for role, points in enumerate(TRACE_POINTS_OF):
        stamps = tr[role, :chunks, :len(points)]
        assert (stamps > 0).all(), role
        assert (stamps[:, 1:] >= stamps[:, :-1]).all(), role
    assert (tr[:, chunks:] == 0).all()


def test_fused_trace_build_gives_the_same_bits_and_ordered_stamps(chunk_loop):
    """The fused loop's trace build (``trace=True``, benchmarks/fused_trace.py), with either inverse or P on the state
    paths, computes what its plain build does, bit for bit, and each role's stamps within a chunk come in program
    order (the gate's inverse phases only with the register pieces), in the CTA of value head 0 and sequence 0 only."""
    from flashgdn.kernels.hopper.chunk_forward_rs import (TRACE_CHUNKS, TRACE_POINTS, TRACE_POINTS_OF,
                                                          build_chunk_forward_rs)

    if chunk_loop not in ("fused", *FUSED_OPTIONS):
        pytest.skip("a build of the fused loop; covered by its parametrisation")
    switches = FUSED_OPTIONS.get(chunk_loop, ())  # the build the operator makes with them
    registers = "FUSED_REGISTER_INVERSE" in switches
    state_p = "FUSED_STATE_P" in switches
    swizzled_v = True if "FUSED_SWIZZLED_V" in switches else None
    inp = inputs([700, 64, 9], Hqk=2, Hv=8, gate="mixed")
    q, k, v, g, beta, h0 = (inp[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    cu = inp["cu_seqlens"].to(torch.int32)
    T = q.shape[1]
    g, beta = g.float().contiguous(), beta.float().contiguous()

    def run(trace):
        o = torch.full((1, T, 8, 128), float("nan"), dtype=q.dtype, device=q.device)
        ht = torch.full((3, 8, 128, 128), float("nan"), dtype=torch.float32, device=q.device)
        tr = torch.zeros((3, TRACE_CHUNKS, TRACE_POINTS), dtype=torch.int64, device=q.device)
        kernel = build_chunk_forward_rs(2, 8, 128, 128, "bfloat16", True, True, False, True, decayed_k=not state_p,
                                        inverse_in_loop=True, register_inverse=registers, state_p=state_p,
                                        swizzled_v=swizzled_v, trace=trace)
        kernel(q, k, v, g, beta, cu, h0, 0.1, o, ht, *([tr] if trace else []))
        return (o, ht), tr.cpu()

    plain, _ = run(False)
    traced, tr = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, traced))
    assert torch.isfinite(plain[0]).all()
    chunks = -(-700 // 64)
    for role, points in enumerate(TRACE_POINTS_OF):
        written = [p for p in range(len(points)) if registers or not (role == 2 and 3 <= p <= 6)]
        stamps = tr[role, :chunks, written]
        assert (stamps > 0).all(), role
        assert (stamps[:, 1:] >= stamps[:, :-1]).all(), role
        assert (tr[role, :chunks, [p for p in range(TRACE_POINTS) if p not in written]] == 0).all(), role
    assert (tr[:, chunks:] == 0).all()


@pytest.mark.parametrize("kw", [dict(seqlens=[700, 64, 5, 300], Hqk=2, Hv=8, gate="strong", zero_gate_heads=(1,)),
                                dict(seqlens=[4096, 130], Hqk=2, Hv=4, gate="mixed", state_v_first=True)])
def test_rso_lean_state_gives_the_same_bits(kw, chunk_loop, monkeypatch):
    """``forward.RSO_LEAN_STATE``: the state paths' gamma_j and d_j read once per chunk into registers: the same
    products of the same values, so o and the final state are the same bits as the default build."""
    from flashgdn.kernels.hopper import forward

    if chunk_loop != "rso":
        pytest.skip("a build option of the rso loop; covered by its parametrisation")
    inp = inputs(**kw)
    o0, h0 = run_hopper(inp)
    monkeypatch.setattr(forward, "RSO_LEAN_STATE", True)
    o1, h1 = run_hopper(inp)
    assert torch.equal(o0, o1) and torch.equal(h0, h1)
