"""python -m flashgdn.precompile on the CPU: compiles every variant of a head configuration for sm_90a and exports
exactly their cache entries (each loadable: the library and its parameters)."""
import os

import pytest

pytest.importorskip("tilelang")


def test_precompile_exports_one_complete_entry_per_kernel(tmp_path, capsys):
    from flashgdn.kernels.hopper.variants import backward_variants, forward_variants
    from flashgdn.precompile import main

    out = tmp_path / "cache"
    assert main(["--heads", "2/8", "--flags", "common", "--jobs", "1", "--export", str(out)]) == 0
    printed = capsys.readouterr().out
    names = {v[0] for v in forward_variants(2, 8, flags="common")} | {v[0] for v in backward_variants(2, 8)}
    assert all(n in printed for n in names)
    entries = [d for d, _, files in os.walk(out) if "executable.so" in files]
    assert len(entries) == len(names)
    for d in entries:
        assert {"executable.so", "params.json"} <= set(os.listdir(d))


def test_precompile_expect_cached_names_the_kernels_it_had_to_compile(monkeypatch, capsys):
    """``--expect-cached`` (the check of a cache shipped to a GPU machine) passes once the kernels are in the cache,
    and fails naming them when their entries were not there before the run."""
    from flashgdn import precompile

    args = ["--heads", "2/8", "--kernels", "serving", "--flags", "common", "--jobs", "1"]
    assert precompile.main(args) == 0  # (in the cache from here on, compiled now or before)
    assert precompile.main(args + ["--expect-cached"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(precompile, "_cache_entries", lambda cache_dir: set())  # as if the cache were empty
    assert precompile.main(args + ["--expect-cached"]) == 1
    err = capsys.readouterr().err
    assert "not in the cache before this run" in err and "chunk_forward" in err


def test_precompile_rejects_bad_heads():
    from flashgdn.precompile import main

    with pytest.raises(SystemExit, match="--heads"):
        main(["--heads", "3/4"])


def test_serving_kernels_are_what_the_default_operator_uses(monkeypatch):
    """The default chunk loop for the flags, stage 1, and CP's kernels: by default the paired transition pass with
    its stage 1 (the build with the chunks' bounds), each in its build with b started late from stage 1's terms and,
    for segments shorter than ``backend.CP_LATE_B_MIN_CHUNKS``, without; the segment index and the splice. With those
    switched off the transition pass on twice the value heads. None of the comparison loops or the backward's
    kernels."""
    from flashgdn.kernels.hopper import backend, forward
    from flashgdn.kernels.hopper.variants import serving_variants

    names = [v[0] for v in serving_variants(2, 8, flags="common")]
    assert names == ["chunk_plan", "kkt_inverse_async_5[2/8,bfloat16]",
                     "chunk_forward_rso[2/8,bfloat16,h0=1,ht=1,v_first=0]",
                     "chunk_forward_rs_pairs_skip_forward[2/8,bfloat16,h0=1,ht=1,v_first=0]",
                     "chunk_forward_rs_pairs_skip_forward_early_b[2/8,bfloat16,h0=1,ht=1,v_first=0]",
                     "kkt_inverse_async_bounds[2/8,bfloat16]", "kkt_inverse_async_bounds_injects[2/8,bfloat16]",
                     "segment_index[int32]", "segment_index[int64]", "splice[8,forward]"]
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", False)
    assert "kkt_inverse_async_bounds[2/8,bfloat16]" not in [v[0] for v in serving_variants(2, 8, flags="common")]
    assert len([n for n in serving_variants(2, 8, flags="all") if n[0].startswith("chunk_forward_rso[")]) == 8
    monkeypatch.setattr(backend, "CP_PAIRED", False)
    monkeypatch.setattr(backend, "CP_FUSED", False)
    names = [v[0] for v in serving_variants(2, 8, flags="common")]
    assert names == ["chunk_plan", "kkt_inverse_async_5[2/8,bfloat16]",
                     "chunk_forward_rso[2/8,bfloat16,h0=1,ht=1,v_first=0]",
                     "kkt_inverse_async_5[2/16,bfloat16]", "chunk_forward_rs_state[2/16,bfloat16,h0=1,ht=1,v_first=0]"]
    monkeypatch.setattr(backend, "CP_PAIRED", True)
    monkeypatch.setattr(forward, "DEFAULT_CHUNK_LOOP", "uw")
    names = [v[0] for v in serving_variants(2, 8, flags="common")]
    assert "chunk_forward_uw[2/8,bfloat16,h0=1,ht=1,v_first=0]" in names
    assert "chunk_forward_rs_pairs_skip_forward[2/8,bfloat16,h0=1,ht=1,v_first=0]" in names
    assert not any("2/16" in n for n in names)
    monkeypatch.setattr(backend, "CP_SKIP_UNREAD", False)
    assert "chunk_forward_rs_pairs[2/8,bfloat16,h0=1,ht=1,v_first=0]" in [
        v[0] for v in serving_variants(2, 8, flags="common")]
    monkeypatch.setattr(backend, "CP_SKIP_UNREAD", True)
    monkeypatch.setattr(backend, "CP_FUSED", True)
    names = [v[0] for v in serving_variants(2, 8, flags="common")]
    assert "splice[8,forward]" in names and "segment_index[int32]" in names


def test_training_kernels_are_what_the_default_training_step_uses(monkeypatch):
    """The serving kernels, the backward's CP transition passes (and the one that makes only M, for starts gathered
    from the forward's) and splices (the forward's chains build from the forward's segment starts and their index
    kernel, the reverse's blocked build at both widths), and the backward's kernels as its switches
    are set: one chunk_grad build (the one ``backward.chunk_grad_options`` gives), the states pass and the walk
    with their default stores (the states pass also in its build for the fused kernel, ``backward.FIRST_STATES_APART``;
    the walk in its starts-only build too, for CP's walks from zero, ``backward.WALK_STARTS_ONLY``, and that build
    stopped early with the emission pass and the covers that stop it, ``backward.WALK_STOP_IN_KERNEL``), the fused walk
    and chunk_grad (``backward.FUSED_BACKWARD``: auto takes it on shapes that fill the GPU) with and without a
    final-state gradient, in the precise mode (which keeps the two kernels)
    the precise builds alone."""
    from flashgdn.kernels.hopper import backend, backward, forward
    from flashgdn.kernels.hopper.variants import serving_variants, training_variants

    serving = [v[0] for v in serving_variants(2, 8, flags="common")]
    names = [v[0] for v in training_variants(2, 8, flags="common")]
    assert names == serving + ["chunk_forward_rs_pairs_skip_backward[2/8,bfloat16,h0=1,ht=1,v_first=0]",
                               "chunk_forward_rs_pairs_skip_backward_late_b[2/8,bfloat16,h0=1,ht=1,v_first=0]",
                               "chunk_forward_rs_pairs_skip_m_only[2/8,bfloat16,h0=1,ht=1,v_first=0]",
                               "chain_index", "splice_chains[8,forward]", "splice_blocked8[8,reverse]",
                               "splice_blocked16[8,reverse]",
                               "chunk_states[2/8,bfloat16,h0=1,staged]",
                               "chunk_states[2/8,bfloat16,h0=1,staged,first_apart]",
                               "chunk_states[2/8,bfloat16,h0=0,staged]",
                               "chunk_states[2/8,bfloat16,h0=0,staged,first_apart]",
                               "state_grad_walk[2/8,bfloat16,dht=1,staged]",
                               "state_grad_walk[2/8,bfloat16,dht=0,staged]",
                               "state_grad_walk[2/8,bfloat16,dht=0,staged,starts_only]",
                               "state_grad_walk[2/8,bfloat16,dht=0,staged,starts_only,early_stop]",
                               "chunk_emits[2/8,bfloat16]", "walk_covers[8]",
                               "kkt_inverse_with_A_async_bounds[2/8,bfloat16]",
                               "kkt_inverse_with_A_async_5[2/8,bfloat16]",
                               "fused_backward[2/8,bfloat16,dht=1,first_apart]",
                               "fused_backward[2/8,bfloat16,dht=0,first_apart]",
                               "group_sum[4,bfloat16]", "group_sum[2,bfloat16]",
                               "chunk_grad[2/8,bfloat16,async,rows,scan,wide]"]
    # without FIRST_STATES_APART the fused kernel's builds and states pass read and write every state in one tensor
    monkeypatch.setattr(backward, "FIRST_STATES_APART", False)
    names_off = [v[0] for v in training_variants(2, 8, flags="common")]
    assert [n for n in names_off if n.startswith(("chunk_states", "fused_backward"))] == [
        "chunk_states[2/8,bfloat16,h0=1,staged]", "chunk_states[2/8,bfloat16,h0=0,staged]",
        "fused_backward[2/8,bfloat16,dht=1]", "fused_backward[2/8,bfloat16,dht=0]"]
    monkeypatch.setattr(backward, "FIRST_STATES_APART", True)
    # with FUSED_CLUSTER_SUM, the fused builds sum dq and dk in a cluster of each group's CTAs (groups of 2 to 8)
    # FUSED_FOLD_MMA: "auto" folds <dS', S> by the tensor cores in the fused builds where P is not given, and where
    # it is given beside the pair sums (groups of two: the gate side folds)
    assert [v[2].get("fold_mma") for v in training_variants(2, 8, flags="common") if v[1] == "fused_backward"] \
        == [True, True]
    assert [(v[2].get("p_given"), v[2].get("fold_mma")) for v in training_variants(16, 32, flags="common")
            if v[1] == "fused_backward"] == [(True, True), (True, True)]
    monkeypatch.setattr(backward, "FUSED_FOLD_MMA", False)  # (the other switches' checks below)
    monkeypatch.setattr(backward, "FUSED_P_GIVEN", False)  # (its own checks below)
    monkeypatch.setattr(backward, "FUSED_CLUSTER_SUM", True)
    assert [v[2].get("cluster_sum") for v in training_variants(2, 8, flags="common") if v[1] == "fused_backward"] \
        == [True, True]
    # (no P pass beside it: the gate side makes P, with its options)
    assert backward.fused_backward_options(32, 2) == {"cluster_sum": True, "p_first": True, "lean_gates": True}
    assert "cluster_sum" not in backward.fused_backward_options(8, 1)
    assert "cluster_sum" not in backward.fused_backward_options(32, 16)
    monkeypatch.setattr(backward, "FUSED_CLUSTER_SUM", False)
    assert not [v for v in training_variants(2, 8, flags="common") if v[2].get("cluster_sum")]
    # FUSED_PAIR_SUMS: "auto" adds dq and dk per pair of value heads in the fused builds of groups of two and of four
    # (its two pairs then summed), beside a given P too; on, in every even group
    assert [v[2].get("pair_sums") for v in training_variants(2, 8, flags="common") if v[1] == "fused_backward"] \
        == [True, True]
    assert backward.fused_backward_options(32, 4).get("pair_sums")
    assert "pair_sums" not in backward.fused_backward_options(48, 6)
    assert [v[2].get("pair_sums") for v in training_variants(2, 4, flags="common") if v[1] == "fused_backward"] \
        == [True, True]
    assert "group_sum[2,bfloat16]" in [v[0] for v in training_variants(2, 4, flags="common")]  # chunk_grad's
    monkeypatch.setattr(backward, "FUSED_PAIR_SUMS", True)
    paired = training_variants(2, 8, flags="common")
    assert [(v[0], v[2].get("pair_sums")) for v in paired if v[1] in ("fused_backward", "group_sum")] == [
        ("fused_backward[2/8,bfloat16,dht=1,first_apart]", True),
        ("fused_backward[2/8,bfloat16,dht=0,first_apart]", True),
        ("group_sum[4,bfloat16]", None), ("group_sum[2,bfloat16]", None)]
    lean = {"p_first": True, "lean_gates": True}  # (P not given here: the gate side's options)
    assert backward.fused_backward_options(32, 2) == {"pair_sums": True, **lean}
    assert backward.fused_backward_options(32, 4) == {"pair_sums": True, **lean}
    assert "pair_sums" not in backward.fused_backward_options(8, 1)
    assert "pair_sums" not in backward.fused_backward_options(6, 3)
    monkeypatch.setattr(backward, "FUSED_PAIR_SUMS", False)
    assert not [v for v in training_variants(2, 4, flags="common") if v[2].get("pair_sums")]
    monkeypatch.setattr(backward, "FUSED_PAIR_SUMS", "auto")
    # FUSED_P_GIVEN: "auto" gives the fused kernel its P from FUSED_P_GIVEN_MIN_HV value heads on, made by
    # gated_scores (precompiled only where taken); never beside cluster_sum
    monkeypatch.setattr(backward, "FUSED_P_GIVEN", "auto")
    assert backward.fused_backward_options(32, 2) == {"pair_sums": True, "p_given": True}
    assert "p_given" not in backward.fused_backward_options(16, 2)
    wide = training_variants(16, 32, flags="common")
    assert [(v[0], v[2].get("p_given")) for v in wide if v[1] in ("fused_backward", "gated_scores")] == [
        ("fused_backward[16/32,bfloat16,dht=1,first_apart]", True),
        ("fused_backward[16/32,bfloat16,dht=0,first_apart]", True), ("gated_scores[16/32,bfloat16]", None)]
    assert not [v for v in training_variants(2, 8, flags="common") if v[1] == "gated_scores" or v[2].get("p_given")]
    monkeypatch.setattr(backward, "FUSED_P_GIVEN", True)
    assert [v[0] for v in training_variants(2, 8, flags="common") if v[1] == "gated_scores"] == [
        "gated_scores[2/8,bfloat16]"]
    monkeypatch.setattr(backward, "FUSED_CLUSTER_SUM", True)
    assert backward.fused_backward_options(32, 2) == {"cluster_sum": True, **lean}
    monkeypatch.setattr(backward, "FUSED_CLUSTER_SUM", False)
    monkeypatch.setattr(backward, "FUSED_P_GIVEN", False)
    monkeypatch.setattr(backend, "CP_CHAIN_INDEX", False)  # the chains' index by torch ops: no kernel
    assert "chain_index" not in [v[0] for v in training_variants(2, 8, flags="common")]
    monkeypatch.setattr(backend, "CP_CHAIN_INDEX", True)
    monkeypatch.setattr(backward, "FUSED_BACKWARD", False)  # never fused: not precompiled
    assert not [v for v in training_variants(2, 8, flags="common") if v[1] == "fused_backward"]
    monkeypatch.setattr(backward, "FUSED_BACKWARD", "auto")
    # groups of two with pair sums need no group sum; without the kernel, torch sums
    assert "group_sum[2,bfloat16]" in [v[0] for v in training_variants(2, 4, flags="common")]
    monkeypatch.setattr(backward, "CHUNK_GRAD_PAIR_SUMS", True)
    assert "group_sum[2,bfloat16]" not in [v[0] for v in training_variants(2, 4, flags="common")]
    monkeypatch.setattr(backward, "CHUNK_GRAD_PAIR_SUMS", False)
    monkeypatch.setattr(backward, "GROUP_SUM_KERNEL", False)
    assert not [v for v in training_variants(2, 8, flags="common") if v[1] == "group_sum"]
    monkeypatch.setattr(backward, "CHUNK_GRAD_ROW_FACTORS", False)
    monkeypatch.setattr(backward, "CHUNK_GRAD_SCAN_DG", False)
    monkeypatch.setattr(forward, "PRECISE", True)
    names = [v[0] for v in training_variants(2, 8, flags="common")]
    assert [v for v in training_variants(2, 8, flags="common") if v[1] == "chunk_grad"] == [
        ("chunk_grad[2/8,bfloat16,async,wide]", "chunk_grad",
         dict(Hqk=2, Hv=8, K=128, V=128, io_dtype="bfloat16", async_loads=True, wide_stores=True))]
    assert not [n for n in names if n.startswith("fused_backward")]
    assert [n for n in names if n.startswith(("chunk_states", "state_grad_walk"))] == [
        "chunk_states[2/8,bfloat16,h0=1,staged,precise]", "chunk_states[2/8,bfloat16,h0=0,staged,precise]",
        "state_grad_walk[2/8,bfloat16,dht=1,staged,precise]", "state_grad_walk[2/8,bfloat16,dht=0,staged,precise]",
        "state_grad_walk[2/8,bfloat16,dht=0,staged,precise,starts_only]",
        "state_grad_walk[2/8,bfloat16,dht=0,staged,precise,starts_only,early_stop]"]


def test_precompiled_kernels_follow_the_build_switches(monkeypatch):
    """The host's build switches reach what is precompiled: the rso loop's options (forward.rso_options) and the
    state passes' lean option (forward.lean_state_option), so a server with a switch set precompiles the builds it
    will run."""
    from flashgdn.kernels.hopper import forward
    from flashgdn.kernels.hopper.variants import serving_variants, training_variants

    def rso_kwargs():
        return [kw for _, builder, kw in serving_variants(2, 8, flags="common") if builder == "chunk_forward_rso"]

    # the defaults: the trimmed output path (the builder's default) and the trimmed state paths (RSO_LEAN_STATE)
    assert [("lean_output" in kw, kw.get("lean_state")) for kw in rso_kwargs()] == [(False, True)]
    monkeypatch.setattr(forward, "RSO_LEAN_OUTPUT", False)
    monkeypatch.setattr(forward, "RSO_LEAN_STATE", False)
    assert [(kw["lean_output"], kw.get("lean_state", False)) for kw in rso_kwargs()] == [(False, False)]

    def lean_of_state_passes():
        return {name: kw.get("lean") for name, builder, kw in training_variants(2, 8, flags="common")
                if builder in ("chunk_forward_rs", "state_grad_walk")}

    assert set(lean_of_state_passes().values()) == {None}
    monkeypatch.setattr(forward, "LEAN_STATE_PASSES", True)
    lean = lean_of_state_passes()
    # with the walk's starts-only build and that build stopped early, and the forward's passes with and without b
    # started late from stage 1's terms
    assert len(lean) == 13 and set(lean.values()) == {True}, lean


def test_precompiled_transition_passes_follow_starts_in_kernel(monkeypatch):
    """FLASHGDN_HOPPER_CP_STARTS_IN_KERNEL reaches the skipping transition passes a training step precompiles (and
    nothing else)."""
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.variants import training_variants

    def from_h0():
        return {name: kw.get("starts_from_h0", False) for name, builder, kw in training_variants(2, 8, flags="common")
                if builder == "chunk_forward_rs"}

    # the default: made in the kernel
    got = from_h0()
    assert {n for n, on in got.items() if on} == {n for n in got if "_pairs_skip_" in n} != set(), got
    monkeypatch.setattr(backend, "CP_STARTS_IN_KERNEL", False)
    assert not any(from_h0().values())


def test_precompiled_transition_passes_follow_negligible_m(monkeypatch):
    """FLASHGDN_HOPPER_CP_NEGLIGIBLE_M reaches the transition passes that make their start states (the builds that
    take the bounds), and nothing else; off by default."""
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.variants import training_variants

    def negligible():
        return {name: kw.get("negligible_m", False) for name, builder, kw in training_variants(2, 8, flags="common")
                if builder == "chunk_forward_rs"}

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", False)  # (the kernels' own bound takes precedence)
    assert not any(negligible().values())
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M", True)
    got = negligible()
    assert {n for n, on in got.items() if on} == {n for n in got if "_pairs_skip_" in n} != set(), got
    monkeypatch.setattr(backend, "CP_STARTS_IN_KERNEL", False)  # the build that reads its starts takes no bounds
    assert not any(negligible().values())


def test_precompiled_builds_follow_negligible_m_in_kernel(monkeypatch):
    """FLASHGDN_HOPPER_CP_NEGLIGIBLE_M_IN_KERNEL reaches the transition passes that make their start states (their
    ``chunk_bounds`` build) and adds stage 1's builds with the chunks' bounds (the forward's and the backward's, with
    the options hopper_stage1 gives them) and the splices' ``m_zero`` builds, and nothing else; on by default."""
    from flashgdn.kernels.hopper import backend, forward
    from flashgdn.kernels.hopper.variants import training_variants

    def bounded():
        return {name: kw for name, builder, kw in training_variants(2, 8, flags="common") if kw.get("chunk_bounds")}

    def splices():
        return {name: kw.get("m_zero", False) for name, builder, kw in training_variants(2, 8, flags="common")
                if builder == "splice"}

    assert backend.CP_NEGLIGIBLE_M_IN_KERNEL  # the default
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", False)
    assert bounded() == {}
    assert splices() and not any(splices().values())
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", True)
    assert set(splices()) == {"splice[8,forward]", "splice_chains[8,forward]", "splice_blocked8[8,reverse]",
                              "splice_blocked16[8,reverse]"} and all(splices().values()), splices()
    got = bounded()
    passes = {n for n in got if n.startswith("chunk_forward_rs")}
    stage1 = {n: kw for n, kw in got.items() if n.startswith("kkt_inverse")}
    assert passes and all("_pairs_skip_" in n and got[n]["negligible_m"] for n in passes), got
    assert not any(got[n].get("late_b") for n in passes)
    assert set(stage1) == {"kkt_inverse_async_bounds[2/8,bfloat16]", "kkt_inverse_with_A_async_bounds[2/8,bfloat16]",
                           "kkt_inverse_async_bounds_injects[2/8,bfloat16]"}  # (the last: CP_LATE_B_IN_KERNEL's)
    for name, kw in stage1.items():
        store = kw.get("store_inverse", False)
        assert {k: v for k, v in kw.items() if k not in ("Hqk", "Hv", "K", "qk_dtype", "a_dtype", "chunk_bounds",
                                                         "store_inverse", "chunk_injects")} == \
            {"async_loads": forward.KKT_ASYNC_LOADS, **forward._kkt_build_options(4, store)}, name


def test_precompiled_transition_passes_follow_late_b(monkeypatch):
    """FLASHGDN_HOPPER_CP_LATE_B reaches the transition passes that take the bounds (beside CP_NEGLIGIBLE_M), and
    nothing else; off by default, and nothing without CP_NEGLIGIBLE_M."""
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.variants import training_variants

    def late():
        return {name: kw.get("late_b", False) for name, builder, kw in training_variants(2, 8, flags="common")
                if builder == "chunk_forward_rs"}

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", False)  # (the kernels' own bound takes precedence)
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M", True)
    assert not any(late().values())
    monkeypatch.setattr(backend, "CP_LATE_B", True)
    got = late()
    assert {n for n, on in got.items() if on} == {n for n in got if "_pairs_skip_" in n} != set(), got
    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M", False)
    assert not any(late().values())


def test_precompiled_builds_follow_late_b_in_kernel(monkeypatch):
    """FLASHGDN_HOPPER_CP_LATE_B_IN_KERNEL (with CP_NEGLIGIBLE_M_IN_KERNEL) reaches the forward's transition pass
    (``chunk_late_b``) and its stage 1 (``chunk_injects``), as the host builds them, and nothing else; on by default,
    with CP_LATE_B_MIN_CHUNKS, whose shorter segments take the builds without it (both are precompiled)."""
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper.variants import serving_variants, training_variants

    def flagged(variants):
        return {name for name, builder, kw in variants if kw.get("chunk_late_b") or kw.get("chunk_injects")}

    monkeypatch.setattr(backend, "CP_NEGLIGIBLE_M_IN_KERNEL", True)
    assert backend.CP_LATE_B_IN_KERNEL and backend.CP_LATE_B_MIN_CHUNKS == 128  # the defaults
    monkeypatch.setattr(backend, "CP_LATE_B_IN_KERNEL", False)
    assert not flagged(training_variants(2, 8, flags="common"))
    plain = {name: kw for name, builder, kw in serving_variants(2, 8, flags="common")}
    monkeypatch.setattr(backend, "CP_LATE_B_IN_KERNEL", True)
    monkeypatch.setattr(backend, "CP_LATE_B_MIN_CHUNKS", 0)
    got = {name: kw for name, builder, kw in serving_variants(2, 8, flags="common")
           if kw.get("chunk_late_b") or kw.get("chunk_injects")}
    passes = {n for n in got if n.startswith("chunk_forward_rs")}
    assert passes and all("_pairs_skip_forward" in n and got[n]["chunk_bounds"] for n in passes), got
    assert set(got) - passes == {"kkt_inverse_async_bounds_injects[2/8,bfloat16]"}, got
    assert "kkt_inverse_async_bounds[2/8,bfloat16]" not in {n for n, b, kw in serving_variants(2, 8, flags="common")}
    # a training step: the forward's pass for a backward (skipping its items) with b started late too, beside the
    # backward's own build of it (its stage 1 shared with the gradients) without
    trained = {name: kw for name, builder, kw in training_variants(2, 8, flags="common")}
    late = {n for n, kw in trained.items() if kw.get("chunk_late_b") or kw.get("chunk_injects")}
    assert late - set(got) == {n for n in late if "_skip_backward_late_b" in n} != set(), late
    assert any("_pairs_skip_backward" in n and "late_b" not in n and trained[n].get("chunk_bounds") for n in trained)
    # with a shortest length: the builds with it and, for shorter segments, the builds without it as well
    monkeypatch.setattr(backend, "CP_LATE_B_MIN_CHUNKS", 128)
    both = {name: kw for name, builder, kw in serving_variants(2, 8, flags="common")}
    assert set(got) <= set(both)
    without = [{k: v for k, v in kw.items() if not (k == "chunk_late_b" and v is False)}
               for n, kw in both.items() if n not in got]
    assert sorted(map(repr, without)) == sorted(map(repr, plain.values())), (without, plain)


def test_precompiled_fused_backward_follows_longest_first(monkeypatch):
    """FLASHGDN_HOPPER_FUSED_LONGEST_FIRST reaches the fused backward builds a training step precompiles (those beside
    first_apart, the operator's), and nothing else; off by default."""
    from flashgdn.kernels.hopper import backward
    from flashgdn.kernels.hopper.variants import training_variants

    def longest_first():
        return {name: kw.get("longest_first", False) for name, builder, kw in training_variants(16, 32, flags="common")
                if builder == "fused_backward"}

    got = longest_first()
    assert got and not any(got.values())
    monkeypatch.setattr(backward, "FUSED_LONGEST_FIRST", True)
    got = longest_first()
    assert got and all(got.values()), got
    monkeypatch.setattr(backward, "FIRST_STATES_APART", False)
    assert not any(longest_first().values())


@pytest.mark.parametrize("precise", [False, True])
def test_precompiled_walks_follow_walk_starts_only(precise, monkeypatch):
    """FLASHGDN_HOPPER_WALK_STARTS_ONLY adds the walk's starts-only build (CP's walk from zero) to what a training
    step precompiles, in the mode it runs in, beside the walks with their stores; on by default."""
    from flashgdn.kernels.hopper import backward, forward
    from flashgdn.kernels.hopper.variants import training_variants

    assert backward.WALK_STARTS_ONLY is (os.environ.get("FLASHGDN_HOPPER_WALK_STARTS_ONLY", "1") == "1")
    monkeypatch.setattr(forward, "PRECISE", precise)
    monkeypatch.setattr(backward, "WALK_STARTS_ONLY", False)
    monkeypatch.setattr(backward, "WALK_STOP_IN_KERNEL", False)  # (its stopped walk: its own test below)

    def walks():
        return [kw for name, builder, kw in training_variants(2, 8, flags="common") if builder == "state_grad_walk"]

    plain = walks()
    assert plain and not any(kw.get("starts_only") for kw in plain)
    monkeypatch.setattr(backward, "WALK_STARTS_ONLY", True)
    got = walks()
    (only,) = [kw for kw in got if kw.get("starts_only")]
    assert only["precise"] is precise and only["has_final_grad"] is False and not only.get("early_stop")
    assert [kw for kw in got if not kw.get("starts_only")] == plain
    # the walk stopped early (backward.WALK_EARLY_STOP) beside it: the build the operator runs with the host's offsets
    monkeypatch.setattr(backward, "WALK_EARLY_STOP", True)
    stopped = [kw for kw in walks() if kw.get("early_stop")]
    assert len(stopped) == 1 and stopped[0]["starts_only"] and stopped[0]["precise"] is precise
    assert [kw for kw in walks() if not kw.get("early_stop")] == got


def test_walk_stop_in_kernel_adds_the_emission_pass_and_the_stopped_walk(monkeypatch):
    """FLASHGDN_HOPPER_WALK_STOP_IN_KERNEL adds to a training step's builds the emission pass (``chunk_emits``), the
    count of the walks' chunks (``walk_covers``) and the walk stopped early, nothing else; on by default."""
    from flashgdn.kernels.hopper import backward
    from flashgdn.kernels.hopper.variants import training_variants

    assert backward.WALK_STOP_IN_KERNEL is (os.environ.get("FLASHGDN_HOPPER_WALK_STOP_IN_KERNEL", "1") == "1")
    monkeypatch.setattr(backward, "WALK_EARLY_STOP", False)
    monkeypatch.setattr(backward, "WALK_STARTS_ONLY", True)
    monkeypatch.setattr(backward, "WALK_STOP_IN_KERNEL", False)
    plain = [v[0] for v in training_variants(4, 16, flags="common")]
    assert not any(n.startswith(("chunk_emits[", "walk_covers[")) or n.endswith("_stop]") for n in plain)
    monkeypatch.setattr(backward, "WALK_STOP_IN_KERNEL", True)
    got = [v[0] for v in training_variants(4, 16, flags="common")]
    added = [n for n in got if n not in plain]
    assert added == ["state_grad_walk[4/16,bfloat16,dht=0,staged,starts_only,early_stop]",
                     "chunk_emits[4/16,bfloat16]", "walk_covers[16]"], added


@pytest.mark.parametrize("diag16, mma32, triangle, want", [
    (True, True, True, dict(diag16=True, mma32=True)),  # the default
    (True, False, True, dict(diag16=True)),
    (False, True, True, dict(triangle=True)),  # mma32 rides on diag16 only
    (False, False, False, {}),
])
def test_stage1_variants_carry_the_switched_build_options(diag16, mma32, triangle, want, monkeypatch):
    """Stage 1's serving and training builds are the ones the operator asks for under ``forward``'s switches
    (KKT_DIAG16, KKT_MMA32, KKT_TRIANGLE): the same keyword options ``hopper_stage1`` passes, so a precompiled cache
    holds exactly the kernels a call loads."""
    from flashgdn.kernels.hopper import forward
    from flashgdn.kernels.hopper.variants import serving_variants, training_variants

    monkeypatch.setattr(forward, "KKT_DIAG16", diag16)
    monkeypatch.setattr(forward, "KKT_MMA32", mma32)
    monkeypatch.setattr(forward, "KKT_TRIANGLE", triangle)
    assert forward.kkt_options() == want
    options = dict(async_loads=forward.KKT_ASYNC_LOADS, **forward._kkt_build_options(4))
    # (the transition pass's stage 1 with the chunks' bounds: test_precompiled_builds_follow_negligible_m_in_kernel)
    kkt = [v for v in training_variants(2, 8, flags="common") if v[1] == "kkt_inverse" and not v[2].get("chunk_bounds")]
    assert [v[0] for v in kkt] == ["kkt_inverse_async_5[2/8,bfloat16]", "kkt_inverse_with_A_async_5[2/8,bfloat16]"]
    assert [v for v in serving_variants(2, 8, flags="common")
            if v[1] == "kkt_inverse" and not v[2].get("chunk_bounds")] == kkt[:1]
    for v, store_inverse in zip(kkt, (False, True)):
        kw = dict(v[2])
        assert kw.pop("store_inverse", False) == store_inverse
        assert {k: kw[k] for k in ("Hqk", "Hv", "K", "qk_dtype", "a_dtype")} == dict(Hqk=2, Hv=8, K=128,
                                                                                    qk_dtype="bfloat16",
                                                                                    a_dtype="bfloat16")
        assert {k: x for k, x in kw.items() if k not in ("Hqk", "Hv", "K", "qk_dtype", "a_dtype")} == options


@pytest.mark.parametrize("heads, want", [((1, 1), (7, 7)), ((16, 16), (7, 7)), ((2, 6), (5, 5)), ((2, 8), (5, 5)),
                                         ((4, 8), (5, 5))])
def test_stage1_of_an_odd_group_follows_its_occupancy_switch(heads, want, monkeypatch):
    """FLASHGDN_HOPPER_KKT_ODD_GROUP_BLOCKS: stage 1 of a group of one (forward and the backward's, A stored) is built
    for the CTAs per SM of ``forward.ODD_GROUP_BLOCKS_PER_SM`` (the default), other groups for five (three included:
    its build at six spills); off, every group for five. What ``hopper_stage1`` asks for is what a training step
    precompiles."""
    from flashgdn.kernels.hopper import forward
    from flashgdn.kernels.hopper.variants import training_variants

    def blocks():
        kkt = [v[2] for v in training_variants(*heads, flags="common")
               if v[1] == "kkt_inverse" and not v[2].get("chunk_bounds")]
        assert [kw.get("store_inverse", False) for kw in kkt] == [False, True]
        return tuple(kw["blocks_per_sm"] for kw in kkt)

    group = heads[1] // heads[0]
    monkeypatch.setattr(forward, "KKT_ODD_GROUP_BLOCKS", False)
    assert blocks() == (5, 5)
    assert [forward._kkt_build_options(group, a)["blocks_per_sm"] for a in (False, True)] == [5, 5]
    monkeypatch.setattr(forward, "KKT_ODD_GROUP_BLOCKS", True)
    assert blocks() == want
    assert tuple(forward._kkt_build_options(group, a)["blocks_per_sm"] for a in (False, True)) == want
