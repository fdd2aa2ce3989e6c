"""Command line: ``python -m flashgdn.bench [run options] | merge ... | report ...``."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import List, Optional

RUN_EPILOG = """\
shape sets (K = V = 128):
  canonical  9 head configs x 19 sequence mixes = 171 shapes (DESIGN.md section 5); default modes: fwd
  bwd        (Hqk,Hv) in 16/32 8/16 4/8 2/4 x {8K, 32K} tokens in 1, 2, 4, 8 sequences of random
             (seeded, fixed) lengths = 32 shapes; default modes: fwd,fwdbwd (the table shows bwd = fwdbwd - fwd)
  quick      4 head configs x 6 mixes = 24 shapes, the anchor table of DESIGN.md; default modes: fwd,fwdbwd;
             also runs flashgdn's "reference" backend
  cp         Hv in 4/8/16 with Hqk = Hv/4, Hv/2 x single sequences 8K..128K and two-sequence mixes = 54 shapes
  custom     --heads 16/64,8/32 --seqlens 8192x4,1000+3000 (comma: mixes, '+': sequences of one mix,
             AxN: N sequences of A tokens, A may end in K)

implementations (each reported as run / missing / refused):
  flashgdn    the "hopper" backend (and "reference" on the quick set or on a CPU);
              flashgdn:reference or flashgdn:hopper+reference picks backends explicitly
  flashqla    flash_qla.chunk_gated_delta_rule
  fla         fla.ops.gated_delta_rule.chunk_gated_delta_rule, pure Triton (FLA_DISABLE_BACKEND_DISPATCH=1)
  flashinfer  flashinfer.gdn_prefill.chunk_gated_delta_rule (forward only)

other commands:
  python -m flashgdn.bench merge a.json b.json -o latest.json   merge parts, then render latest.md + plots
  python -m flashgdn.bench report latest.json --out-dir DIR     render DIR/latest.md and DIR/latest-*.png
"""


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashgdn.bench",
        description="Benchmark flashgdn against FlashQLA, FLA (Triton) and FlashInfer on the gated delta rule "
        "chunked prefill: same inputs, accuracy checked against a float64 reference, CUDA-graph timing.",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--set", default=None, help="shape set(s), comma separated: canonical, bwd, quick, cp "
                   "(default: quick, or custom when --heads/--seqlens are given)")
    p.add_argument("--heads", help="custom head configs Hqk/Hv, comma separated, e.g. 16/64,8/32")
    p.add_argument("--seqlens", help="custom sequence mixes, e.g. 8192x4,1000+3000,32K")
    p.add_argument("--modes", help="fwd, fwdbwd or fwd,fwdbwd (default: per set, see below)")
    p.add_argument("--cp", default=None, metavar="auto|off|CHUNKS",
                   help="flashgdn's context parallelism (its cp= argument; default: the operator's own); "
                        "recorded in each flashgdn record's note")
    p.add_argument("--impls", default="flashgdn,flashqla,fla,flashinfer",
                   help="implementations to run (default: all); flashgdn:BACKEND[+BACKEND] picks backends")
    p.add_argument("--part", help="i/n: run part i of n (parts keep head configs together, balanced by cost)")
    p.add_argument("--ctas", choices=("few", "full"), default=None,
                   help="only shapes that fill the GPU without context parallelism (full: sequences x Hv >= 64) "
                        "or only those that do not (few)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no new shape after this many seconds; what is done is saved")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu (wall-clock timing, "
                   "for testing the harness only)")
    p.add_argument("--head-dim", type=int, default=128, help="K = V (default 128)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the inputs (default 0)")
    p.add_argument("--check-tokens", type=int, default=8192,
                   help="longest slice checked against the float64 reference (default 8192)")
    p.add_argument("--check-grad-tokens", type=int, default=4096,
                   help="gradients are checked when the shortest sequence is at most this long (default 4096)")
    p.add_argument("--no-check", action="store_true", help="skip the accuracy check (err is null)")
    p.add_argument("--out-dir", default="bench-out", help="where the JSON, Markdown and PNGs go (default bench-out)")
    p.add_argument("--name", default=None, help="file stem (default: bench-SETS[-partIofN])")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--skip-done", metavar="JSON[,JSON]", default=None,
                   help="skip shapes that already have records in these result files (to finish a part that hit "
                   "its time budget)")
    p.add_argument("--list", action="store_true", help="list the selected shapes and exit")
    return p


def _merge_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashgdn.bench merge",
                                description="Merge result files, then render the Markdown table and plots.")
    p.add_argument("inputs", nargs="+", help="result JSON files (later ones win on the same record)")
    p.add_argument("-o", "--output", required=True, help="merged JSON")
    p.add_argument("--out-dir", default=None, help="where the .md and .png go (default: next to --output)")
    p.add_argument("--no-plots", action="store_true")
    return p


def _report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashgdn.bench report",
                                description="Render a result JSON as Markdown and PNG plots.")
    p.add_argument("input", help="result JSON")
    p.add_argument("--out-dir", default=None, help="output folder (default: next to the input)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--print", action="store_true", help="also print the table to the console")
    return p


def _stem(path: str) -> str:
    base = os.path.basename(path)
    return base[:-5] if base.endswith(".json") else base


def _render(doc, out_dir: str, stem: str, plots: bool) -> List[str]:
    from .report import render, write_report

    if plots:
        return write_report(doc, out_dir, stem)
    os.makedirs(out_dir, exist_ok=True)
    md = os.path.join(out_dir, f"{stem}.md")
    with open(md, "w") as f:
        f.write(render(doc, "md"))
    return [md]


def main_merge(argv: List[str]) -> int:
    from .results import load, merge, save

    a = _merge_parser().parse_args(argv)
    doc = merge([load(p) for p in a.inputs])
    save(doc, a.output)
    out_dir = a.out_dir or os.path.dirname(os.path.abspath(a.output))
    paths = _render(doc, out_dir, _stem(a.output), not a.no_plots)
    print(f"merged {len(a.inputs)} files, {len(doc['records'])} records -> {a.output}; " + ", ".join(paths))
    return 0


def main_report(argv: List[str]) -> int:
    from .report import render
    from .results import load

    a = _report_parser().parse_args(argv)
    doc = load(a.input)
    out_dir = a.out_dir or os.path.dirname(os.path.abspath(a.input))
    paths = _render(doc, out_dir, _stem(a.input), not a.no_plots)
    if a.print:
        print(render(doc, "text"))
    print("wrote " + ", ".join(paths))
    return 0


def select_shapes(a) -> list:
    from .shapes import custom_shapes, dedupe, named_set, parse_part, select_part

    shapes = []
    if a.heads or a.seqlens:
        if not (a.heads and a.seqlens):
            raise ValueError("custom shapes need both --heads and --seqlens")
        shapes += custom_shapes(a.heads, a.seqlens)
    sets = [s.strip() for s in (a.set or ("" if shapes else "quick")).split(",") if s.strip()]
    for s in sets:
        if s == "custom":
            if not (a.heads and a.seqlens):
                raise ValueError("--set custom needs --heads and --seqlens")
            continue
        shapes += named_set(s)
    shapes = dedupe(shapes)
    if a.ctas:
        shapes = [s for s in shapes if s.fills_gpu == (a.ctas == "full")]
    if a.part:
        shapes = select_part(shapes, parse_part(a.part))
    if a.skip_done:
        from .results import load

        done = set()
        for path in a.skip_done.split(","):
            if path.strip():
                done |= {(r["set"], r["h_qk"], r["h_v"], tuple(r["seqlens"])) for r in load(path.strip())["records"]}
        shapes = [s for s in shapes if (s.set, s.h_qk, s.h_v, s.seqlens) not in done]
    return shapes


def main_run(argv: List[str]) -> int:
    a = _run_parser().parse_args(argv)
    try:
        shapes = select_shapes(a)
        from .impls import DEFAULT_FLASHGDN_BACKEND, make_impls, parse_impls

        names, asked_backends = parse_impls(a.impls)
        modes = None
        if a.modes:
            modes = [m.strip() for m in a.modes.split(",") if m.strip()]
            bad = [m for m in modes if m not in ("fwd", "fwdbwd")]
            if bad or not modes:
                raise ValueError(f"--modes takes fwd and/or fwdbwd, got {a.modes!r}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if a.list:
        from .shapes import shape_cost

        total = 0.0
        for s in shapes:
            total += shape_cost(s)
            print(f"{s.set:9s} {s.heads_label:6s} {s.seqlens_label:30s} T={s.tokens:7d} N={s.n_seqs}")
        print(f"{len(shapes)} shapes, estimated cost {total:.0f} units")
        return 0
    if not shapes:
        print("no shapes selected", file=sys.stderr)
        return 2

    if "fla" in names:
        # before anything can import FLA: keep its dispatcher from handing the call to FlashQLA
        os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
    import torch

    from .runner import RunConfig, run

    dev_name = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_name.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu to test the harness)", file=sys.stderr)
        return 2
    device = torch.device(dev_name)
    if device.type == "cpu":
        print("NOTE: running on the CPU: timings are wall clock and only test the harness", file=sys.stderr)

    # flashgdn's backends: the default one always; the (slow) PyTorch reference on the quick set, on a CPU,
    # or when asked for
    explicit = bool(asked_backends)
    backends = asked_backends or [DEFAULT_FLASHGDN_BACKEND, "reference"]
    cp = None
    if a.cp is not None:
        from flashgdn.cp.plan import parse_cp

        try:
            cp = parse_cp(a.cp)
        except (TypeError, ValueError) as e:
            print(f"error: --cp: {e}", file=sys.stderr)
            return 2
    impls = make_impls(names, backends, cp)

    def backend_filter(impl, shape) -> bool:
        if impl.name != "flashgdn" or explicit or impl.backend == DEFAULT_FLASHGDN_BACKEND:
            return True
        return shape.set == "quick" or device.type == "cpu"

    if not explicit and not any(backend_filter(i, s) for i in impls if i.backend == "reference" for s in shapes):
        impls = [i for i in impls if i.backend != "reference"]

    sets = list(dict.fromkeys(s.set for s in shapes))
    stem = a.name or ("bench-" + "+".join(sets) + (f"-part{a.part.replace('/', 'of')}" if a.part else ""))
    json_path = os.path.join(a.out_dir, stem + ".json")
    # settings that change what flashgdn runs travel with the command, so a results file says what was measured
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("FLASHGDN_"))
    command = (env + " " if env else "") + "python -m flashgdn.bench " + shlex.join(argv)
    cfg = RunConfig(
        shapes=shapes, impls=impls, device=device, json_path=json_path, command=command, modes=modes,
        head_dim=a.head_dim, seed=a.seed, check=not a.no_check, check_tokens=a.check_tokens,
        check_grad_tokens=a.check_grad_tokens, time_budget_s=a.time_budget, backend_filter=backend_filter,
    )
    print(f"{len(shapes)} shapes ({', '.join(sets)}), modes {','.join(modes) if modes else 'per set'}, "
          f"device {device}", flush=True)
    doc = run(cfg)
    from .report import render

    print()
    print(render(doc, "text"))
    paths = _render(doc, a.out_dir, stem, not a.no_plots)
    print("wrote " + ", ".join([json_path] + paths))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "merge":
        return main_merge(argv[1:])
    if argv and argv[0] == "report":
        return main_report(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    return main_run(argv)
