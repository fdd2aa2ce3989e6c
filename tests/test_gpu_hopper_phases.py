"""The phased forward (``flashgdn/kernels/hopper/phases.py``) on the GPU: the same bits as the forward in one launch
for any windows, the float64 oracle's bars, the window plan kernel against its torch form, the model's own windows on
an imbalanced mix, and a CUDA graph of a phased call."""
import pytest
import torch

from flashgdn import chunk_gated_delta_rule

from helpers import chunked64, make_inputs, rel_rms

pytestmark = pytest.mark.gpu

BAR = 5e-3


@pytest.fixture(autouse=True)
def poisoned(monkeypatch, cuda):
    from flashgdn.kernels.hopper import forward

    monkeypatch.setattr(forward, "POISON_OUTPUTS", True)


def inputs(seqlens, Hqk=2, Hv=4, **kw):
    inp = make_inputs(seqlens=seqlens, Hqk=Hqk, Hv=Hv, K=128, V=128, dtype=torch.bfloat16, device="cuda", **kw)
    if inp.get("cu_seqlens") is not None:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    return inp


def run(inp, monkeypatch, windows, final=True):
    """The op with the windows ``windows(chunks)`` (None: unphased), CP off; returns (o, ht, windows used)."""
    from flashgdn.kernels.hopper import phases

    used = []

    def plan(chunks, Hqk, Hv, model=None):
        used.append(windows(chunks) if windows else None)
        return used[-1]

    monkeypatch.setattr(phases, "plan_windows", plan)
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(**inp, output_final_state=final, backend="hopper", cp="off")
    torch.cuda.synchronize()
    assert used, "the forward did not ask for a window plan"
    return o, ht, used[-1]


def assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.isfinite(a).all()
    assert torch.equal(a, b), f"differ in {(a != b).sum().item()} of {a.numel()} elements"


CASES = {
    "varlen": dict(seqlens=[3000, 700, 1, 130], pad=100),
    "strong": dict(seqlens=[2000, 65, 1500], gate="strong", zero_gate_heads=(1,)),
    "no_h0": dict(seqlens=[1000, 3000], initial_state=False),
    "v_first": dict(seqlens=[1000, 2500], state_v_first=True),
    "dense": dict(seqlens=[1500, 1500], dense=True),
}


@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_phased_gives_the_same_bits_as_one_launch(case, final, monkeypatch):
    opts = dict(CASES[case])
    inp = inputs(**opts)

    def windows(chunks):  # uneven windows, one of them past the shorter sequences' ends
        longest = max(chunks)
        return sorted({0, 1, 3, 10, longest // 2, longest})

    o1, h1, _ = run(inp, monkeypatch, None, final)
    o2, h2, used = run(inp, monkeypatch, windows, final)
    assert used is not None and len(used) >= 4
    assert_same_bits(o2, o1)
    if final:
        assert_same_bits(h2, h1)
        o_ref, h_ref = chunked64(inp, True)
        assert rel_rms(h2, h_ref) <= BAR
    else:
        assert h1 is None and h2 is None
        o_ref, _ = chunked64(inp, False)
    assert rel_rms(o2, o_ref) <= BAR


@pytest.mark.parametrize("stagger", [True, False])
def test_every_chunk_its_own_window(stagger, monkeypatch):
    from flashgdn.kernels.hopper import phases

    monkeypatch.setattr(phases, "STAGGER", stagger)
    inp = inputs([700, 200, 64])
    o1, h1, _ = run(inp, monkeypatch, None)
    o2, h2, used = run(inp, monkeypatch, lambda chunks: list(range(max(chunks) + 1)))
    assert used == list(range(12))
    assert_same_bits(o2, o1)
    assert_same_bits(h2, h1)


def test_the_model_phases_an_imbalanced_mix_with_the_same_bits(monkeypatch):
    from flashgdn.kernels.hopper import phases

    inp = inputs([28672, 4096], Hqk=16, Hv=32)
    model_plan = phases.plan_windows
    o1, h1, _ = run(inp, monkeypatch, None)
    o2, h2, used = run(inp, monkeypatch, lambda chunks: model_plan(chunks, 16, 32,
                                                                   phases.PhaseModel.for_device(torch.device("cuda"))))
    assert used is not None and len(used) >= 3, f"the model did not phase 16/32 28672+4096: {used}"
    assert_same_bits(o2, o1)
    assert_same_bits(h2, h1)


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 100), (2, 5), (7, 40), (30, 31)])
def test_window_plan_kernel_matches_torch(lo, hi):
    from flashgdn.kernels.hopper.chunk_plan import build_chunk_plan
    from flashgdn.kernels.hopper.phases import window_chunks, window_plan_torch

    lens = [0, 1, 63, 64, 65, 2000, 640, 1]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    slots = max(1, sum(window_chunks([(n + 63) // 64 for n in lens], lo, hi))) + 3
    want_b, want_f = window_plan_torch(cu, lo, hi, slots)
    bounds = torch.full((slots, 2), -7, dtype=torch.int32, device="cuda")
    first = torch.full((len(lens),), -7, dtype=torch.int32, device="cuda")
    build_chunk_plan(window=True)(cu.cuda(), lo, hi, bounds, first)
    torch.cuda.synchronize()
    assert bounds.cpu().tolist() == want_b.tolist()
    assert first.cpu().tolist() == want_f.tolist()


def test_phased_call_is_sync_free_and_replays_in_a_cuda_graph(monkeypatch):
    from flashgdn.kernels.hopper import phases

    monkeypatch.setattr(phases, "plan_windows", lambda chunks, Hqk, Hv, model=None: [0, 2, 9, max(chunks)])
    inp = inputs([2000, 300, 900])

    def call():
        return chunk_gated_delta_rule(**inp, output_final_state=True, backend="hopper", cp="off")

    with torch.no_grad():
        o0, h0 = call()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            og, hg = call()
        og.zero_()
        hg.zero_()
        graph.replay()
        torch.cuda.synchronize()
    assert_same_bits(og, o0)
    assert_same_bits(hg, h0)
