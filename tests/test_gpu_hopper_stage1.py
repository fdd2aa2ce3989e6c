"""Stage 1 of the Hopper forward alone (chunk-local cumsum and the gated inverse, ``kkt_inverse``) against the float64
oracle, and its builds against each other (GPU only). Apart from ``test_gpu_hopper_forward.py``, whose tests run on
every chunk loop: stage 1 does not depend on the loop, so these run once. Outputs are filled with NaN first.
"""
import pytest
import torch

from flashgdn.reference import chunked as ref

from helpers import make_inputs, rel_rms

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def poisoned(monkeypatch, cuda):
    from flashgdn.kernels.hopper import forward

    monkeypatch.setattr(forward, "POISON_OUTPUTS", True)


def inputs(seqlens, Hqk=2, Hv=4, **kw):
    return make_inputs(seqlens=seqlens, Hqk=Hqk, Hv=Hv, K=128, V=128, dtype=torch.bfloat16, device="cuda", **kw)


# ---------------------------------------------------------------------------------------------------------
# stage 1 alone: chunk-local cumsum and the gated inverse


@pytest.mark.parametrize("heads", [(2, 8), (2, 6), (3, 3)])  # value heads inverted two at a time, or one
@pytest.mark.parametrize("seqlens", [[64], [1], [63, 65, 200], [1000, 3, 130]])
def test_kkt_inverse_stage(seqlens, heads):
    from flashgdn.kernels.hopper.forward import hopper_forward

    inp = inputs(seqlens, Hqk=heads[0], Hv=heads[1], gate="mixed")
    _, _, mid = hopper_forward(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], 128 ** -0.5,
                               inp["initial_state"], True, inp["cu_seqlens"], False, return_intermediates=True)
    cu = inp["cu_seqlens"]
    n = int(cu[-1])
    gc_ref = ref.chunk_local_cumsum(inp["g"].double(), cu)
    A_ref = ref.kkt_inverse(inp["k"].double(), inp["beta"].double(), cu)
    Ag_ref = ref.gated_inverse(A_ref, gc_ref, inp["beta"].double(), cu)
    assert rel_rms(mid["gcum"][:, :n], gc_ref[:, :n]) < 1e-6
    assert rel_rms(mid["Ag"][:, :n], Ag_ref[:, :n]) < 5e-3


def stage1_outputs_of_builds(seqlens, Hv, store_inverse, builds):
    """g~, Ag (and A with ``store_inverse``) of the live chunk slots from ``build_kkt_inverse(2, Hv, ...)`` with each
    of ``builds`` (keyword options), on the same inputs with 7 tokens of padding after the last sequence, outputs
    filled with NaN first: one list of tensors per build."""
    from flashgdn.kernels.hopper.forward import chunk_plan
    from flashgdn.kernels.hopper.kkt_inverse import build_kkt_inverse

    inp = inputs(seqlens, Hqk=2, Hv=Hv, gate="mixed")
    k, cu = inp["k"], inp["cu_seqlens"]
    T, N = k.shape[1] + 7, len(seqlens)  # 7 tokens of padding after the last sequence
    pad = lambda x: torch.cat([x, torch.randn_like(x[:, :7])], dim=1).contiguous()  # noqa: E731
    k, g, beta = pad(k), pad(inp["g"].float()), pad(inp["beta"].float())
    bounds, _ = chunk_plan(cu, T, N)
    S = bounds.shape[0]
    live = bounds[:, 1] > 0
    outs = []
    for opts in builds:
        gcum = torch.full((Hv, S * 64), float("nan"), device="cuda")
        Ag = torch.full((S, Hv, 64, 64), float("nan"), device="cuda", dtype=k.dtype)
        args = [k, g, beta, bounds, gcum, Ag]
        if store_inverse:
            args.append(torch.full_like(Ag, float("nan")))
        build_kkt_inverse(2, Hv, 128, "bfloat16", "bfloat16", store_inverse=store_inverse, **opts)(*args)
        outs.append([gcum.view(Hv, S, 64)[:, live], Ag[live]] + ([args[-1][live]] if store_inverse else []))
    return outs


def assert_same_finite_bits(outs):
    for a, b in zip(*outs):
        assert torch.isfinite(a.float()).all()
        assert torch.equal(a, b)


@pytest.mark.parametrize("seqlens", [[64], [1], [63, 65, 200], [1000, 3, 130]])
@pytest.mark.parametrize("store_inverse", [False, True])
def test_kkt_inverse_async_loads_give_the_same_bits(seqlens, store_inverse):
    """Stage 1 with k's tile by cp.async: the same g~, Ag (and A) bits as with register-staged loads, partial chunks
    and the last chunk past the tensor's end included (a padded tail after the last sequence)."""
    assert_same_finite_bits(stage1_outputs_of_builds(seqlens, 4, store_inverse,
                                                     [dict(async_loads=False), dict(async_loads=True)]))


@pytest.mark.parametrize("seqlens", [[64], [63, 65, 200], [1000, 3, 130]])
@pytest.mark.parametrize("store_inverse", [False, True])
@pytest.mark.parametrize("Hv", [2, 4, 6, 8])
def test_kkt_inverse_at_five_ctas_per_sm_gives_the_same_bits(seqlens, store_inverse, Hv):
    """Stage 1 built for five CTAs per SM (``blocks_per_sm=5``: each head's A21 gated right after its merge, from
    the merge's second tile): the same g~, Ag (and A) bits as the default build, for groups of one to four value
    heads (odd ones included), partial chunks and a padded tail."""
    assert_same_finite_bits(stage1_outputs_of_builds(seqlens, Hv, store_inverse,
                                                     [dict(async_loads=True), dict(async_loads=True, blocks_per_sm=5)]))


@pytest.mark.parametrize("seqlens", [[64], [1], [63, 65, 200], [1000, 3, 130]])
@pytest.mark.parametrize("store_inverse", [False, True])
def test_kkt_inverse_of_an_odd_group_at_more_ctas_per_sm_gives_the_same_bits(seqlens, store_inverse, monkeypatch):
    """``forward.KKT_ODD_GROUP_BLOCKS``: stage 1 of a group of one (Hqk = Hv = 2) built for the CTAs per SM of
    ``forward.ODD_GROUP_BLOCKS_PER_SM`` (7): the same code at a lower register cap, so the same g~, Ag (and A) bits as
    the default five-per-SM build, partial chunks and a padded tail included; and the operator's stage 1 asks for
    that build under the switch."""
    from flashgdn.kernels.hopper import forward

    blocks = forward.ODD_GROUP_BLOCKS_PER_SM[(1, store_inverse)]
    five = dict(async_loads=True, blocks_per_sm=5, diag16=True, mma32=True)
    builds = [five, dict(five, blocks_per_sm=blocks)]
    assert_same_finite_bits(stage1_outputs_of_builds(seqlens, 2, store_inverse, builds))
    monkeypatch.setattr(forward, "KKT_ODD_GROUP_BLOCKS", True)
    assert forward._kkt_build_options(1, store_inverse)["blocks_per_sm"] == blocks


@pytest.mark.parametrize("seqlens", [[64], [1000, 3, 130]])
@pytest.mark.parametrize("store_inverse", [False, True])
@pytest.mark.parametrize("Hv", [2, 4, 6, 8])
def test_kkt_inverse_triangle_gives_the_same_bits(seqlens, store_inverse, Hv):
    """Stage 1 with ``triangle`` (the substitution's warps skip the zero rows above a column): the same g~, Ag (and A)
    bits as the five-per-SM build without it, for groups of one to four value heads, partial chunks and a padded
    tail."""
    five = dict(async_loads=True, blocks_per_sm=5)
    assert_same_finite_bits(stage1_outputs_of_builds(seqlens, Hv, store_inverse, [five, dict(five, triangle=True)]))


@pytest.mark.parametrize("seqlens", [[64], [1], [63, 65, 200], [1000, 3, 130]])
@pytest.mark.parametrize("Hv", [2, 4, 6, 8])
@pytest.mark.parametrize("build", ["diag16", "diag16+mma32", "diag16+mma32+registers16", "diag16+registers16",
                                   "diag16+mma32+registers16+merge16_registers",
                                   "diag16+mma32+registers16+merge16_registers+merge32_registers",
                                   "diag16+mma32+registers16+merge16_registers+merge32_quadrants",
                                   "diag16+mma32+registers16+registers8",
                                   "diag16+mma32+registers16+registers8+merge16_registers+merge32_quadrants"])
def test_kkt_inverse_diag16_against_the_oracle(build, seqlens, Hv):
    """Stage 1 with ``diag16`` (the diagonal in 16x16 blocks, merged to 32x32 by tf32 mma), alone and with ``mma32``
    (the 32x32 merge by warp mma too), either with ``registers16`` (the 16x16 blocks by elimination in registers,
    and then ``merge16_registers``, their 16 -> 32 merges by fp16 mma from those registers, and ``merge32_registers``,
    the 32 -> 64 merge the same way), or with ``merge32_quadrants`` (the 32 -> 64 merge by fp16 mma, a quadrant a
    warp), or with ``registers8`` (the 16x16 blocks from 8x8 ones, merged in registers):
    g~ with the bits of the build without it; Ag and the stored A against the float64 oracle within 5e-3 and no more
    than 1.25x the error of the ``triangle`` build (its tf32 products round below Ag's and A's bf16 storage), for
    groups of one to four value heads, partial chunks and a padded tail."""
    from flashgdn.kernels.hopper.forward import chunk_plan, slots_to_tokens

    five = dict(async_loads=True, blocks_per_sm=5)
    opts = dict(five, **{flag: True for flag in build.split("+")})
    base, new = stage1_outputs_of_builds(seqlens, Hv, True, [dict(five, triangle=True), opts])
    assert torch.equal(base[0], new[0])
    inp = inputs(seqlens, Hqk=2, Hv=Hv, gate="mixed")
    cu = inp["cu_seqlens"]
    n = int(cu[-1])
    gc_ref = ref.chunk_local_cumsum(inp["g"].double(), cu)
    A_ref = ref.kkt_inverse(inp["k"].double(), inp["beta"].double(), cu)
    Ag_ref = ref.gated_inverse(A_ref, gc_ref, inp["beta"].double(), cu)
    bounds, _ = chunk_plan(cu, n + 7, len(seqlens))
    live_bounds = bounds[bounds[:, 1] > 0]
    for got_base, got_new, want in ((base[1], new[1], Ag_ref), (base[2], new[2], A_ref)):
        assert torch.isfinite(got_new.float()).all()
        # [S, Hv, 64, 64] -> [S, 64 rows, Hv, 64] -> token order [n, Hv, 64]
        tok = lambda x: slots_to_tokens(x.transpose(1, 2), live_bounds, n + 7)[:n]  # noqa: E731
        err_base = rel_rms(tok(got_base), want[0, :n])
        err_new = rel_rms(tok(got_new), want[0, :n])
        assert err_new < 5e-3 and err_new <= 1.25 * err_base, (err_new, err_base)


@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])  # a group of one (seven CTAs an SM) and of two (pairs)
def test_kkt_inverse_trace_build_gives_the_same_bits_and_ordered_stamps(heads):
    """The trace build (``trace=True``, benchmarks/stage1_trace.py) makes the default build's Ag and g~ bit for bit
    (it only adds the stamps and one barrier), every CTA of a real chunk stamps every point, in order, and an idle
    slot's CTA stamps only its start."""
    from flashgdn.kernels.hopper.forward import KKT_ASYNC_LOADS, _kkt_build_options, chunk_plan
    from flashgdn.kernels.hopper.kkt_inverse import TRACE_POINTS, build_kkt_inverse

    Hqk, Hv = heads
    inp = inputs([700, 64, 9], Hqk=Hqk, Hv=Hv, gate="mixed")
    k = inp["k"]
    g, beta = inp["g"].float().contiguous(), inp["beta"].float().contiguous()
    cu = inp["cu_seqlens"].to(torch.int32)
    bounds, _ = chunk_plan(cu, k.shape[1], 3)  # without the host copy: idle slots at the end
    S = bounds.shape[0]
    opts = dict(async_loads=KKT_ASYNC_LOADS, **_kkt_build_options(Hv // Hqk))

    def run(trace):
        gc = torch.full((Hv, S * 64), float("nan"), device="cuda")
        ag = torch.full((S, Hv, 64, 64), float("nan"), device="cuda", dtype=k.dtype)
        tr = torch.zeros((S, Hqk, TRACE_POINTS), dtype=torch.int64, device="cuda")
        build_kkt_inverse(Hqk, Hv, 128, "bfloat16", "bfloat16", trace=trace, **opts)(
            k, g, beta, bounds, gc, ag, *([tr] if trace else []))
        return gc, ag, tr.cpu()

    gc0, ag0, _ = run(False)
    gc1, ag1, tr = run(True)
    real = bounds[:, 1].cpu() > 0
    assert int(real.sum()) == 11 + 1 + 1 and S > 13  # 700 = 10 chunks and a partial one; 64; 9
    assert torch.equal(gc0.view(Hv, S, 64)[:, real], gc1.view(Hv, S, 64)[:, real])
    assert torch.equal(ag0[real].view(torch.int16), ag1[real].view(torch.int16))
    busy = tr[real]
    assert bool((busy > 0).all()) and bool((busy[..., 1:] >= busy[..., :-1]).all())
    idle = tr[~real]
    assert bool((idle[..., 0] > 0).all()) and bool((idle[..., 1:] == 0).all())
