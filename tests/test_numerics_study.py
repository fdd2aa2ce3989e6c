"""The chunk loop's numerics emulation (``benchmarks/numerics_study.py``, CPU): its forms of the chunk recurrence are
the same algebra (without rounding, each is the float64 loop), and folding gamma into a bf16 K tile for W (the "gk"
form, notes v0.33d) costs no accuracy against the rs loop's rounding points."""
import pytest
import torch

from helpers import load_benchmark

ns = load_benchmark("numerics_study")


def _inputs(T, gate, seed=3):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = ns.bf16(torch.nn.functional.normalize(randn(T, ns.K), dim=-1))
    k = ns.bf16(torch.nn.functional.normalize(randn(T, ns.K), dim=-1))
    v = ns.bf16(randn(T, ns.V))
    g = torch.nn.functional.logsigmoid(randn(T)) / (16 if gate == "normal" else 256)
    beta = torch.sigmoid(randn(T))
    return q, k, v, g, beta, randn(ns.K, ns.V)


@pytest.mark.parametrize("form", ["rs", "uw", "gk", "m"])
def test_forms_without_rounding_are_the_float64_loop(form):
    x = _inputs(300, "normal")
    o_ex, s_ex = ns.chunk_loop(*x, reg=ns.exact, tile=ns.exact, out=ns.exact)
    o, s = ns.chunk_loop(*x, reg=ns.exact, tile=ns.exact, out=ns.exact, form=form)
    assert ns.rel(o, o_ex) < 1e-12 and ns.rel(s, s_ex) < 1e-12


@pytest.mark.parametrize("gate", ["normal", "weak"])
def test_gamma_folded_into_a_bf16_k_tile_costs_no_accuracy(gate):
    x = _inputs(1024, gate)
    o_ex, s_ex = ns.chunk_loop(*x, reg=ns.exact, tile=ns.exact, out=ns.exact)
    errs = {}
    for form in ("rs", "gk"):
        o, s = ns.chunk_loop(*x, reg=ns.bf16, tile=ns.bf16, form=form)
        errs[form] = (ns.rel(o, o_ex), ns.rel(s, s_ex))
    assert errs["rs"] != errs["gk"]  # the tile's rounding is there
    for e_rs, e_gk in zip(errs["rs"], errs["gk"]):
        assert 1e-4 < e_gk < 1.1 * e_rs, errs
