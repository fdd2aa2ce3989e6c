"""Programmatic dependent launch (``common.PDL``, GPU): every Hopper kernel of the op built to let the next kernel
launch early and to wait for the ones before it. The same kernels' work on the same values, so the op and its
gradients must be the same bits with and without it, with and without context parallelism, and a training step
with it, captured in a CUDA graph, must replay to the eager bits (the graph then holds programmatic edges)."""
import pytest
import torch

from flashgdn import chunk_gated_delta_rule
from helpers import make_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("opts", [
    dict(seqlens=[8192]),
    dict(seqlens=[5000, 64, 3000, 1], gate="strong", zero_gate_heads=(1,)),
    dict(seqlens=[4096, 4096], dense=True),
    dict(seqlens=[700] * 12 + [33], pad=70),
])
def test_pdl_gives_the_same_bits_and_replays_in_a_cuda_graph(opts, cuda, monkeypatch):
    from flashgdn.kernels.hopper import common

    inp = make_inputs(Hqk=2, Hv=4, K=128, V=128, dtype=torch.bfloat16, device=cuda, **opts)
    if inp.get("cu_seqlens") is not None:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if inp.get(n) is not None]
    xs = {n: inp[n].detach().clone().requires_grad_(True) for n in names}
    gen = torch.Generator(device=cuda)
    do = torch.randn(inp["v"].shape, generator=gen.manual_seed(5), device=cuda).to(inp["v"].dtype)
    N = inp["cu_seqlens"].numel() - 1 if inp.get("cu_seqlens") is not None else inp["q"].shape[0]
    dht = torch.randn((N, 4, 128, 128), generator=gen.manual_seed(6), device=cuda)
    if opts.get("state_v_first"):
        dht = dht.transpose(-1, -2).contiguous()

    def run(cp):
        for x in xs.values():
            x.grad = None
        o, ht = chunk_gated_delta_rule(**(inp | xs), output_final_state=True, backend="hopper", cp=cp)
        torch.autograd.backward([o, ht], [do, dht])
        return [o.detach().clone(), ht.detach().clone()] + [xs[n].grad for n in names]

    for cp in ("off", 4, "auto"):
        monkeypatch.setattr(common, "PDL", False)
        want = run(cp)
        monkeypatch.setattr(common, "PDL", True)
        got = run(cp)
        for name, x, w in zip(["o", "final state"] + names, got, want):
            assert torch.equal(x, w), (cp, name)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run("auto")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run("auto")
    for x in captured:
        x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for name, x, w in zip(["o", "final state"] + names, captured, got):
        assert torch.equal(x, w), ("graph", name)
