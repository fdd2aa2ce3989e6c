"""The backward's numerics emulation (``benchmarks/numerics_backward.py``, CPU): without rounding it is the float64
backward (so the emulated stages, the walk's transposed forms included, are the right algebra), and with the
kernels' bf16 rounding points its gradients stay inside the bars of DESIGN.md §3."""
import pytest
import torch

from helpers import load_benchmark

nb = load_benchmark("numerics_backward")

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.mark.parametrize("gate", ["normal", "strong", "zero"])
def test_emulated_backward_without_rounding_is_the_float64_backward(gate):
    x = nb.inputs(300, 2, gate)
    want = nb.reference(*x, nb.K ** -0.5)
    want = [w[0, :, 0] if i < 2 else w[0] for i, w in enumerate(want)]
    got = nb.emulate(*x, nb.K ** -0.5, rnd=nb.exact)
    for n, a, w in zip(NAMES, got, want):
        assert nb.rel(a, w) < 1e-12, n


def test_emulated_bf16_backward_is_inside_the_bars():
    x = nb.inputs(700, 2, "zero")  # no decay: every rounding stays in the states
    want = nb.reference(*x, nb.K ** -0.5)
    want = [w[0, :, 0] if i < 2 else w[0] for i, w in enumerate(want)]
    got = nb.emulate(*x, nb.K ** -0.5, rnd=nb.bf16)
    for n, a, w in zip(NAMES, got, want):
        err = nb.rel(a, w)
        assert 1e-4 < err < nb.BARS[n], (n, err)  # rounded (not exact), and inside the bar


def test_emulated_backward_through_context_parallelism_is_the_same_backward():
    """The emulation's CP path (transitions, the two splices, the passes from the true states, as
    ``flashgdn/cp/backward.py``) without rounding: the backward without segments up to the splices' float32."""
    x = nb.inputs(700, 2, "zero")  # no decay: nothing of the splice's inputs fades
    plain = nb.emulate(*x, nb.K ** -0.5, rnd=nb.exact)
    for seg in (1, 3):
        got = nb.emulate(*x, nb.K ** -0.5, rnd=nb.exact, cp=seg)
        for n, a, w in zip(NAMES, got, plain):
            assert nb.rel(a, w) < 1e-6, (seg, n)


def test_emulated_precise_mode_closes_the_cp_gap_term_by_term(monkeypatch):
    """The precise mode's register operands (``--precise``): at g = 0, CP and no CP differ least with three bf16
    terms, more with two, most with one (bf16), on every gradient; each bf16 term adds about 9 bits to how
    closely the split sums back to its input (what each extra wgmma buys)."""
    x = nb.inputs(1024, 1, "zero")
    diffs = {}
    for terms, split in ((1, None), (2, nb.split2), (3, nb.split3)):
        monkeypatch.setitem(nb.REGISTER_OPERANDS, "rnd", split)
        plain = nb.emulate(*x, nb.K ** -0.5, rnd=nb.bf16)
        seg = nb.emulate(*x, nb.K ** -0.5, rnd=nb.bf16, cp=4)
        diffs[terms] = [nb.rel(a, b) for a, b in zip(seg, plain)]
    for i, n in enumerate(NAMES):
        assert diffs[3][i] < diffs[2][i] < diffs[1][i], (n, diffs)
    y = torch.randn(4096, dtype=torch.float64)
    assert 2.0 ** -10 < nb.rel(nb.bf16(y), y) < 2.0 ** -8
    assert 2.0 ** -20 < nb.rel(nb.split2(y), y) < 2.0 ** -17
    assert 2.0 ** -29 < nb.rel(nb.split3(y), y) < 2.0 ** -26


@pytest.mark.parametrize("gate", ["normal", "strong", "zero"])
def test_chained_g_last_term_is_the_folded_one_without_rounding(gate):
    """dg's g~_last term chained from chunk to chunk (``g_last="chain"``, notes v0.30a) is the same algebra as the
    fold of every chunk: without rounding they agree to float64, also restarted on CP segments and every few
    chunks."""
    x = nb.inputs(1024, 1, gate)
    scale = nb.K ** -0.5
    for kw in (dict(), dict(cp=3), dict(fold_every=4)):
        folded = nb.emulate(*x, scale, rnd=nb.exact, cp=kw.get("cp"))
        chained = nb.emulate(*x, scale, rnd=nb.exact, g_last="chain", **kw)
        for n, a, w in zip(NAMES, chained, folded):
            assert nb.rel(a, w) < 1e-9, (kw, n)


def test_chained_g_last_term_adds_up_its_rounding_along_the_walk():
    """With the kernels' bf16 rounding points the chain's dg is ~3x further from float64 than the fold's on 4096
    tokens (the row terms' rounding adds up along the walk; 8192 tokens put it over the bar, notes v0.30a): why the
    kernel folds every chunk (by the tensor cores since v0.30a) instead."""
    x = nb.inputs(4096, 2, "normal")
    scale = nb.K ** -0.5
    want = nb.reference(*x, scale)[3][0]
    fold_err = nb.rel(nb.emulate(*x, scale, rnd=nb.bf16)[3], want)
    chain_err = nb.rel(nb.emulate(*x, scale, rnd=nb.bf16, g_last="chain")[3], want)
    assert fold_err < nb.BARS["dg"] / 2 and chain_err > 2 * fold_err, (fold_err, chain_err)


@pytest.mark.parametrize("gate", ["normal", "strong", "zero"])
def test_row_terms_by_the_tensor_cores_move_dg_alone_and_little(gate):
    """v0.33a's ``row_mma`` build (measured and removed) rounded two of dg's row terms' operands (dW, scale gamma ⊙
    dO S^T) to bf16 for the tensor cores: emulated, every other gradient is the same (the same values feed them), and
    dg stays within 1.25x its error against float64 without it and far inside its bar (notes v0.33a). Without
    rounding the terms are the same algebra (the float64 backward)."""
    x = nb.inputs(2048, 2, gate, seed=2)
    scale = nb.K ** -0.5
    want = nb.reference(*x, scale)
    want = [w[0, :, 0] if i < 2 else w[0] for i, w in enumerate(want)]
    for n, a, w in zip(NAMES, nb.emulate(*x, scale, rnd=nb.exact, row_terms="mma"), want):
        assert nb.rel(a, w) < 1e-12, n
    plain = nb.emulate(*x, scale, rnd=nb.bf16)
    moved = nb.emulate(*x, scale, rnd=nb.bf16, row_terms="mma")
    for n, a, b in zip(NAMES, plain, moved):
        if n != "dg":
            assert torch.equal(a, b), n
    base, err = nb.rel(plain[3], want[3]), nb.rel(moved[3], want[3])
    assert base > 1e-4 and 0 < abs(err - base) and err < 1.25 * base and err < nb.BARS["dg"] / 2, (base, err)
