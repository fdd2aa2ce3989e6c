"""torch.compile integration: the operator is a custom op with fake and autograd registrations, so a model that
calls it compiles with fullgraph=True and matches eager, forward and backward (CPU, reference backend)."""
import pytest
import torch

from flashgdn import chunk_gated_delta_rule
from helpers import make_inputs


class TinyGDNLayer(torch.nn.Module):
    """Projections -> gated delta rule -> output projection: the shape of a Qwen3-Next linear-attention layer."""

    def __init__(self, d=32, Hqk=2, Hv=4, K=16, V=16):
        super().__init__()
        self.Hqk, self.Hv, self.K, self.V = Hqk, Hv, K, V
        self.backend = "reference"
        self.q = torch.nn.Linear(d, Hqk * K, bias=False)
        self.k = torch.nn.Linear(d, Hqk * K, bias=False)
        self.v = torch.nn.Linear(d, Hv * V, bias=False)
        self.a = torch.nn.Linear(d, Hv)
        self.b = torch.nn.Linear(d, Hv)
        self.o = torch.nn.Linear(Hv * V, d, bias=False)

    def forward(self, x, h0, cu_seqlens, cu_seqlens_cpu):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.Hqk, self.K)
        k = self.k(x).view(B, T, self.Hqk, self.K)
        v = self.v(x).view(B, T, self.Hv, self.V)
        g = torch.nn.functional.logsigmoid(self.a(x))
        beta = torch.sigmoid(self.b(x))
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                       use_qk_l2norm_in_kernel=True, backend=self.backend)
        return self.o(o.reshape(B, T, -1)), ht


def _run(layer, x, h0, cu, cu_cpu):
    x = x.clone().requires_grad_(True)
    h0 = h0.clone().requires_grad_(True)
    y, ht = layer(x, h0, cu, cu_cpu)
    (y.square().sum() + ht.sum()).backward()
    grads = [x.grad, h0.grad] + [p.grad.clone() for p in layer.parameters()]
    for p in layer.parameters():
        p.grad = None
    return y.detach(), ht.detach(), grads


@pytest.mark.parametrize("varlen", [False, True])
def test_fullgraph_compile_matches_eager(varlen):
    torch.manual_seed(0)
    layer = TinyGDNLayer().double()
    if varlen:
        cu_cpu = torch.tensor([0, 50, 70, 150], dtype=torch.int32)
        B, T, N = 1, 150, 3
    else:
        cu_cpu = None
        B, T, N = 2, 70, 2
    cu = cu_cpu
    x = torch.randn(B, T, 32, dtype=torch.float64)
    h0 = torch.randn(N, 4, 16, 16, dtype=torch.float64)
    eager = _run(layer, x, h0, cu, cu_cpu)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = _run(compiled, x, h0, cu, cu_cpu)
    torch.testing.assert_close(got[0], eager[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got[1], eager[1], rtol=1e-9, atol=1e-9)
    for a, b in zip(got[2], eager[2]):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_new_sequence_mix_does_not_recompile():
    torch.manual_seed(1)
    layer = TinyGDNLayer().double()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=False)
    x = torch.randn(1, 150, 32, dtype=torch.float64)
    h0 = torch.randn(3, 4, 16, 16, dtype=torch.float64)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    for cu in ([0, 50, 70, 150], [0, 1, 2, 150], [0, 100, 149, 150]):
        cu = torch.tensor(cu, dtype=torch.int32)
        y, _ = compiled(x, h0, cu, cu)
        ref, _ = layer(x, h0, cu, cu)
        torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-9)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_custom_op_registrations_pass_opcheck():
    from flashgdn.api import custom_ops  # noqa: F401

    inp = make_inputs(seqlens=[40, 30], Hqk=1, Hv=2, K=8, V=8, dtype=torch.float64, device="cpu")
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["initial_state"], inp["cu_seqlens"], None,
            8 ** -0.5, True, False, "reference", "off")
    for a in args[:6]:
        a.requires_grad_(True)
    torch.library.opcheck(torch.ops.flashgdn.chunk_gdr_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static",
                                      "test_autograd_registration"))
