"""Time each stage of the Hopper forward on its own (GPU only), to see where the time goes.

    python benchmarks/stage_timing.py [--out FILE.json]

For a few shapes of DESIGN.md §5 it times, by CUDA-graph replay (median), the chunk plan, the ``kkt_inverse``
stage, the chunk-loop kernels asked for by ``--loops`` ("simple", "ws", "rs", "rsd", "uw", "fused", "rso"; the
state-only variants of rs, rsd and uw beside them) and the whole op (with rs and with each loop compared to it), without
and with context parallelism (``cp=16``, ``cp=64``; with the paired transition pass and with CP's fused index and
splice kernels), and prints them beside the DESIGN.md floor. With ``--backward`` also the Hopper backward's
stages (stage 1 storing A, the chunk states, the state-gradient walk, ``chunk_grad``), the whole backward
without and with the context parallelism the cost model picks, and the backward's peak extra memory.
"""
import argparse
import json
import sys

import torch

SHAPES = [
    # (Hqk, Hv, seqlens), the most telling first (a time limit may stop the run after any shape)
    (16, 64, [4096] * 8),
    (2, 8, [32768]),  # eight CTAs: the context-parallel case
    (16, 32, [32768]),
    (2, 8, [1024] * 8),
    (16, 32, [4096] * 8),
    (32, 32, [8192]),
]


#: segment lengths (chunks) at which the op is also timed with context parallelism
CP_SEGMENTS = (16, 64)
#: what --backward-only times
BACKWARD_CORE = ("bwd_stage1", "bwd_states", "bwd_walk", "bwd_chunk_grad", "bwd_chunk_grad_staged_loads",
                 "bwd_chunk_grad_element_factors", "bwd_chunk_grad_masked_dg", "bwd_chunk_grad_narrow_stores",
                 "bwd_chunk_grad_heads_inner",
                 "bwd_torch_group_sums", "bwd_states_precise",
                 "bwd_walk_precise", "bwd", "bwd_cpauto")


def make(Hqk, Hv, seqlens, dev="cuda", K=128, V=128):
    T = sum(seqlens)
    q = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, device=dev), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, Hqk, K, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, T, Hv, V, device=dev).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, Hv, device=dev)) / 16
    beta = torch.sigmoid(torch.randn(1, T, Hv, device=dev))
    h0 = torch.randn(len(seqlens), Hv, K, V, device=dev)
    cu = torch.tensor([0] + list(seqlens), device=dev).cumsum(0).to(torch.int32)
    return q, k, v, g, beta, h0, cu


def results_header(argv, script: str = "stage_timing.py") -> dict:
    """What a results file must say beside its numbers: GPU, date, command (``script`` with ``argv``), versions and
    commit."""
    import datetime
    import shlex
    import subprocess

    from flashgdn.bench.runner import collect_versions

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    args = sys.argv[1:] if argv is None else list(argv)
    return {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"python3 benchmarks/{script} " + " ".join(shlex.quote(a) for a in args),
        "versions": collect_versions([], torch.device("cuda")),
        "commit": commit,
        "tree": working_tree_hash(),
    }


def working_tree_hash() -> str:
    """Git's tree hash of the files as they are (tracked and unignored, changes included), without touching the
    index: a copy of the tree run elsewhere can carry a stale HEAD, but the same files give the same tree, which
    ``git log --format='%h %T'`` maps back to a commit when they were committed as they are."""
    import os
    import shutil
    import subprocess
    import tempfile

    try:
        git_dir = subprocess.run(["git", "rev-parse", "--git-dir"], capture_output=True, text=True,
                                 check=True).stdout.strip()
        with tempfile.TemporaryDirectory() as tmp:
            index = os.path.join(tmp, "index")
            if os.path.exists(os.path.join(git_dir, "index")):
                shutil.copy(os.path.join(git_dir, "index"), index)
            env = dict(os.environ, GIT_INDEX_FILE=index)
            subprocess.run(["git", "add", "-A"], env=env, capture_output=True, check=True)
            return subprocess.run(["git", "write-tree"], env=env, capture_output=True, text=True,
                                  check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--loops", default=None,
                    help="chunk-loop kernels to time: simple,ws,rs,rsd,fused,uw,rso (default simple,ws,rs,rsd; with "
                         "--backward-only none beyond the rs builds every row makes)")
    ap.add_argument("--kkt-sync", action="store_true", help="also time kkt_inverse with k's tile through registers")
    ap.add_argument("--kkt-5", action="store_true",
                    help="also time kkt_inverse at five CTAs per SM beside four (blocks_per_sm=5; Ag and g~ compared "
                         "bit for bit), and the op with each")
    ap.add_argument("--unswizzled-v", action="store_true",
                    help="also time the rso loop and the rs state-only pass with v's tiles unswizzled (bits compared)")
    ap.add_argument("--rso-lean-state", action="store_true",
                    help="also time the rso loop with its state paths' column factors in registers (lean_state; bits "
                         "compared), and the op with it")
    ap.add_argument("--rs-lean", action="store_true",
                    help="also time the rs state-only pass with its column factors in registers (lean; bits compared) "
                         "and the op with CP on 64-chunk segments with it")
    ap.add_argument("--rso-plain", action="store_true",
                    help="also time the rso loop with its output path untrimmed (lean_output=False, the build "
                         "before; bits compared), and the op with it")
    ap.add_argument("--backward", action="store_true", help="also time the Hopper backward's stages")
    ap.add_argument("--backward-only", action="store_true",
                    help="only the backward's stages, the whole backward with and without CP and its memory")
    ap.add_argument("--columns", default=None,
                    help="time only these columns (comma-separated keys, e.g. op,loop_rso,bwd_chunk_grad)")
    ap.add_argument("--no-paired", action="store_true",
                    help="leave out the op with the paired CP transition pass (FLASHGDN_HOPPER_CP_PAIRED)")
    args = ap.parse_args(argv)
    if args.loops is None:  # a backward-only run times no chunk loop: building one would be a compile for nothing
        args.loops = "" if args.backward_only else "simple,ws,rs,rsd"
    from triton.testing import do_bench_cudagraph

    from flashgdn import chunk_gated_delta_rule
    from flashgdn.bench.inputs import floor_ms
    from flashgdn.bench.shapes import Shape
    from flashgdn.kernels.hopper import backend
    from flashgdn.kernels.hopper import forward as fw
    from flashgdn.kernels.hopper.chunk_forward import build_chunk_forward
    from flashgdn.kernels.hopper.chunk_forward_rs import build_chunk_forward_rs
    from flashgdn.kernels.hopper.chunk_forward_rso import build_chunk_forward_rso
    from flashgdn.kernels.hopper.chunk_forward_uw import build_chunk_forward_uw
    from flashgdn.kernels.hopper.chunk_forward_ws import build_chunk_forward_ws
    from flashgdn.kernels.hopper.kkt_inverse import build_kkt_inverse

    rows = []
    for Hqk, Hv, seqlens in SHAPES:
        q, k, v, g, beta, h0, cu = make(Hqk, Hv, seqlens)
        T, N = q.shape[1], len(seqlens)
        loops = args.loops.split(",")
        # only the kernels asked for are built (a build not in the cache is a compile)
        prep_async = build_kkt_inverse(Hqk, Hv, 128, "bfloat16", "bfloat16", async_loads=True)
        prep = build_kkt_inverse(Hqk, Hv, 128, "bfloat16", "bfloat16") if args.kkt_sync else prep_async
        prep5 = (build_kkt_inverse(Hqk, Hv, 128, "bfloat16", "bfloat16", async_loads=True, blocks_per_sm=5)
                 if args.kkt_5 else None)
        simple = build_chunk_forward(Hqk, Hv, 128, 128, 128, "bfloat16", True, True, False) if "simple" in loops else None
        ws = build_chunk_forward_ws(Hqk, Hv, 128, 128, "bfloat16", True, True, False) if "ws" in loops else None
        rs = build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False)
        rs_state = build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False, False)
        rsd = (build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False, decayed_k=True)
               if "rsd" in loops else None)
        rsd_state = (build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False, False, decayed_k=True)
                     if "rsd" in loops else None)
        compared = [loop for loop in ("uw", "rsd", "fused", "rso") if loop in loops]  # each beside rs, op and outputs
        fused_loop = (build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False, decayed_k=True,
                                             inverse_in_loop=True) if "fused" in loops else None)
        rso = build_chunk_forward_rso(Hqk, Hv, 128, 128, "bfloat16", True, True, False) if "rso" in loops else None
        # the builds before v's tiles were swizzled (their A/B), with --unswizzled-v
        rso_lean_state = (build_chunk_forward_rso(Hqk, Hv, 128, 128, "bfloat16", True, True, False,
                                                  lean_state=True) if args.rso_lean_state else None)
        rs_state_lean = (build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False, False, lean=True)
                         if args.rs_lean else None)
        rso_plain = (build_chunk_forward_rso(Hqk, Hv, 128, 128, "bfloat16", True, True, False, lean_output=False)
                     if args.rso_plain else None)
        rso_unswizzled = (build_chunk_forward_rso(Hqk, Hv, 128, 128, "bfloat16", True, True, False, swizzled_v=False)
                          if args.unswizzled_v else None)
        rs_state_unswizzled = (build_chunk_forward_rs(Hqk, Hv, 128, 128, "bfloat16", True, True, False, False,
                                                      swizzled_v=False) if args.unswizzled_v else None)
        uw = build_chunk_forward_uw(Hqk, Hv, 128, 128, "bfloat16", True, True, False) if "uw" in loops else None
        uw_state = build_chunk_forward_uw(Hqk, Hv, 128, 128, "bfloat16", True, True, False, False) if "uw" in loops else None
        o1 = torch.empty(1, 1, Hv, 128, device="cuda", dtype=torch.bfloat16)
        bounds, first_slot = fw.chunk_plan(cu, T, N)
        S = bounds.shape[0]
        gcum = torch.empty(Hv, S * 64, device="cuda")
        Ag = torch.empty(S, Hv, 64, 64, device="cuda", dtype=torch.bfloat16)
        o = torch.empty(1, T, Hv, 128, device="cuda", dtype=torch.bfloat16)
        ht = torch.empty(N, Hv, 128, 128, device="cuda")
        scale = 128 ** -0.5
        prep(k, g, beta, bounds, gcum, Ag)
        cu_cpu = cu.cpu()
        times = {
            "chunk_bounds": lambda: fw.chunk_plan(cu, T, N),
            # k's tile through registers (the build before KKT_ASYNC_LOADS), with --kkt-sync
            "kkt_inverse": (lambda: prep(k, g, beta, bounds, gcum, Ag)) if args.kkt_sync else None,
            "kkt_inverse_async": lambda: prep_async(k, g, beta, bounds, gcum, Ag),  # k's tile by cp.async
            "kkt_inverse_5": (lambda: prep5(k, g, beta, bounds, gcum, Ag)) if prep5 else None,  # with --kkt-5
            "loop_simple": (lambda: simple(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o, ht)) if "simple" in loops else None,
            "loop_ws": (lambda: ws(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o, ht)) if "ws" in loops else None,
            "loop_rs": (lambda: rs(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o, ht)) if "rs" in loops else None,
            # the state-only variant (context parallelism's transition passes)
            "loop_rs_state": (lambda: rs_state(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o1, ht))
            if "rs" in loops else None,
            "loop_rsd": (lambda: rsd(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o, ht)) if "rsd" in loops else None,
            "loop_rsd_state": (lambda: rsd_state(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o1, ht))
            if "rsd" in loops else None,
            # stage 1 inside the loop: compare with kkt_inverse + loop_rsd
            "loop_fused": (lambda: fused_loop(q, k, v, g, beta, cu, h0, scale, o, ht)) if "fused" in loops else None,
            # the output on a warpgroup of its own
            "loop_rso": (lambda: rso(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o, ht)) if "rso" in loops else None,
            "loop_rso_lean_state": (lambda: rso_lean_state(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o, ht))
            if rso_lean_state else None,
            "loop_rs_state_lean": (lambda: rs_state_lean(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o1, ht))
            if rs_state_lean else None,
            "loop_rso_plain": (lambda: rso_plain(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o, ht))
            if rso_plain else None,
            "loop_rso_unswizzled": (lambda: rso_unswizzled(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o, ht))
            if rso_unswizzled else None,
            "loop_rs_state_unswizzled": (
                lambda: rs_state_unswizzled(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o1, ht))
            if rs_state_unswizzled else None,
            "loop_uw": (lambda: uw(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o, ht)) if "uw" in loops else None,
            "loop_uw_state": (lambda: uw_state(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o1, ht))
            if "uw" in loops else None,
            "op": lambda: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                 cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, backend="hopper", cp="off"),
            # what cp="auto" does: off unless FLASHGDN_HOPPER_CP=auto lets the cost model decide
            "op_cpauto": lambda: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                        cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, backend="hopper"),
        }
        for loop in (["rs"] + compared) if compared else []:
            times[f"op_{loop}"] = (lambda loop=loop: fw.hopper_forward(q, k, v, g, beta, scale, h0, True, cu, False,
                                                                       chunk_loop=loop))

        def op(cp):
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                          cu_seqlens_cpu=cu_cpu, backend="hopper", cp=cp)

        for cp in CP_SEGMENTS:
            times[f"op_cp{cp}"] = lambda cp=cp: op(cp)

        # the transition pass on the paired kernel, stages 0 and 1 shared (FLASHGDN_HOPPER_CP_PAIRED)
        paired = lambda cp: switched(backend, "CP_PAIRED", True, lambda: op(cp))  # noqa: E731
        # CP's segment index and splice as one kernel each (FLASHGDN_HOPPER_CP_FUSED=1)
        fused = lambda cp: switched(backend, "CP_FUSED", True, lambda: op(cp))  # noqa: E731
        if not args.no_paired:  # the kernels not yet run on a GPU when the last tests timed out
            times["op_cpauto_pairs"] = lambda: paired("auto")
            times["op_cp64_pairs"] = lambda: paired(64)
            times["op_cp16_fused"] = lambda: fused(16)
            times["op_cp64_fused"] = lambda: fused(64)
            times["op_cpauto_fused"] = lambda: fused("auto")
        bwd_error = None
        if args.backward_only:
            args.backward = True
            times = {}
        if args.backward:
            try:
                bwd = backward_timings(q, k, v, g, beta, h0, cu, cu_cpu, scale)
                if args.backward_only and not args.columns:
                    bwd = {name: fn for name, fn in bwd.items() if name in BACKWARD_CORE}
                times.update(bwd)
            except Exception as e:  # noqa: BLE001 - report and go on with the forward's timings
                bwd_error = f"{type(e).__name__}: {e}"[:300]
        floor = floor_ms(Shape("custom", Hqk, Hv, tuple(seqlens)), 128, 128, "fwd")
        live = bounds[:, 1] > 0
        row = {"h_qk": Hqk, "h_v": Hv, "seqlens": seqlens, "floor_ms": floor,
               "kkt_finite": bool(Ag[live].isfinite().all())}
        rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
        if prep5 is not None:
            times["op_kkt_5"] = lambda: switched(fw, "KKT_BLOCKS_PER_SM", 5, lambda: op("off"))
            times["op_kkt_4"] = lambda: switched(fw, "KKT_BLOCKS_PER_SM", 4, lambda: op("off"))
            Ag2, gcum2 = torch.full_like(Ag, float("nan")), torch.full_like(gcum, float("nan"))
            prep_async(k, g, beta, bounds, gcum, Ag)
            prep5(k, g, beta, bounds, gcum2, Ag2)
            row["kkt_5_same_bits"] = bool(torch.equal(Ag[live], Ag2[live]) and torch.equal(
                gcum.view(Hv, -1, 64)[:, live], gcum2.view(Hv, -1, 64)[:, live]))
        def loop_outputs(loop):  # o and the final state of a loop with an output, both poisoned first
            o.fill_(float("nan"))
            ht.fill_(float("nan"))
            loop(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o, ht)
            return [o.clone(), ht.clone()]

        def state_outputs(state):  # the final state of a state-only pass, poisoned first
            ht.fill_(float("nan"))
            state(q, k, v, gcum, Ag, cu, first_slot, h0, scale, o1, ht)
            return [ht.clone()]

        def same_bits(a, b):
            return all(torch.equal(x, y) for x, y in zip(a, b))

        # each A/B build against the default, bit for bit
        if rso_lean_state is not None and rso is not None:
            times["op_rso_lean_state"] = lambda: switched(fw, "RSO_LEAN_STATE", True, lambda: op("off"))
            row["rso_lean_state_same_bits"] = same_bits(loop_outputs(rso), loop_outputs(rso_lean_state))
        if rs_state_lean is not None:
            times["op_cp64_rs_lean"] = lambda: switched(fw, "LEAN_STATE_PASSES", True, lambda: op(64))
            row["rs_lean_same_bits"] = same_bits(state_outputs(rs_state), state_outputs(rs_state_lean))
        if rso_plain is not None and rso is not None:
            times["op_rso_plain"] = lambda: switched(fw, "RSO_LEAN_OUTPUT", False, lambda: op("off"))
            row["rso_plain_same_bits"] = same_bits(loop_outputs(rso), loop_outputs(rso_plain))
        if rso_unswizzled is not None and rso is not None:
            row["unswizzled_v_same_bits"] = same_bits(loop_outputs(rso) + state_outputs(rs_state),
                                                      loop_outputs(rso_unswizzled) + state_outputs(rs_state_unswizzled))
        if compared:  # the loops' outputs beside rs's (each is checked against the oracle by the tests)
            with torch.no_grad():
                o_rs, h_rs = fw.hopper_forward(q, k, v, g, beta, scale, h0, True, cu, False, chunk_loop="rs")
                for loop in compared:
                    o_x, h_x = fw.hopper_forward(q, k, v, g, beta, scale, h0, True, cu, False, chunk_loop=loop)
                    row[f"{loop}_vs_rs_o"], row[f"{loop}_vs_rs_state"] = rel(o_x, o_rs), rel(h_x, h_rs)
        if args.columns:
            wanted = args.columns.split(",")
            times = {name: times.get(name) for name in wanted}
        with torch.no_grad():
            for name, fn in times.items():
                if fn is None:
                    row[name] = None
                    continue
                try:
                    fn()
                    torch.cuda.synchronize()
                    row[name] = do_bench_cudagraph(fn, rep=50, return_mode="median")
                except Exception as e:  # noqa: BLE001 - report and go on
                    row[name] = None
                    row[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
        if args.backward:
            if bwd_error is not None:
                row["bwd_error"] = bwd_error
            else:
                try:
                    row["bwd_peak_extra_mib"] = backward_peak_mib(q, k, v, g, beta, h0, cu, cu_cpu, scale)
                    from flashgdn.kernels.hopper import backward as bw
                    for key, on in (("bwd_fused_peak_extra_mib", True), ("bwd_unfused_peak_extra_mib", False)):
                        row[key] = switched(bw, "FUSED_BACKWARD", on, lambda: backward_peak_mib(
                            q, k, v, g, beta, h0, cu, cu_cpu, scale))
                except Exception as e:  # noqa: BLE001
                    row["bwd_peak_extra_mib_error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # after every shape, so that a time limit leaves the shapes done
            with open(args.out, "w") as fh:
                json.dump(results_header(argv) | {"rows": rows}, fh, indent=1)
    cols = [("chunk plan", "chunk_bounds"), ("kkt_inverse", "kkt_inverse"), ("kkt async loads", "kkt_inverse_async"),
            ("kkt 5 per SM", "kkt_inverse_5"), ("op kkt 5 per SM", "op_kkt_5"), ("op kkt 4 per SM", "op_kkt_4"),
            ("loop rso lean state", "loop_rso_lean_state"), ("op rso lean state", "op_rso_lean_state"),
            ("rs state-only lean", "loop_rs_state_lean"), ("op cp=64 rs lean", "op_cp64_rs_lean"),
            ("loop rso untrimmed output", "loop_rso_plain"), ("op rso untrimmed output", "op_rso_plain"),
            ("loop rso unswizzled v", "loop_rso_unswizzled"),
            ("rs state-only unswizzled v", "loop_rs_state_unswizzled"),
            ("loop simple", "loop_simple"), ("loop ws", "loop_ws"), ("loop rs", "loop_rs"),
            ("rs state-only", "loop_rs_state"), ("loop rsd", "loop_rsd"), ("rsd state-only", "loop_rsd_state"),
            ("loop fused", "loop_fused"), ("loop rso", "loop_rso"),
            ("loop uw", "loop_uw"), ("uw state-only", "loop_uw_state"),
            ("op", "op"), ("op rs", "op_rs"), ("op rsd", "op_rsd"), ("op fused", "op_fused"), ("op uw", "op_uw"),
            ("op rso", "op_rso"),
            ("op cp=auto", "op_cpauto"),
            ("op cp=auto paired", "op_cpauto_pairs"), ("op cp=64 paired", "op_cp64_pairs"),
            ("op cp=16 fused", "op_cp16_fused"), ("op cp=64 fused", "op_cp64_fused"),
            ("op cp=auto fused", "op_cpauto_fused")]
    cols += [(f"op cp={c}", f"op_cp{c}") for c in CP_SEGMENTS]
    if args.backward:
        cols += [("bwd stage 1", "bwd_stage1"), ("bwd states", "bwd_states"), ("bwd walk", "bwd_walk"),
                 ("bwd chunk_grad", "bwd_chunk_grad"),
                 ("chunk_grad reg-staged loads", "bwd_chunk_grad_staged_loads"),
                 ("chunk_grad per-element factors", "bwd_chunk_grad_element_factors"),
                 ("chunk_grad masked dg sum", "bwd_chunk_grad_masked_dg"),
                 ("chunk_grad 4-byte stores", "bwd_chunk_grad_narrow_stores"),
                 ("chunk_grad heads inner", "bwd_chunk_grad_heads_inner"),
                 ("chunk_grad pair sums", "bwd_chunk_grad_pair_sums"), ("bwd pair sums", "bwd_pair_sums"),
                 ("fused walk + chunk_grad", "bwd_fused_kernel"), ("bwd fused", "bwd_fused"),
                 ("bwd walk + chunk_grad", "bwd_unfused"),
                 ("bwd fused cp=auto", "bwd_fused_cpauto"), ("bwd fused cp=16", "bwd_fused_cp16"),
                 ("bwd fused cp=64", "bwd_fused_cp64"),
                 ("bwd torch group sums", "bwd_torch_group_sums"),
                 ("states precise", "bwd_states_precise"), ("walk precise", "bwd_walk_precise"),
                 ("states unstaged", "bwd_states_unstaged"), ("walk unstaged", "bwd_walk_unstaged"),
                 ("bwd", "bwd"), ("bwd cp=auto", "bwd_cpauto")]
        cols += [(f"bwd cp={c}", f"bwd_cp{c}") for c in CP_SEGMENTS] + [("bwd MiB", "bwd_peak_extra_mib"),
                                                                  ("bwd fused MiB", "bwd_fused_peak_extra_mib"),
                                                                  ("bwd unfused MiB", "bwd_unfused_peak_extra_mib")]
    print("\n| Hqk/Hv | seqlens | floor | " + " | ".join(c[0] for c in cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for r in rows:
        f = lambda x: "-" if r.get(x) is None else f"{r[x]:.3f}"  # noqa: E731
        mix = f"{r['seqlens'][0]}x{len(r['seqlens'])}"
        print(f"| {r['h_qk']}/{r['h_v']} | {mix} | {r['floor_ms']:.3f} | " + " | ".join(f(c[1]) for c in cols) + " |")
    return 0


def switched(module, name: str, value, fn):
    """``fn()`` with the switch ``module.name`` (a module-level setting such as ``backend.CP_PAIRED``) set to
    ``value`` for the call, then restored."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        return fn()
    finally:
        setattr(module, name, saved)


def backward_timings(q, k, v, g, beta, h0, cu, cu_cpu, scale) -> dict:
    """The Hopper backward's stages and the whole of it, as callables to time."""
    from flashgdn.api.validate import validate
    from flashgdn.kernels.hopper.backend import HopperBackend
    from flashgdn.kernels.hopper.backward import HopperBackwardStages, _plan_and_stage1, hopper_backward

    gen = torch.Generator(device=q.device).manual_seed(1)
    do = torch.randn(v.shape, generator=gen, device=q.device).to(v.dtype)
    dht = torch.randn(h0.shape, generator=gen, device=q.device)
    st = HopperBackwardStages()
    precise = HopperBackwardStages(precise=True)  # the precise mode's states pass and walk (forward.PRECISE)
    with torch.no_grad():
        states = st.chunk_states(q, k, v, g, beta, h0, cu, cu_cpu)
        ds_end, _ = st.state_gradients(q, k, g, beta, do, dht, scale, cu, cu_cpu)
    p = validate(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                 cu_seqlens_cpu=cu_cpu)
    plan = HopperBackend._plan(p)
    from dataclasses import replace

    from flashgdn.kernels.hopper import backward

    # the backward on forced segment lengths (the forward's plan for cp=<chunks>), None where that does not split
    forced = {c: HopperBackend._plan(replace(p, cp=c)) for c in CP_SEGMENTS}

    def whole(pl):  # the whole backward on plan ``pl`` (None: the sequences themselves)
        return lambda: hopper_backward(q, k, v, g, beta, do, dht, scale, h0, cu, False, pl, cu_cpu)

    def states_pass():
        return st.chunk_states(q, k, v, g, beta, h0, cu, cu_cpu)

    def walk():
        return st.state_gradients(q, k, g, beta, do, dht, scale, cu, cu_cpu)

    def chunk_grad():
        return st.chunk_gradients(q, k, v, g, beta, do, states, ds_end, scale, cu, cu_cpu)

    def with_switch(name, value, stage):  # a stage with one of backward's switches set otherwise (its A/B)
        return lambda: switched(backward, name, value, stage)

    # the walk and chunk_grad as one kernel (backward.FUSED_BACKWARD): the kernel alone (what bwd_walk and
    # bwd_chunk_grad together do), and the whole backward with it, without CP, with the plan's and on forced segments
    fused_st = HopperBackwardStages(fused=True)
    times = {
        "bwd_fused_kernel": lambda: fused_st.fused_gradients(q, k, v, g, beta, do, states, dht, scale, cu, cu_cpu),
        "bwd_fused": with_switch("FUSED_BACKWARD", True, whole(None)),
        "bwd_unfused": with_switch("FUSED_BACKWARD", False, whole(None)),
        "bwd_fused_cpauto": with_switch("FUSED_BACKWARD", True, whole(plan)),
    }
    for c, pl in forced.items():
        if pl is not None:
            times[f"bwd_cp{c}"] = whole(pl)
            times[f"bwd_fused_cp{c}"] = with_switch("FUSED_BACKWARD", True, whole(pl))

    return times | {
        "bwd_stage1": lambda: _plan_and_stage1(q, k, g, beta, cu, store_inverse=True),
        "bwd_states": states_pass,
        "bwd_walk": walk,
        "bwd_chunk_grad": chunk_grad,
        "bwd_chunk_grad_staged_loads": with_switch("CHUNK_GRAD_ASYNC_LOADS", False, chunk_grad),
        "bwd_chunk_grad_element_factors": with_switch("CHUNK_GRAD_ROW_FACTORS", False, chunk_grad),
        "bwd_chunk_grad_masked_dg": with_switch("CHUNK_GRAD_SCAN_DG", False, chunk_grad),
        "bwd_chunk_grad_narrow_stores": with_switch("CHUNK_GRAD_WIDE_STORES", False, chunk_grad),
        "bwd_chunk_grad_heads_inner": with_switch("CHUNK_GRAD_HEADS_INNER", True, chunk_grad),
        # chunk_grad alone, and the whole backward (the group sums it saves run after chunk_grad)
        "bwd_chunk_grad_pair_sums": with_switch("CHUNK_GRAD_PAIR_SUMS", True, chunk_grad),
        "bwd_pair_sums": with_switch("CHUNK_GRAD_PAIR_SUMS", True, whole(None)),
        # the whole backward with dq and dk's group sums by torch's sum instead of group_sum.py's kernel
        "bwd_torch_group_sums": with_switch("GROUP_SUM_KERNEL", False, whole(None)),
        "bwd_states_precise": lambda: precise.chunk_states(q, k, v, g, beta, h0, cu, cu_cpu),
        "bwd_walk_precise": lambda: precise.state_gradients(q, k, g, beta, do, dht, scale, cu, cu_cpu),
        "bwd_states_unstaged": with_switch("STAGED_STATE_STORES", False, states_pass),
        "bwd_walk_unstaged": with_switch("STAGED_STATE_STORES", False, walk),
        "bwd": whole(None),
        "bwd_cpauto": whole(plan),
    }


def backward_peak_mib(q, k, v, g, beta, h0, cu, cu_cpu, scale) -> float:
    """Peak device memory the Hopper backward allocates beyond what exists before it (MiB), without CP."""
    from flashgdn.kernels.hopper.backward import hopper_backward

    do = torch.randn_like(v)
    dht = torch.randn_like(h0)
    with torch.no_grad():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = hopper_backward(q, k, v, g, beta, do, dht, scale, h0, cu, False, None, cu_cpu)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2 ** 20


if __name__ == "__main__":
    sys.exit(main())
