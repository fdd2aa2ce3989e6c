"""Every Hopper kernel variant compiles for sm_90a on this machine (no GPU needed), without local-memory spills,
without ptxas serialising its wgmma, within the shared memory an SM90 CTA may have, and with no CTA barrier inside a
branch on the thread index.

Registers and spills come from ``ptxas -v`` on each kernel's PTX, made with the flags TileLang builds its library
with (fast math), and the code size from the cubin; all are printed in the summary (``pytest -rA`` or ``-s``). A spill is a failure unless it is listed in ``EXPLAINED_SPILLS`` with its reason.
"""
import os
import re
import shutil

import pytest

tilelang = pytest.importorskip("tilelang", reason="the Hopper kernels need TileLang (pip install -e .[hopper])")

if shutil.which("nvcc") is None:  # TileLang compiles with nvcc; the CI image has it
    pytest.skip("nvcc is not on the PATH: TileLang cannot compile kernels here", allow_module_level=True)

os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")

from flashgdn.kernels.hopper.common import (  # noqa: E402
    MAX_SMEM_SM90, barriers_in_thread_branches, launch_values, resource_usage)
from flashgdn.kernels.hopper.variants import backward_variants, build, forward_variants  # noqa: E402

#: kernel-name prefix -> why a spill there is accepted
EXPLAINED_SPILLS = {
    "state_grad_walk[2/8,bfloat16,dht=0,staged,precise]":
        "4 bytes in the opt-in precise mode's walk from a zero end gradient (three-term operands at the register "
        "split 200/72/40; every other split tried spills more, and the walk from dht has none)",
    "chunk_forward_rso[":
        "16 bytes in the producer warpgroup (32 registers): its address arithmetic since v's swizzled tile is loaded "
        "as two 64-column TMA boxes, reloaded once per chunk (8 bytes before the output path was trimmed, whose "
        "code is the producer's own; lean_output); the state and output paths have no spills, and the swizzle made "
        "the loop 0.85x-0.98x (stages-hopper-v0.12b.json)",
    "chunk_forward_rso_lean_state[":
        "the same 16 bytes in the producer warpgroup, in the rso loop with its state paths' column factors in "
        "registers too (the A/B of forward.RSO_LEAN_STATE)",
    "fused_backward[":
        "40-76 bytes of loop-invariant values (up to nine of the value side: the addresses of its staged stores, and "
        "four of the gate side) stored once before the chunk loop and reloaded a few times per chunk, and one or two "
        "values stored and reloaded within a chunk (read in the SASS); nothing of the accumulators. The options add: "
        "lean_gates (backward.FUSED_LEAN_GATES, the default wherever P is not given) up to 92/124, two more gate-side "
        "values stored and one reloaded once a chunk; p_given 52/84; fold_mma 84/100 beside lean_gates (100/116 in the "
        "operator's 8/24 build); pair_sums up to 100/116 at 2/8 (the operator's 2/8 build too), 116/132 in the operator's 12/24 build and 76/92 in its "
        "16/32 build (pair sums, P given, the gate side's fold); cluster_sum "
        "(backward.FUSED_CLUSTER_SUM, a memory option, off) up to 212/244: the producer warps' exchange at their 40 "
        "registers (its loop-carried addresses and the sums' 16-byte vectors); ag_from_a (backward.FUSED_AG_FROM_A, "
        "an A/B) 188/240 at 2/8 and 4/16, 204/256 with pair sums, 184-188/252-344 at 16/32 and 172-180/260-352 at "
        "16/64 (~100-150 more than the same builds without it), from the producer's 128 threads that gate A at their "
        "40 registers (a block's indices and a 16-byte piece each; one warp gating in 9 steps spilled 172/208 at 4/16, "
        "unrolled three steps 196/324), not read in the SASS. (These are the fast-math builds that run; the report read PTX made without fast math before notes v0.32c, a few to 28 bytes apart.)",
    "fused_backward_trace[":
        "the fused backward's trace build (a diagnostic, benchmarks/fused_backward_trace.py): the default build's "
        "loop invariants and the stamps' addresses",
    "chunk_forward_rso_trace[":
        "the same 16 bytes in the producer warpgroup, in the rso loop's trace build (a diagnostic, "
        "benchmarks/rso_trace.py)",
    "chunk_forward_fused_trace_registers[":
        "the fused loop's trace build with the register-level inverse (a diagnostic, benchmarks/fused_trace.py): its "
        "build's spill, 68/68 bytes with the stamps (76/76 before K K^T by halves)",
    "chunk_forward_fused_registers[":
        "60-68/80-88 bytes (32/32, 2/8, either dtype) in the \"fused\" loop's A/B with the register-level inverse "
        "(forward.FUSED_REGISTER_INVERSE, off): the gate warpgroup at its 96 registers, which every other split of the "
        "512 pays for elsewhere (192/88/40 "
        "92/108, 192/80/48 136/136, 192/104/24 76/92 with the producer's; 184/112/32 serialises the state paths' "
        "wgmma); without registers8 40/60 (before K K^T by halves of its columns, 68/84 here). Measured before any "
        "register work on it (notes v0.39a)",
    "chunk_forward_fused_state_p[":
        "4 bytes in the \"fused\" loop's A/B with P made by the state paths (forward.FUSED_STATE_P, off) at 192/96/32: "
        "one value of the gate warpgroup's prologue (at 32/32 its one store and one load are before its chunk loop, "
        "read in the SASS by benchmarks/sass_static.py), at its 96 registers beside the state paths' 192; "
        "every other split tried spills more (200/88/24 44/44, 192/104/24 16/16, 192/88/40 36/56; 184/112/32 "
        "serialises the state paths' wgmma), and keeping Vn^T diag(d) out of O^T's GEMM leaves the 4 bytes (notes "
        "v0.41a)",
    "chunk_forward_fused_trace_state_p[":
        "the same build's trace (a diagnostic, benchmarks/fused_trace.py)",
    "chunk_forward_fused_state_p_swizzled[":
        "20 bytes in state_p's A/B with v's tile swizzled (notes v0.41b, traced by benchmarks/fused_trace.py only): the "
        "swizzled reads' address arithmetic on the state paths at their 192 registers, beside state_p's own 4",
    "chunk_forward_fused_trace_state_p_swizzled[":
        "the same 20 bytes in its trace build (a diagnostic)",
    "chunk_forward_fused_state_p_registers[":
        "36 bytes in state_p's A/B with the register inverse (notes v0.41b): the register pieces in the gate warpgroup "
        "at its 96 registers (80 before K K^T was made by halves of its columns, a 16-register accumulator; notes "
        "v0.41c)",
    "chunk_forward_fused_trace_state_p_registers[":
        "the same 36 bytes in its trace build (a diagnostic)",
    "chunk_forward_fused_state_p_registers_swizzled[":
        "40 bytes in state_p with both options (forward.FUSED_REGISTER_INVERSE and FUSED_SWIZZLED_V, off): the register "
        "inverse's in the gate warpgroup; the state paths' 20 of the swizzled build alone are gone at the same 192 "
        "registers (read in the SASS by benchmarks/sass_static.py at 32/32: 12 spill instructions in the gate's step, "
        "none before it, none in the state paths; 80 bytes and 26 in the step before K K^T by halves)",
    "chunk_forward_fused_trace_state_p_registers_swizzled[":
        "the same 40 bytes in its trace build (a diagnostic)",
    "chunk_forward_uw[":
        "4 bytes in the uw chunk loop (forward.CHUNK_LOOP=uw, an A/B loop, not the default) with fast math, the build "
        "that runs (none in PTX made without it, which the report read before notes v0.32c); not read in the SASS",
    "chunk_forward_rso_plain[":
        "8 bytes in the same producer warpgroup, in the rso loop without its trimmed output path (the A/B of "
        "forward.RSO_LEAN_OUTPUT)",
}

#: kernel-name prefix -> why ptxas serialising its wgmma is accepted there (C7512: too few registers for the wgmma
#: pipeline, so every GEMM waits on itself)
EXPLAINED_SERIALISED = {
    name: "an A/B position of the gate-side switches (backward.FUSED_LEAN_GATES and FUSED_P_FIRST forced off, or "
          "cluster_sum without them): where the gate side makes P, ptxas serialises the builds without lean_gates at "
          "144 registers (with no option at 2/8, also at v0.16o, 4/16, 16/16 and 8/24; with the fold at 8/24 to "
          "16/32), so the operator takes the gate-side options wherever P is not given (notes v0.32c)"
    for dtype in ("bfloat16", "float16")
    for name in (f"fused_backward[2/8,{dtype},dht=1]", f"fused_backward[2/8,{dtype},dht=0]",
                 f"fused_backward[2/8,{dtype},dht=1,first_apart]", f"fused_backward[2/8,{dtype},dht=0,first_apart]",
                 f"fused_backward[2/8,{dtype},dht=1,p_first]", f"fused_backward[2/8,{dtype},dht=1,cluster_sum]")
}


def _operator_fused_backward(Hqk, Hv):
    """The fused backward as the operator builds it for ``Hqk/Hv`` (``backward.fused_backward_options``), tagged."""
    from flashgdn.kernels.hopper.variants import training_variants

    return [(name.replace("]", ",operator]"), builder, kwargs)
            for name, builder, kwargs in training_variants(Hqk, Hv, flags="common")
            if builder == "fused_backward" and kwargs["has_final_grad"]]


VARIANTS = (list(forward_variants(2, 8, dtype="bfloat16")) + list(forward_variants(2, 8, dtype="float16", flags="common"))
            + list(backward_variants(2, 8, dtype="bfloat16")) + list(backward_variants(2, 8, dtype="float16"))
            # the build only groups of two have
            + [v for v in backward_variants(2, 4, dtype="bfloat16") if v[0].endswith(",pairs]")]
            # stage 1's default builds for an odd group (one head at a time, the upper 64 threads at the barriers only),
            # and at more CTAs per SM (forward.KKT_ODD_GROUP_BLOCKS)
            + [v for heads in ((1, 3), (1, 1)) for v in list(forward_variants(*heads, dtype="bfloat16", flags="common"))
               + list(backward_variants(*heads, dtype="bfloat16")) if v[0].startswith("kkt_inverse") and "mma32" in v[0]]
            # the fused backward as the operator builds it at 8/24 (below the P pass's 32 value heads the gate side
            # makes P, with the gate options), at 2/8 (the same with pair sums in a group of four) and at 16/32 (P
            # given, pair sums, the gate side's fold)
            + _operator_fused_backward(8, 24) + _operator_fused_backward(2, 8) + _operator_fused_backward(16, 32))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v[1] == "chunk_grad"],
                         ids=[v[0] for v in VARIANTS if v[1] == "chunk_grad"])
def test_chunk_grad_grid_keeps_the_slots_on_x(variant):
    """The chunk slots (about T / 64, unbounded) are the grid's x dimension, whose limit is 2^31 - 1, in every
    ``chunk_grad`` build, ``heads_inner`` included (it reorders blocks by their linear id, not by swapping the
    grid's dimensions: y stops at 65535 blocks, i.e. 4.2M tokens)."""
    name, builder, kwargs = variant
    values = launch_values(build(builder, kwargs))
    assert values[-6:-1] == ["num_slots", str(kwargs["Hv"]), "512", "1", "1"], (name, values[-8:])


@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_kernel_compiles_for_sm90a_without_spills(variant, capsys):
    name, builder, kwargs = variant
    kernel = build(builder, kwargs)
    src = kernel.get_kernel_source()
    if builder not in ("chunk_plan", "segment_index", "chain_index", "splice", "group_sum", "chunk_emits",
                       "walk_covers"):
        # no GEMM in these (index arithmetic; the splice: float32 FMAs; the group sum: additions; the emission pass
        # and the walks' covers: row norms and shuffles)
        assert "wgmma" in src, f"{name}: no wgmma in the generated source (tensor cores not used)"
    # a CTA barrier that only some warps reach (TileLang puts one in any branch with a shared-memory hazard of its own)
    assert not barriers_in_thread_branches(src), f"{name}: __syncthreads() inside a branch on the thread index " \
        f"(line, branch): {barriers_in_thread_branches(src)}"
    res = resource_usage(kernel)
    with capsys.disabled():
        print(f"\n  {name}: {res['registers']} registers, spill stores {res['spill_stores']} B, "
              f"spill loads {res['spill_loads']} B, stack {res['stack']} B, shared memory {res['dynamic_smem']} B, "
              f"{res['instructions']} SASS instructions")
    # the report is of the code that runs: ptxas on the PTX made with the library build's flags gives the library's code
    assert res["library_instructions"] == res["instructions"], \
        f"{name}: {res['instructions']} SASS instructions from the PTX, {res['library_instructions']} in the library"
    spilled = res["spill_stores"] or res["spill_loads"]
    if spilled and not any(name.startswith(p) for p in EXPLAINED_SPILLS):
        pytest.fail(f"{name} spills to local memory: {res}")
    assert res["registers"] <= 255
    explained = any(name.startswith(p) for p in EXPLAINED_SERIALISED)
    assert res["wgmma_serialized"] == explained, f"{name}: ptxas serialised its wgmma (a GEMM in flight across " \
        "code that touches its accumulators, or too few registers for it)" if not explained else \
        f"{name}: no longer serialised by ptxas; take it out of EXPLAINED_SERIALISED"
    # setmaxnreg moves a warpgroup from the launch's register count up (.inc) or down (.dec), never the other way:
    # a .dec to more registers is an illegal instruction at run time
    for kind, count in re.findall(r"warpgroup_reg_(alloc|dealloc)<(\d+)>", src):
        if kind == "alloc":
            assert int(count) >= res["registers"], f"{name}: setmaxnreg.inc to {count} < {res['registers']} at launch"
        else:
            assert int(count) <= res["registers"], f"{name}: setmaxnreg.dec to {count} > {res['registers']} at launch"
    # a launch asking for more than an SM90 CTA may have fails at run time, not at compile time
    assert res["dynamic_smem"] is not None, f"{name}: shared memory size not found in the launch code"
    # the launch asks for the dynamic size; the driver refuses it unless static + dynamic fit the 227 KB
    total = res["dynamic_smem"] + res["static_smem"]
    assert total <= MAX_SMEM_SM90, f"{name}: {res['dynamic_smem']} + {res['static_smem']} B of shared memory > " \
                                   f"{MAX_SMEM_SM90}"


def test_cluster_sum_is_checked_and_launches_clusters_of_the_group():
    """``cluster_sum`` is built for groups of 2 to 8 only (a clear error before anything compiles), and its build
    launches the group's value heads as one cluster: the device code has the cluster exchange, the default build
    none of it."""
    from flashgdn.kernels.hopper.fused_backward import build_fused_backward

    with pytest.raises(AssertionError, match="group of 2 to 8"):
        build_fused_backward(2, 2, 128, 128, "bfloat16", True, cluster_sum=True)
    with pytest.raises(AssertionError, match="group of 2 to 8"):
        build_fused_backward(1, 16, 128, 128, "bfloat16", True, cluster_sum=True)
    src = build_fused_backward(2, 8, 128, 128, "bfloat16", True, cluster_sum=True).get_kernel_source()
    # dq's and dk's rows sent from the chunk loop and again for the last chunk after it
    assert src.count("flashgdn_cluster::push_rows(") == 4 and "cluster_sync" in src
    assert "flashgdn_cluster" not in build_fused_backward(2, 8, 128, 128, "bfloat16", True).get_kernel_source()


def test_fold_mma_folds_by_the_tensor_cores_on_either_side():
    """``fold_mma`` makes <dS', S> by two m64n64 wgmma groups on dS'^T's and S^T's halves, where the default build
    has none of that shape in its fold: on the value side, and beside ``p_given`` on the gate side, which waits for
    dS'^T there (the build without the fold does not) and hands the row sums to dg through a vector of its own."""
    from flashgdn.kernels.hopper.fused_backward import build_fused_backward

    from flashgdn.kernels.hopper.common import resource_usage

    m64n64 = "tl::DataType::kFloat32, 64, 64, 16"
    for given in (False, True):
        # the 2/8 builds of backward_variants (the operator's options there), and the fold beside p_given
        opts = dict(p_first=True, lean_gates=True, first_apart=True, p_given=given)
        plain = build_fused_backward(2, 8, 128, 128, "bfloat16", True, **opts).get_kernel_source()
        kernel = build_fused_backward(2, 8, 128, 128, "bfloat16", True, fold_mma=True, **opts)
        folded = kernel.get_kernel_source()
        if given:  # (the variants' test checks the others' registers)
            usage = resource_usage(kernel)
            assert not usage["wgmma_serialized"] and usage["spill_stores"] <= 100, usage
        assert folded.count(m64n64) == plain.count(m64n64) + 2, given
        # the second group reads both tiles from their second half of V's rows (64 rows of 128 bytes on)
        assert folded.count("(&(((bfloat16_t*)ds_s)[0])) + 8192)") == 1, given
        assert folded.count("(&(((bfloat16_t*)st_s)[0])) + 8192)") == 1, given
        # ds_ready is waited on by the value side, and by the gate side only where it folds
        assert folded.count("ds_ready[0].wait(") == plain.count("ds_ready[0].wait(") + int(given), given
        assert ("xf_s" in folded) == given and "xf_s" not in plain, given


def test_pair_sums_is_checked_and_adds_the_rows_by_vector_reductions():
    """``pair_sums`` is built for even groups only (a clear error before anything compiles), not beside
    ``cluster_sum``; its build adds dq's and dk's rows with the 16-byte reduction of its io dtype, and the default
    build has none."""
    from flashgdn.kernels.hopper.fused_backward import build_fused_backward

    with pytest.raises(AssertionError, match="even group"):
        build_fused_backward(2, 2, 128, 128, "bfloat16", True, pair_sums=True)
    with pytest.raises(AssertionError, match="even group"):
        build_fused_backward(2, 6, 128, 128, "bfloat16", True, pair_sums=True)
    with pytest.raises(AssertionError, match="not cluster_sum"):
        build_fused_backward(2, 8, 128, 128, "bfloat16", True, pair_sums=True, cluster_sum=True)
    for dtype, helper in (("bfloat16", "bf16"), ("float16", "f16")):
        src = build_fused_backward(2, 8, 128, 128, dtype, True, p_first=True, lean_gates=True, first_apart=True,
                                   pair_sums=True).get_kernel_source()
        # dq's rows, then dk's, each by the helper of the io dtype (``red.global.add.noftz.v4.{bf16x2,f16x2}``)
        assert src.count("flashgdn_pairs::add_16_bytes_") == 2
        assert src.count(f"flashgdn_pairs::add_16_bytes_{helper}(") == 2
        assert f"red.global.add.noftz.v4.{helper}x2" in src
    assert "flashgdn_pairs" not in build_fused_backward(2, 8, 128, 128, "bfloat16", True).get_kernel_source()


def test_p_given_builds():
    """``p_given`` (backward.FUSED_P_GIVEN) is checked before anything compiles: not beside ``cluster_sum``. Its
    build loads P by TMA with the second group and has neither the gate side's Q K^T nor a wait for its P; with the
    first states apart, P is the last argument after theirs, and in the trace build it comes before the stamps; the
    default build has none of it."""
    from flashgdn.kernels.hopper.fused_backward import build_fused_backward

    with pytest.raises(AssertionError, match="not built beside cluster_sum"):
        build_fused_backward(2, 8, 128, 128, "bfloat16", True, cluster_sum=True, p_given=True)
    traced = build_fused_backward(2, 8, 128, 128, "bfloat16", True, trace=True, p_given=True, fold_mma=True)
    params = [str(p.name) for p in traced.prim_func.params]
    assert len(params) == 21 and params[-2:] == ["p_in_handle", "tr_handle"], params
    assert "tma_load(p_in_desc, full_m[0]" in traced.get_kernel_source()
    base = build_fused_backward(2, 8, 128, 128, "bfloat16", True, p_first=True, lean_gates=True, first_apart=True)
    given = build_fused_backward(2, 8, 128, 128, "bfloat16", True, p_first=True, lean_gates=True, first_apart=True,
                                 p_given=True)
    src, base_src = given.get_kernel_source(), base.get_kernel_source()
    assert "tma_load(p_in_desc, full_m[0]" in src
    assert "p_ready[0].wait(" not in src and "p_ready[0].wait(" in base_src and "p_in" not in base_src
    # Q K^T (wgmma m64n64 of Q's and K's tiles) leaves the gate side: one 64x64 product fewer
    assert src.count("64, 64, 16, false, false") == base_src.count("64, 64, 16, false, false") - 1
    # the first states apart, then P: the plain signature's 19 arguments and three more, P last
    params = [str(p.name) for p in given.prim_func.params]
    assert len(params) == 22 and params[-3:] == ["first_states_handle", "shift", "p_in_handle"], params


def test_loop_and_stage1_options_are_checked():
    """Option combinations a build does not have are clear errors before anything compiles."""
    from flashgdn.kernels.hopper.chunk_forward_rs import build_chunk_forward_rs

    args = (2, 8, 128, 128, "bfloat16", True, True, False)
    with pytest.raises(ValueError, match="inverse_in_loop"):  # stage 1 in the loop needs the Kd tile
        build_chunk_forward_rs(*args, inverse_in_loop=True)
    with pytest.raises(ValueError, match="inverse_in_loop"):  # and an output (CP's passes read stage 1's tiles)
        build_chunk_forward_rs(*args, with_output=False, decayed_k=True, inverse_in_loop=True)
    with pytest.raises(ValueError, match="decayed_k"):
        build_chunk_forward_rs(*args, precise=True, decayed_k=True)
    with pytest.raises(ValueError, match="needs inverse_in_loop"):  # the register pieces make that loop's inverse
        build_chunk_forward_rs(*args, decayed_k=True, register_inverse=True)
    with pytest.raises(ValueError, match="state_p"):  # P on the state paths is a form of the fused loop
        build_chunk_forward_rs(*args, state_p=True)
    with pytest.raises(ValueError, match="state_p"):  # whose update decays Vn^T, not K
        build_chunk_forward_rs(*args, decayed_k=True, inverse_in_loop=True, state_p=True)
    from flashgdn.kernels.hopper.fused_backward import build_fused_backward

    with pytest.raises(ValueError, match="longest_first"):  # its order rides with first_apart's arguments
        build_fused_backward(2, 8, 128, 128, "bfloat16", True, longest_first=True)
    with pytest.raises(ValueError, match="negligible_m"):  # its M items start from the identity it makes itself
        build_chunk_forward_rs(*args, with_output=False, transition_pairs=True, skip_unread="forward",
                               negligible_m=True)
    with pytest.raises(ValueError, match="late_b"):  # its starts come with the bounds' argument
        build_chunk_forward_rs(*args, with_output=False, transition_pairs=True, skip_unread="forward",
                               starts_from_h0=True, late_b=True)
    from flashgdn.kernels.hopper.chunk_forward_rso import build_chunk_forward_rso

    with pytest.raises(ValueError, match="regs"):  # the register split must add up to the register file
        build_chunk_forward_rso(*args, regs=(176, 128, 40))
    from flashgdn.kernels.hopper.kkt_inverse import build_kkt_inverse

    with pytest.raises(ValueError, match="take one"):
        build_kkt_inverse(2, 8, 128, "bfloat16", "bfloat16", diag16=True, triangle=True)
    with pytest.raises(ValueError, match="needs diag16"):  # the 32x32 merge reuses diag16's warp mma
        build_kkt_inverse(2, 8, 128, "bfloat16", "bfloat16", mma32=True)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v[1] == "kkt_inverse"],
                         ids=[v[0] for v in VARIANTS if v[1] == "kkt_inverse"])
def test_kkt_inverse_fits_the_occupancy_it_is_built_for(variant):
    """``kkt_inverse`` is latency-bound and built for a number of CTAs per SM (4, 5 by default, 6 or 7 for an odd
    group under forward.KKT_ODD_GROUP_BLOCKS): its registers
    (128 threads each) and shared memory (plus the 1 KB the driver reserves per CTA) must let that many share an
    SM's 64K registers and 228 KB."""
    name, builder, kwargs = variant
    per_sm = kwargs.get("blocks_per_sm", 4)
    res = resource_usage(build(builder, kwargs))
    allocated = -(-res["registers"] // 8) * 8  # registers are allocated per thread in steps of 8
    assert per_sm * 128 * allocated <= 65536, (name, res["registers"])
    assert per_sm * (res["dynamic_smem"] + 1024) <= 228 * 1024, (name, res["dynamic_smem"])
