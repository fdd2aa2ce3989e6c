"""The phased forward's kernels on the GPU's timeline: where each window's stage 1 and loop ran (GPU only).

    python benchmarks/phases_trace.py --shapes 16/32:28672+4096,2/8:4096x8 --out phases-trace.json

For each shape (``Hqk/Hv:seqlens``, seqlens as ``flashgdn.bench`` writes them) and each setting (unphased; phased
with stage 1 of each window as soon as the one before; phased with the stagger, ``phases.STAGGER``), the op as the
benchmark runs it (CUDA graph of one call, ``cp="off"``) timed by ``flashgdn.bench.timing.measure``, and one replay
of its graph under the PyTorch profiler: every kernel with its stream, start and end in microseconds from the
first kernel's start. Whether stage 1 of a window ran while the loop of the window before it did, and how long the
gaps between the loop's launches are, is read from those rows.
"""
import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SETTINGS = {"unphased": dict(PHASES=False), "phased": dict(PHASES=True, STAGGER=False),
            "staggered": dict(PHASES=True, STAGGER=True)}


def parse_shapes(text):
    from flashgdn.bench.shapes import custom_shapes

    shapes = []
    for part in text.split(";") if ";" in text else text.split(","):
        heads, _, seqlens = part.partition(":")
        if not seqlens:
            raise SystemExit(f"--shapes: expected Hqk/Hv:seqlens, got {part!r}")
        shapes += custom_shapes(heads, seqlens)
    return shapes


def short(name: str) -> str:
    for key in ("chunk_forward_rso", "kkt_inverse", "chunk_plan", "sleep", "Memcpy", "Memset"):
        if key in name:
            return key
    return name[:40]


def graph_kernels(fn):
    """The kernels of one replay of a CUDA graph of ``fn``: [(name, stream, start_us, end_us)] from the first."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    rows = [(e["name"], e.get("args", {}).get("stream", e.get("tid")), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
            for e in events if e.get("cat") == "kernel"]
    rows.sort(key=lambda r: r[2])
    t0 = rows[0][2] if rows else 0.0
    return [(short(n), s, round(a - t0, 2), round(b - t0, 2)) for n, s, a, b in rows]


def main(argv=None) -> int:
    from flashgdn import chunk_gated_delta_rule
    from flashgdn.bench.inputs import make_inputs
    from flashgdn.bench.timing import measure, timed_call
    from flashgdn.kernels.hopper import phases
    from stage_timing import results_header

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    out = {**results_header(argv, "phases_trace.py"), "rows": []}
    for shape in parse_shapes(args.shapes):
        inp = make_inputs(shape, 128, 128, dev)
        chunks = phases.sequence_chunks(inp.cu_seqlens_cpu)
        windows = phases.plan_windows(chunks, shape.h_qk, shape.h_v, phases.PhaseModel.for_device(dev))

        def fn():
            with torch.no_grad():
                return chunk_gated_delta_rule(inp.q, inp.k, inp.v, inp.g, inp.beta, scale=inp.scale,
                                              initial_state=inp.h0, output_final_state=True,
                                              cu_seqlens=inp.cu_seqlens, cu_seqlens_cpu=inp.cu_seqlens_cpu,
                                              backend="hopper", cp="off")

        row = {"h_qk": shape.h_qk, "h_v": shape.h_v, "seqlens": list(shape.seqlens), "windows": windows,
               "ms": {}, "kernels": {}}
        saved = {k: getattr(phases, k) for k in ("PHASES", "STAGGER")}
        try:
            for name, setting in SETTINGS.items():
                for k, v in setting.items():
                    setattr(phases, k, v)
                _, dt = timed_call(fn, dev)
                _, dt = timed_call(fn, dev)
                row["ms"][name] = measure(fn, dev, dt).ms
                row["kernels"][name] = graph_kernels(fn)
        finally:
            for k, v in saved.items():
                setattr(phases, k, v)
        out["rows"].append(row)
        print(f"{shape.h_qk}/{shape.h_v} {shape.seqlens}: windows {windows}; "
              + ", ".join(f"{k} {v:.4f} ms" for k, v in row["ms"].items()), flush=True)
        for name, ks in row["kernels"].items():
            print(f"  {name}:")
            for k in ks:
                print(f"    {k[0]:<18} stream {k[1]!s:>4} {k[2]:9.1f} {k[3]:9.1f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
