"""Every kernel configuration the Hopper forward (and the backward's existing stages) can ask for, for a head
configuration and dtype.

Used by ``python -m flashgdn.precompile`` (fill the kernel cache ahead of time) and by the compile tests.
"""
import itertools
from typing import Iterator, Tuple

from .forward import DEFAULT_BV, SPLICE_WIDTHS

# (name, builder name, keyword arguments)
Variant = Tuple[str, str, dict]


def forward_variants(Hqk: int, Hv: int, K: int = 128, V: int = 128, dtype: str = "bfloat16",
                     flags: str = "all") -> Iterator[Variant]:
    """The stage-1 kernel and every chunk-loop kernel (simple, ws, rs, rsd, fused, uw, rso) for every flag combination (``flags="all"``), or only
    the one a training/benchmark call uses (initial state in, final state out, K-major state: ``"common"``)."""
    yield ("chunk_plan", "chunk_plan", {})
    yield (f"kkt_inverse[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype))
    # k's tile by cp.async (forward.KKT_ASYNC_LOADS)
    yield (f"kkt_inverse_async[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, async_loads=True))
    # and each chunk's bound on its transition's log norm (context parallelism's transition pass with
    # backend.CP_NEGLIGIBLE_M_IN_KERNEL, an A/B; serving_variants adds the options when it is on)
    yield (f"kkt_inverse_async_bounds[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, async_loads=True, chunk_bounds=True))
    # and what each chunk's tokens inject, carried to its end (CP_LATE_B_IN_KERNEL, long segments)
    yield (f"kkt_inverse_async_bounds_injects[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, async_loads=True, chunk_bounds=True,
                chunk_injects=True))
    # five CTAs per SM (forward.KKT_BLOCKS_PER_SM, the default; the builds above are four per SM)
    yield (f"kkt_inverse_async_5[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, async_loads=True, blocks_per_sm=5))
    # with the substitution's columns split by where the work lies (forward.KKT_TRIANGLE, the build when
    # forward.KKT_DIAG16 is off)
    yield (f"kkt_inverse_async_5_triangle[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, async_loads=True, blocks_per_sm=5, triangle=True))
    # the diagonal in 16x16 blocks merged by tf32 mma (forward.KKT_DIAG16, with FLASHGDN_HOPPER_KKT_MMA32=0)
    yield (f"kkt_inverse_async_5_diag16[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, async_loads=True, blocks_per_sm=5, diag16=True))
    # and the 32x32 merge by warp mma as well (forward.KKT_DIAG16 and KKT_MMA32, the default: serving and training
    # variants add both to the build above)
    yield (f"kkt_inverse_async_5_diag16_mma32[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, async_loads=True, blocks_per_sm=5, diag16=True,
                mma32=True))
    # an odd group's build at more CTAs per SM (forward.KKT_ODD_GROUP_BLOCKS, the default), where it has one
    from .forward import ODD_GROUP_BLOCKS_PER_SM

    odd = ODD_GROUP_BLOCKS_PER_SM.get((Hv // Hqk, False))
    if odd:
        yield (f"kkt_inverse_async_{odd}_diag16_mma32[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
               dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, async_loads=True, blocks_per_sm=odd,
                    diag16=True, mma32=True))
    # the register-level inverse's A/Bs (notes v0.38a-e), at the default's occupancy: the 16x16 blocks by elimination
    # in registers (forward.KKT_REGISTERS16), the 16 -> 32 merges from them (KKT_MERGE16_REGISTERS), the 32 -> 64 merge
    # from registers (KKT_MERGE32_REGISTERS) or a quadrant a warp (KKT_MERGE32_QUADRANTS), the 16x16 blocks from 8x8
    # ones (KKT_REGISTERS8)
    registers = dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, async_loads=True, blocks_per_sm=odd or 5,
                     diag16=True, mma32=True, registers16=True)
    for suffix, options in (("registers16", {}),
                            ("registers16_merge16", dict(merge16_registers=True)),
                            ("registers16_merge16_merge32", dict(merge16_registers=True, merge32_registers=True)),
                            ("registers16_merge16_quadrants", dict(merge16_registers=True, merge32_quadrants=True)),
                            ("registers8", dict(registers8=True)),
                            ("registers8_merge16_quadrants",
                             dict(registers8=True, merge16_registers=True, merge32_quadrants=True))):
        yield (f"kkt_inverse_async_{odd or 5}_diag16_mma32_{suffix}[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
               dict(registers, **options))
    # the default build's trace build (benchmarks/stage1_trace.py), a diagnostic: never run by the operator
    yield (f"kkt_inverse_trace[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, async_loads=True, blocks_per_sm=odd or 5,
                diag16=True, mma32=True, trace=True))
    combos = itertools.product((True, False), repeat=3) if flags == "all" else [(True, True, False)]
    for has_h0, store_ht, v_first in combos:
        name = f"chunk_forward[{Hqk}/{Hv},{dtype},h0={int(has_h0)},ht={int(store_ht)},v_first={int(v_first)}]"
        yield (name, "chunk_forward",
               dict(Hqk=Hqk, Hv=Hv, K=K, V=V, BV=DEFAULT_BV, io_dtype=dtype, has_initial_state=has_h0,
                    store_final_state=store_ht, state_v_first=v_first))
        if has_h0 and store_ht and not v_first:
            # the state-only pass of context parallelism, and both in the precise mode
            modes = [("_state", False, False)]
            if dtype == "bfloat16":  # the precise mode is bf16-only (fp16 would spill at its register budget)
                modes += [("_precise", True, True), ("_state_precise", False, True)]
            for tag, wo, precise in modes:
                yield (name.replace("chunk_forward", "chunk_forward_rs" + tag), "chunk_forward_rs",
                       dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=True,
                            store_final_state=True, state_v_first=False, with_output=wo, precise=precise))
            # the state-only pass and the paired transitions with their column factors in registers (forward.LEAN_STATE_PASSES)
            yield (name.replace("chunk_forward", "chunk_forward_rs_state_lean"), "chunk_forward_rs",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=True, store_final_state=True,
                        state_v_first=False, with_output=False, lean=True))
            yield (name.replace("chunk_forward", "chunk_forward_rs_pairs_skip_forward_lean"), "chunk_forward_rs",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=True, store_final_state=True,
                        state_v_first=False, with_output=False, transition_pairs=True, skip_unread="forward",
                        lean=True))
            yield (name.replace("chunk_forward", "chunk_forward_rs_pairs"), "chunk_forward_rs",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=True,
                        store_final_state=True, state_v_first=False, with_output=False, transition_pairs=True))
            # the items the splices never read skipped (CP_SKIP_UNREAD); m_only: the backward whose starts are gathered
            # from the forward's (CP_REUSE_STARTS) reads no b
            for mode in ("forward", "backward", "m_only"):
                yield (name.replace("chunk_forward", f"chunk_forward_rs_pairs_skip_{mode}"), "chunk_forward_rs",
                       dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=True,
                            store_final_state=True, state_v_first=False, with_output=False, transition_pairs=True,
                            skip_unread=mode))
            # the start states made in the kernel (backend.CP_STARTS_IN_KERNEL, the default; with_switches adds it to the
            # builds above): one build of it compiled here, the same code in every mode
            yield (name.replace("chunk_forward", "chunk_forward_rs_pairs_skip_forward_h0"), "chunk_forward_rs",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=True, store_final_state=True,
                        state_v_first=False, with_output=False, transition_pairs=True, skip_unread="forward",
                        starts_from_h0=True))
            # and M stored as zero where its bound says it is below float32's range (backend.CP_NEGLIGIBLE_M, an A/B;
            # with_switches adds it to the builds above when on)
            yield (name.replace("chunk_forward", "chunk_forward_rs_pairs_skip_forward_h0_negligible"), "chunk_forward_rs",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=True, store_final_state=True,
                        state_v_first=False, with_output=False, transition_pairs=True, skip_unread="forward",
                        starts_from_h0=True, negligible_m=True))
            # the same with the bound summed in the kernel from stage 1's chunks (backend.CP_NEGLIGIBLE_M_IN_KERNEL)
            yield (name.replace("chunk_forward", "chunk_forward_rs_pairs_skip_forward_h0_chunk_bounds"),
                   "chunk_forward_rs",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=True, store_final_state=True,
                        state_v_first=False, with_output=False, transition_pairs=True, skip_unread="forward",
                        starts_from_h0=True, negligible_m=True, chunk_bounds=True))
            # and b started late from stage 1's per-chunk terms (CP_LATE_B_IN_KERNEL, long segments)
            yield (name.replace("chunk_forward", "chunk_forward_rs_pairs_skip_forward_h0_chunk_late_b"),
                   "chunk_forward_rs",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=True, store_final_state=True,
                        state_v_first=False, with_output=False, transition_pairs=True, skip_unread="forward",
                        starts_from_h0=True, negligible_m=True, chunk_bounds=True, chunk_late_b=True))
            # and b walked from its first chunk that float32 can see (backend.CP_LATE_B, an A/B beside it)
            yield (name.replace("chunk_forward", "chunk_forward_rs_pairs_skip_forward_h0_negligible_late_b"),
                   "chunk_forward_rs",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=True, store_final_state=True,
                        state_v_first=False, with_output=False, transition_pairs=True, skip_unread="forward",
                        starts_from_h0=True, negligible_m=True, late_b=True))
            # context parallelism's own kernels (FLASHGDN_HOPPER_CP_FUSED=1): the segment index, the splices
            for cu_dtype in ("int32", "int64"):
                yield (f"segment_index[{cu_dtype}]", "segment_index", dict(cu_dtype=cu_dtype))
            yield ("chain_index", "chain_index", {})
            for reverse in (False, True):
                yield (f"splice[{Hv},{'reverse' if reverse else 'forward'}]", "splice",
                       dict(Hv=Hv, K=K, V=V, reverse=reverse))
            # the forward splice on chains from known starts (the backward from the forward's segment starts)
            yield (f"splice_chains[{Hv},forward]", "splice", dict(Hv=Hv, K=K, V=V, reverse=False, chains=True))
            # the reverse splice's register-blocked builds (forward.SPLICE_BLOCKED, the default), one per column
            # width: which one runs depends on the number of sequences (forward.splice_width)
            for bv in SPLICE_WIDTHS:
                yield (f"splice_blocked{bv}[{Hv},reverse]", "splice",
                       dict(Hv=Hv, K=K, V=V, reverse=True, blocked=True, BV=bv))
            # each of them with the transition pass's flags of the M it stored as zero (backend.CP_NEGLIGIBLE_M_IN_KERNEL,
            # an A/B; with_switches adds the option to the builds above when it is on)
            for reverse in (False, True):
                yield (f"splice_m_zero[{Hv},{'reverse' if reverse else 'forward'}]", "splice",
                       dict(Hv=Hv, K=K, V=V, reverse=reverse, m_zero=True))
            yield (f"splice_chains_m_zero[{Hv},forward]", "splice",
                   dict(Hv=Hv, K=K, V=V, reverse=False, chains=True, m_zero=True))
            for bv in SPLICE_WIDTHS:
                yield (f"splice_blocked{bv}_m_zero[{Hv},reverse]", "splice",
                       dict(Hv=Hv, K=K, V=V, reverse=True, blocked=True, BV=bv, m_zero=True))
            yield (name.replace("chunk_forward", "chunk_forward_uw_state"), "chunk_forward_uw",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=True,
                        store_final_state=True, state_v_first=False, with_output=False))
        for loop in ("ws", "rs", "uw", "rso"):
            yield (name.replace("chunk_forward", f"chunk_forward_{loop}"), f"chunk_forward_{loop}",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=has_h0,
                        store_final_state=store_ht, state_v_first=v_first))
        if has_h0 and store_ht and not v_first:  # rso's output path untrimmed (forward.RSO_LEAN_OUTPUT=0, an A/B)
            yield (name.replace("chunk_forward", "chunk_forward_rso_plain"), "chunk_forward_rso",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=has_h0,
                        store_final_state=store_ht, state_v_first=v_first, lean_output=False))
            # the state paths' column factors in registers too (forward.RSO_LEAN_STATE, an A/B)
            yield (name.replace("chunk_forward", "chunk_forward_rso_lean_state"), "chunk_forward_rso",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=has_h0,
                        store_final_state=store_ht, state_v_first=v_first, lean_state=True))
            # its trace build (benchmarks/rso_trace.py), a diagnostic: never run by the operator
            yield (name.replace("chunk_forward", "chunk_forward_rso_trace"), "chunk_forward_rso",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=has_h0,
                        store_final_state=store_ht, state_v_first=v_first, trace=True))
        # rs with the decay in K's tile ("rsd"), with its output and (CP's pass) state-only; and with stage 1
        # inside the loop ("fused")
        for wo in (True, False) if has_h0 and store_ht and not v_first else (True,):
            yield (name.replace("chunk_forward", "chunk_forward_rsd" + "_state" * (not wo)), "chunk_forward_rs",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=has_h0,
                        store_final_state=store_ht, state_v_first=v_first, with_output=wo, decayed_k=True))
        # its inverse by substitution, or by stage 1's register pieces; P by the state paths (state_p)
        base = dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=has_h0, store_final_state=store_ht,
                    state_v_first=v_first, decayed_k=True, inverse_in_loop=True)
        state_p = {**base, "state_p": True, "decayed_k": False}
        builds = [("", base), ("_registers", {**base, "register_inverse": True}), ("_state_p", state_p)]
        if has_h0 and store_ht and not v_first and dtype == "bfloat16":
            # state_p's two A/Bs (notes v0.41b), alone and together: v's tile swizzled, the gate's inverse by the
            # register pieces
            builds += [("_state_p_swizzled", {**state_p, "swizzled_v": True}),
                       ("_state_p_registers", {**state_p, "register_inverse": True}),
                       ("_state_p_registers_swizzled", {**state_p, "register_inverse": True, "swizzled_v": True})]
        for tag, fused in builds:
            yield name.replace("chunk_forward", "chunk_forward_fused" + tag), "chunk_forward_rs", fused
            if has_h0 and store_ht and not v_first:  # its trace build (benchmarks/fused_trace.py), a diagnostic
                yield (name.replace("chunk_forward", "chunk_forward_fused_trace" + tag), "chunk_forward_rs",
                       dict(fused, trace=True))


def _is_splice(v: Variant) -> bool:
    """Whether ``v`` is a splice build the operator may run as ``forward.SPLICE_BLOCKED`` is set: the plain forward
    splice; every column width of the blocked reverse splice (the width follows the number of sequences), or the
    plain one when off. (The chains build is the backward's, under ``backend.CP_REUSE_STARTS``; the ``m_zero`` builds
    are these with ``with_switches``' option, not variants of their own.)"""
    from . import forward

    if "_m_zero[" in v[0]:
        return False
    if v[0].endswith(",forward]"):
        return v[0].startswith("splice[")
    return v[0].startswith("splice_blocked" if forward.SPLICE_BLOCKED else "splice[")


def with_switches(v: Variant) -> Variant:
    """A variant with the build options the host's switches add to it, as ``forward`` and ``backward`` pass them
    (``forward.rso_options`` for the rso loop, ``forward.lean_state_option`` for the rs loop but its decayed_k
    builds, and for the walk; ``starts_from_h0`` for the skipping transition passes under
    ``backend.CP_STARTS_IN_KERNEL``, and ``negligible_m`` for those under ``backend.CP_NEGLIGIBLE_M``, with
    ``late_b`` under ``backend.CP_LATE_B``, or ``chunk_bounds`` under ``backend.CP_NEGLIGIBLE_M_IN_KERNEL`` with the
    forward's ``chunk_late_b`` under ``backend.CP_LATE_B_IN_KERNEL``; ``m_zero`` for the splices under ``backend.CP_NEGLIGIBLE_M_IN_KERNEL``):
    what the operator then builds."""
    from . import backend, forward

    name, builder, kw = v
    if builder == "splice" and backend.CP_NEGLIGIBLE_M_IN_KERNEL and backend.CP_SKIP_UNREAD and \
            backend.CP_STARTS_IN_KERNEL:  # the pairs then carry the flags of the M stored as zero
        kw = {**kw, "m_zero": True}
    if builder == "chunk_forward_rso":
        kw = {**kw, **forward.rso_options()}
    elif builder == "kkt_inverse":
        kw = {**kw, **forward.kkt_options()}
        if kw.get("blocks_per_sm", 4) == forward.KKT_BLOCKS_PER_SM:  # the operator's occupancy for this group
            blocks = forward.kkt_blocks_per_sm(kw["Hv"] // kw["Hqk"], kw.get("store_inverse", False))
            kw = {**kw, **({} if blocks == 4 else dict(blocks_per_sm=blocks))}
    elif builder == "state_grad_walk" or builder == "chunk_forward_rs" and not kw.get("decayed_k", False):
        kw = {**kw, **forward.lean_state_option()}
        if kw.get("skip_unread") and backend.CP_STARTS_IN_KERNEL:
            kw["starts_from_h0"] = True
        if kw.get("starts_from_h0") and backend.CP_NEGLIGIBLE_M_IN_KERNEL:
            kw["negligible_m"] = kw["chunk_bounds"] = True
            if backend.CP_LATE_B_IN_KERNEL and kw.get("skip_unread") == "forward":  # (the forward's own pass)
                kw["chunk_late_b"] = True
        elif kw.get("starts_from_h0") and backend.CP_NEGLIGIBLE_M:
            kw["negligible_m"] = True
            if backend.CP_LATE_B:
                kw["late_b"] = True
    return name, builder, kw


def serving_variants(Hqk: int, Hv: int, K: int = 128, V: int = 128, dtype: str = "bfloat16",
                     flags: str = "all") -> Iterator[Variant]:
    """Only what the operator with its default settings can ask for: the chunk plan, stage 1, the default chunk
    loop for the flag combinations, and context parallelism's transition pass, which runs on twice the value
    heads (stage 1 and the rs state-only loop for ``Hqk/2Hv``), or on the paired kernel with
    FLASHGDN_HOPPER_CP_PAIRED=1. What a server precompiles; the other loops are for comparisons."""
    from . import backend, forward
    from .forward import DEFAULT_CHUNK_LOOP, KKT_ASYNC_LOADS, KKT_BLOCKS_PER_SM

    kkt = ("kkt_inverse_async" if KKT_ASYNC_LOADS else "kkt_inverse") + ("_5" if KKT_BLOCKS_PER_SM == 5 else "")
    wanted = {"chunk_plan", kkt, f"chunk_forward_{DEFAULT_CHUNK_LOOP}"}
    for v in forward_variants(Hqk, Hv, K, V, dtype, flags):
        if v[0].split("[")[0] in wanted:
            yield with_switches(v)
    # under CP_LATE_B_IN_KERNEL with a shortest length, segments shorter than it take the builds without it
    both_late = backend.CP_LATE_B_IN_KERNEL and backend.CP_LATE_B_MIN_CHUNKS > 0
    if backend.CP_PAIRED:
        pairs = "chunk_forward_rs_pairs_skip_forward[" if backend.CP_SKIP_UNREAD else "chunk_forward_rs_pairs["
        for v in forward_variants(Hqk, Hv, K, V, dtype, "common"):
            if v[0].startswith(pairs):
                v = with_switches(v)
                yield v
                if both_late and v[2].get("chunk_late_b"):
                    yield v[0].replace("_skip_forward", "_skip_forward_early_b"), v[1], {**v[2], "chunk_late_b": False}
        if backend.CP_NEGLIGIBLE_M_IN_KERNEL and backend.CP_SKIP_UNREAD and backend.CP_STARTS_IN_KERNEL:
            # the transition pass's stage 1, with its chunks' bounds (and their injections: CP_LATE_B_IN_KERNEL)
            stage1 = {"kkt_inverse_async_bounds_injects["} if backend.CP_LATE_B_IN_KERNEL else set()
            if both_late or not backend.CP_LATE_B_IN_KERNEL:
                stage1.add("kkt_inverse_async_bounds[")
            for v in forward_variants(Hqk, Hv, K, V, dtype, "common"):
                if v[0].split("[")[0] + "[" in stage1:  # as hopper_stage1 builds it
                    yield v[0], v[1], {**v[2], "async_loads": KKT_ASYNC_LOADS,
                                       **forward._kkt_build_options(Hv // Hqk)}
    else:
        for v in forward_variants(Hqk, 2 * Hv, K, V, dtype, "common"):
            name = v[0].split("[")[0]
            if name == kkt or name == "chunk_forward_rs_state":
                yield with_switches(v)
    if backend.CP_FUSED:
        for v in forward_variants(Hqk, Hv, K, V, dtype, "common"):
            if v[0].startswith("segment_index[") or (_is_splice(v) and v[0].endswith(",forward]")):
                yield with_switches(v)


def training_variants(Hqk: int, Hv: int, K: int = 128, V: int = 128, dtype: str = "bfloat16",
                      flags: str = "all") -> Iterator[Variant]:
    """``serving_variants`` and the backward's kernels as its switches are set (``backward.chunk_grad_options``,
    ``STAGED_STATE_STORES``, ``forward.PRECISE``): what a training step with those settings asks for."""
    from . import backend, backward, forward

    yield from serving_variants(Hqk, Hv, K, V, dtype, flags)
    if backend.CP_PAIRED and backend.CP_SKIP_UNREAD:  # the backward's transitions skip fewer items (or every b)
        for v in forward_variants(Hqk, Hv, K, V, dtype, "common"):
            if v[0].startswith("chunk_forward_rs_pairs_skip_backward[") or (
                    backend.CP_REUSE_STARTS and v[0].startswith("chunk_forward_rs_pairs_skip_m_only[")):
                v = with_switches(v)
                yield v
                if v[2].get("chunk_bounds") and backend.CP_LATE_B_IN_KERNEL and "skip_backward" in v[0]:
                    # the forward's own pass for a backward (its b started late), beside the backward's
                    yield v[0].replace("skip_backward", "skip_backward_late_b"), v[1], {**v[2], "chunk_late_b": True}
    if backend.CP_FUSED:  # the backward's CP splices the state gradients the other way
        yield from (with_switches(v) for v in forward_variants(Hqk, Hv, K, V, dtype, "common")
                    if (_is_splice(v) and v[0].endswith(",reverse]"))
                    or (backend.CP_REUSE_STARTS and v[0].startswith("splice_chains["))
                    or (backend.CP_REUSE_STARTS and backend.CP_CHAIN_INDEX and v[0] == "chain_index"))
    options = backward.chunk_grad_options(Hv // Hqk)
    fused_options = backward.fused_backward_options(Hv, Hv // Hqk)
    precise = forward.PRECISE and dtype == "bfloat16"
    for v in backward_variants(Hqk, Hv, K, V, dtype):
        builder, kw = v[1], v[2]
        if builder == "chunk_grad":  # the one build the options give, below
            continue
        fused = backward.FUSED_BACKWARD and not precise
        if builder == "fused_backward":
            if not fused or kw.get("trace") or kw.get("p_first") or kw.get("lean_gates") or kw.get("cluster_sum") \
                    or kw.get("pair_sums") or kw.get("p_given") or kw.get("fold_mma") \
                    or kw.get("first_apart", False) != backward.FIRST_STATES_APART:
                continue
            v = (v[0], builder, {**kw, **fused_options})
            if backward.FUSED_LONGEST_FIRST and kw.get("first_apart"):
                v = (v[0], builder, {**v[2], "longest_first": True})
        if builder == "group_sum" and (not backward.GROUP_SUM_KERNEL or options["pair_sums"]):
            continue
        if builder == "gated_scores" and not (fused and fused_options.get("p_given")):
            continue
        if builder == "group_sum" and kw["group"] != Hv // Hqk and not (fused and fused_options.get("pair_sums")):
            continue  # the sum over the fused kernel's pairs, where its builds take them
        if builder == "kkt_inverse" and kw.get("chunk_bounds"):  # as hopper_stage1 builds it, under the switch
            if backend.CP_NEGLIGIBLE_M_IN_KERNEL:
                yield v[0], builder, {**kw, "async_loads": forward.KKT_ASYNC_LOADS,
                                      **forward._kkt_build_options(Hv // Hqk, True)}
            continue
        if builder == "kkt_inverse" and (kw["async_loads"] != forward.KKT_ASYNC_LOADS
                                         or kw.get("blocks_per_sm", 4) != forward.KKT_BLOCKS_PER_SM
                                         or "triangle" in kw or "diag16" in kw):  # with_switches adds them
            continue
        if builder in ("chunk_forward_rs", "state_grad_walk") and (
                kw["staged_stores"] != backward.STAGED_STATE_STORES or kw["precise"] != precise or "lean" in kw):
            continue
        if builder == "state_grad_walk" and kw.get("starts_only") and not backward.WALK_STARTS_ONLY:
            continue
        if builder == "state_grad_walk" and kw.get("early_stop") and not (
                backward.WALK_EARLY_STOP or backward.WALK_STOP_IN_KERNEL):
            continue
        if builder in ("chunk_emits", "walk_covers") and not (
                backward.WALK_STOP_IN_KERNEL and backward.WALK_STARTS_ONLY):
            continue
        # the states pass for the fused kernel, beside the plain one for the two kernels ("auto" may take either)
        if kw.get("first_apart") and not (fused and backward.FIRST_STATES_APART):
            continue
        yield with_switches(v)
    yield _chunk_grad_variant(Hqk, Hv, K, V, dtype, tuple(f for f, on in options.items() if on))


def _chunk_grad_variant(Hqk, Hv, K, V, dtype, flags) -> Variant:
    tags = dict(async_loads="async", row_factors="rows", scan_dg="scan", wide_stores="wide", pair_sums="pairs",
                heads_inner="hinner")
    name = f"chunk_grad[{Hqk}/{Hv},{dtype}" + "".join("," + tags[f] for f in flags) + "]"
    return name, "chunk_grad", dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, **dict.fromkeys(flags, True))


def backward_variants(Hqk: int, Hv: int, K: int = 128, V: int = 128, dtype: str = "bfloat16") -> Iterator[Variant]:
    """The Hopper backward's kernels (``backward.hopper_backward``): the forward states' recompute (rs state-only
    loop storing every chunk's start state), stage 1 storing the ungated inverse too, the state-gradient walk and
    the per-chunk gradients, each with and without its optional input."""
    # the states pass and the walk with their stores staged through shared memory (the default,
    # backward.STAGED_STATE_STORES), with element-wise stores (its A/B), and in the precise mode with the default
    # stores (forward.PRECISE, bf16 only)
    modes = [(True, False), (False, False)] + [(True, True)] * (dtype == "bfloat16")
    for staged, precise in modes:
        tag = ",staged" * staged + ",precise" * precise
        for has_h0 in (True, False):
            yield (f"chunk_states[{Hqk}/{Hv},{dtype},h0={int(has_h0)}{tag}]", "chunk_forward_rs",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=has_h0, store_final_state=False,
                        state_v_first=False, with_output=False, precise=precise, store_chunk_states=True,
                        staged_stores=staged))
            if not precise:  # each sequence's first state apart, for the fused kernel (backward.FIRST_STATES_APART)
                yield (f"chunk_states[{Hqk}/{Hv},{dtype},h0={int(has_h0)}{tag},first_apart]", "chunk_forward_rs",
                       dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_initial_state=has_h0,
                            store_final_state=False, state_v_first=False, with_output=False, precise=False,
                            store_chunk_states=True, staged_stores=staged, first_apart=True))
        for has_dht in (True, False):
            yield (f"state_grad_walk[{Hqk}/{Hv},{dtype},dht={int(has_dht)}{tag}]", "state_grad_walk",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=has_dht, staged_stores=staged,
                        precise=precise))
    # context parallelism's walk from zero with its start gradients alone (backward.WALK_STARTS_ONLY, the default;
    # training_variants adds it when on), with the default stores' flag and in the precise mode
    for precise in (False, True) if dtype == "bfloat16" else (False,):
        yield (f"state_grad_walk[{Hqk}/{Hv},{dtype},dht=0,staged{',precise' * precise},starts_only]", "state_grad_walk",
               dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=False, staged_stores=True,
                    precise=precise, starts_only=True))
        # and stopped where the later tokens owe the start gradient nothing float32 holds (backward.WALK_EARLY_STOP)
        yield (f"state_grad_walk[{Hqk}/{Hv},{dtype},dht=0,staged{',precise' * precise},starts_only,early_stop]",
               "state_grad_walk",
               dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=False, staged_stores=True,
                    precise=precise, starts_only=True, early_stop=True))
    # the emission pass from which the walks from zero take their stops, and the count of their chunks from its and
    # stage 1's terms (backward.WALK_STOP_IN_KERNEL, the default; training_variants adds them when on)
    yield (f"chunk_emits[{Hqk}/{Hv},{dtype}]", "chunk_emits", dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype))
    yield (f"walk_covers[{Hv}]", "walk_covers", dict(Hv=Hv))
    # the walk with its column factors in registers (forward.LEAN_STATE_PASSES, an A/B)
    yield (f"state_grad_walk[{Hqk}/{Hv},{dtype},dht=1,staged,lean]", "state_grad_walk",
           dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=True, staged_stores=True, precise=False,
                lean=True))
    for async_loads in (False, True):
        yield (f"kkt_inverse_with_A{'_async' * async_loads}[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
               dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, store_inverse=True, async_loads=async_loads))
    # and the chunks' bounds, for the backward's own transition pass (backend.CP_NEGLIGIBLE_M_IN_KERNEL, an A/B)
    yield (f"kkt_inverse_with_A_async_bounds[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, store_inverse=True, async_loads=True,
                chunk_bounds=True))
    yield (f"kkt_inverse_with_A_async_5[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, store_inverse=True, async_loads=True,
                blocks_per_sm=5))
    yield (f"kkt_inverse_with_A_async_5_triangle[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, store_inverse=True, async_loads=True,
                blocks_per_sm=5, triangle=True))
    yield (f"kkt_inverse_with_A_async_5_diag16[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, store_inverse=True, async_loads=True,
                blocks_per_sm=5, diag16=True))
    yield (f"kkt_inverse_with_A_async_5_diag16_mma32[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
           dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, store_inverse=True, async_loads=True,
                blocks_per_sm=5, diag16=True, mma32=True))
    from .forward import ODD_GROUP_BLOCKS_PER_SM

    odd = ODD_GROUP_BLOCKS_PER_SM.get((Hv // Hqk, True))
    if odd:  # an odd group's build at more CTAs per SM (forward.KKT_ODD_GROUP_BLOCKS, the default), where it has one
        yield (f"kkt_inverse_with_A_async_{odd}_diag16_mma32[{Hqk}/{Hv},{dtype}]", "kkt_inverse",
               dict(Hqk=Hqk, Hv=Hv, K=K, qk_dtype=dtype, a_dtype=dtype, store_inverse=True, async_loads=True,
                    blocks_per_sm=odd, diag16=True, mma32=True))
    # chunk_grad: the default (tiles by cp.async, row factors in registers, dg by a scan, 16-byte stores:
    # backward.CHUNK_GRAD_*), then its A/Bs, each one switch away from it: register-staged loads, per-element
    # factors, dg by a masked sum, 4-byte stores, blocks taken value heads first; and for two value heads per qk
    # head, dq and dk summed by atomics
    default = ("async_loads", "row_factors", "scan_dg", "wide_stores")
    for flags in (default, *(tuple(f for f in default if f != off) for off in default)):
        yield _chunk_grad_variant(Hqk, Hv, K, V, dtype, flags)
    yield _chunk_grad_variant(Hqk, Hv, K, V, dtype, default + ("heads_inner",))
    if Hv == 2 * Hqk:
        yield _chunk_grad_variant(Hqk, Hv, K, V, dtype, default + ("pair_sums",))
    # the walk and chunk_grad as one kernel (backward.FUSED_BACKWARD), from a final-state gradient and without
    if K == 128 and V == 128:
        for has_dht in (True, False):
            yield (f"fused_backward[{Hqk}/{Hv},{dtype},dht={int(has_dht)}]", "fused_backward",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=has_dht))
        # reading each sequence's first chunk state from the d(initial state) buffer (backward.FIRST_STATES_APART)
        for has_dht in (True, False):
            yield (f"fused_backward[{Hqk}/{Hv},{dtype},dht={int(has_dht)},first_apart]", "fused_backward",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=has_dht, first_apart=True))
        # its trace build (benchmarks/fused_backward_trace.py), a diagnostic: never run by the operator
        yield (f"fused_backward_trace[{Hqk}/{Hv},{dtype},dht=1]", "fused_backward",
               dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=True, trace=True))
        # and beside a given P, with the gate side's fold (16/32's default build, traced; P before the stamps)
        yield (f"fused_backward_trace[{Hqk}/{Hv},{dtype},dht=1,p_given,fold_mma]", "fused_backward",
               dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=True, trace=True, p_given=True,
                    fold_mma=True))
        # P released before K S is waited for (backward.FUSED_P_FIRST), the gate side's factors in registers
        # (backward.FUSED_LEAN_GATES), each alone
        yield (f"fused_backward[{Hqk}/{Hv},{dtype},dht=1,p_first]", "fused_backward",
               dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=True, p_first=True))
        yield (f"fused_backward[{Hqk}/{Hv},{dtype},dht=1,lean_gates]", "fused_backward",
               dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=True, lean_gates=True))
        # both, which the operator builds wherever the gate side makes P (below backward.FUSED_P_GIVEN_MIN_HV
        # value heads)
        for has_dht in (True, False):
            yield (f"fused_backward[{Hqk}/{Hv},{dtype},dht={int(has_dht)},p_first,lean_gates]", "fused_backward",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=has_dht, p_first=True,
                        lean_gates=True))
        # dq and dk summed over each group by a cluster of its CTAs (backward.FUSED_CLUSTER_SUM), with the gate-side
        # options and without
        from .fused_backward import CLUSTER_SUM_MAX_GROUP

        if 2 <= Hv // Hqk <= CLUSTER_SUM_MAX_GROUP:
            for lean in (True, False):
                tag, opts = (",p_first,lean_gates", dict(p_first=True, lean_gates=True)) if lean else ("", {})
                yield (f"fused_backward[{Hqk}/{Hv},{dtype},dht=1{tag},cluster_sum]", "fused_backward",
                       dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=True, **opts, cluster_sum=True))
        # the gate-side options the operator builds for these heads (where it does not give P)
        from .backward import FUSED_P_GIVEN_MIN_HV

        gates = dict(p_first=True, lean_gates=True) if Hv < FUSED_P_GIVEN_MIN_HV else {}
        # dq and dk added per pair of value heads into zeros by L2 reductions (backward.FUSED_PAIR_SUMS), with the
        # operator's other options for these heads
        if (Hv // Hqk) % 2 == 0:
            tag = "".join("," + o for o in gates)
            yield (f"fused_backward[{Hqk}/{Hv},{dtype},dht=1{tag},first_apart,pair_sums]", "fused_backward",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=True, **gates, first_apart=True,
                        pair_sums=True))
        # the chunks' P made by a pass of their own and given to the fused kernel (backward.FUSED_P_GIVEN), with the
        # operator's other options for these heads
        opts = dict(gates, pair_sums=True) if Hv // Hqk == 2 else gates
        tag = "".join("," + o for o in opts)
        for has_dht in (True, False):
            yield (f"fused_backward[{Hqk}/{Hv},{dtype},dht={int(has_dht)}{tag},first_apart,p_given]", "fused_backward",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=has_dht, **opts, first_apart=True,
                        p_given=True))
        yield (f"gated_scores[{Hqk}/{Hv},{dtype}]", "gated_scores", dict(Hqk=Hqk, Hv=Hv, K=K, io_dtype=dtype))
        # <dS', S> by the tensor cores (backward.FUSED_FOLD_MMA), with the same options as above: beside p_given
        # (the gate side's fold; the operator's default there in groups of two) from FUSED_P_GIVEN_MIN_HV value
        # heads, where the operator gives P, else without it
        from .backward import FUSED_P_GIVEN_MIN_HV

        given = dict(p_given=True) if Hv >= FUSED_P_GIVEN_MIN_HV else {}
        folded = dict(opts, first_apart=True, **given, fold_mma=True)
        folded_tag = f"{tag},first_apart{',p_given' if given else ''},fold_mma"
        for has_dht in (True, False):
            yield (f"fused_backward[{Hqk}/{Hv},{dtype},dht={int(has_dht)}{folded_tag}]", "fused_backward",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=has_dht, **folded))
        # its rows of CTAs longest first (backward.FUSED_LONGEST_FIRST, an A/B; training_variants adds it when on)
        yield (f"fused_backward[{Hqk}/{Hv},{dtype},dht=1{folded_tag},longest_first]", "fused_backward",
               dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=True, **folded, longest_first=True))
        # Ag made from A by the producer (backward.FUSED_AG_FROM_A, an A/B; training_variants adds it when on)
        for has_dht in (True, False):
            yield (f"fused_backward[{Hqk}/{Hv},{dtype},dht={int(has_dht)}{folded_tag},ag_from_a]", "fused_backward",
                   dict(Hqk=Hqk, Hv=Hv, K=K, V=V, io_dtype=dtype, has_final_grad=has_dht, **folded, ag_from_a=True))
    if Hv > Hqk:  # dq and dk summed over each qk head's value heads (backward.GROUP_SUM_KERNEL)
        yield (f"group_sum[{Hv // Hqk},{dtype}]", "group_sum", dict(group=Hv // Hqk, K=K, io_dtype=dtype))
    if Hv // Hqk >= 4 and (Hv // Hqk) % 2 == 0:  # the fused kernel's pair sums, summed over each group
        yield (f"group_sum[{Hv // Hqk // 2},{dtype}]", "group_sum", dict(group=Hv // Hqk // 2, K=K, io_dtype=dtype))


def build(builder: str, kwargs: dict):
    if builder == "chunk_plan":
        from .chunk_plan import build_chunk_plan

        return build_chunk_plan(**kwargs)
    if builder == "kkt_inverse":
        from .kkt_inverse import build_kkt_inverse

        return build_kkt_inverse(**kwargs)
    if builder == "chunk_forward_ws":
        from .chunk_forward_ws import build_chunk_forward_ws

        return build_chunk_forward_ws(**kwargs)
    if builder == "chunk_forward_rs":
        from .chunk_forward_rs import build_chunk_forward_rs

        return build_chunk_forward_rs(**kwargs)
    if builder == "chunk_forward_uw":
        from .chunk_forward_uw import build_chunk_forward_uw

        return build_chunk_forward_uw(**kwargs)
    if builder == "chunk_forward_rso":
        from .chunk_forward_rso import build_chunk_forward_rso

        return build_chunk_forward_rso(**kwargs)
    if builder == "segment_index":
        from .segment_index import build_segment_index

        return build_segment_index(**kwargs)
    if builder == "chain_index":
        from .segment_index import build_chain_index

        return build_chain_index(**kwargs)
    if builder == "splice":
        from .splice import build_splice

        return build_splice(**kwargs)
    if builder == "chunk_grad":
        from .chunk_grad import build_chunk_grad

        return build_chunk_grad(**kwargs)
    if builder == "state_grad_walk":
        from .state_grad_walk import build_state_grad_walk

        return build_state_grad_walk(**kwargs)
    if builder == "fused_backward":
        from .fused_backward import build_fused_backward

        return build_fused_backward(**kwargs)
    if builder == "gated_scores":
        from .gated_scores import build_gated_scores

        return build_gated_scores(**kwargs)
    if builder == "chunk_emits":
        from .chunk_emits import build_chunk_emits

        return build_chunk_emits(**kwargs)
    if builder == "walk_covers":
        from .chunk_emits import build_walk_covers

        return build_walk_covers(**kwargs)
    if builder == "group_sum":
        from .group_sum import build_group_sum

        return build_group_sum(**kwargs)
    if builder == "chunk_forward":
        from .chunk_forward import build_chunk_forward

        return build_chunk_forward(**kwargs)
    raise ValueError(f"unknown kernel builder {builder!r}")
