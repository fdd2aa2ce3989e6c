"""FlashQLA's TileLang kernels compiled here for sm_90a, ahead of a benchmark on the GPU machine (no GPU needed).

FlashQLA compiles its kernels at their first call, one build per head configuration and set of flags; on a fresh GPU
machine that is ~160 s a head configuration, device time that a side-by-side run pays before it measures anything.
Its builds are keyed like ours (TileLang's kernel cache: the kernel's script, the factory's arguments, the target), and
its target on an SM90 GPU is ``{"kind": "cuda", "arch": "sm_90a"}``, so builds made here with that target are the
ones it finds there, when this cache goes along with ours (``.device/`` and ``scripts/gpu_rounds.sh``).

Which builds: FlashQLA's operator (``flash_qla.chunk_gated_delta_rule``, its forward and backward) is run here on
the benchmark's own inputs (``flashgdn.bench.inputs.make_inputs`` on the CPU, each shape of the named sets) with every
TileLang kernel factory recorded instead of compiled and every kernel launch skipped: the factories' arguments are
what its host code decides from the shapes, dtypes and offsets (its CP plan included), which the CPU has. Its few
import-time and launch-time CUDA queries are answered as on an H100 or H200 SXM (132 SMs, not capturing, device
context a no-op). The distinct factory calls are then made again with the factories restored, which compiles
them (TileLang's lazy factories return the kernel without launching it).

    python benchmarks/anchor_cache.py --site /tmp/site --set cp --modes fwd,fwdbwd            # list the builds
    TILELANG_CACHE_DIR=/tmp/kc python benchmarks/anchor_cache.py --site /tmp/site --set cp --compile [--jobs 2]

``--site``: a folder holding the ``flash_qla`` package (the GPU machine's stack, ``.device/stack.tar.xz``, has the
pinned flash-qla). The shapes' outputs are never computed: only the host's decisions are taken.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
import types
from typing import Dict, List, Sequence, Tuple

#: SMs of the H100 and H200 SXM (FlashQLA sizes some launches by it, and one of its factories' arguments with it)
NUM_SMS = 132


def _encode(x):
    """A factory argument as JSON (torch dtypes by name); None where it has no such form."""
    import torch

    if isinstance(x, torch.dtype):
        return {"torch_dtype": str(x).removeprefix("torch.")}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (tuple, list)):
        items = [_encode(v) for v in x]
        return None if any(i is None and v is not None for i, v in zip(items, x)) else {"seq": items}
    return None


def _call_key(name: str, args: tuple, kwargs: dict) -> str:
    return json.dumps([name, [_encode(a) for a in args], {k: _encode(v) for k, v in sorted(kwargs.items())}])


@contextlib.contextmanager
def sm90_host():
    """The anchor's CUDA queries answered as on an SM90 SXM GPU, and TileLang's "auto" target resolved to sm_90a
    (``Target.current()``), for as long as the block runs; everything is put back after it."""
    import tilelang  # noqa: F401 (puts its TVM on the path)
    import torch
    from tvm.target import Target

    saved = {n: getattr(torch.cuda, n) for n in ("get_device_properties", "is_current_stream_capturing", "device",
                                                  "is_available")}
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=NUM_SMS)
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
    try:
        with Target({"kind": "cuda", "arch": "sm_90a"}):
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)


@contextlib.contextmanager
def recorded_factories(calls: Dict[str, Tuple[object, tuple, dict]]):
    """Every TileLang JIT factory call in the block recorded into ``calls`` (by ``_call_key``: the factory's name,
    its arguments) with its factory, and answered with a kernel that does nothing."""
    jit = importlib.import_module("tilelang.jit")
    original = jit.JITImpl.__call__

    def record(self, *args, **kwargs):
        name = getattr(self.func, "__name__", None) or repr(self.func)
        calls.setdefault(_call_key(name, args, kwargs), (self, args, kwargs))
        return lambda *a, **k: None

    jit.JITImpl.__call__ = record
    try:
        yield
    finally:
        jit.JITImpl.__call__ = original


def load_flashqla(site: str):
    """``flash_qla`` from ``site`` (imported inside ``sm90_host``: its package checks the target's compute
    version at import)."""
    if not os.path.isdir(os.path.join(site, "flash_qla")):
        raise FileNotFoundError(f"--site: no flash_qla package in {site}")
    if site not in sys.path:
        sys.path.insert(0, site)
    import torch

    fq = importlib.import_module("flash_qla")
    torch.cuda.is_available = lambda: True  # its cached index helpers assert it at each call
    return fq


def dry_run(fq, shape, modes: Sequence[str]) -> None:
    """FlashQLA's operator on ``shape``'s benchmark inputs on the CPU, as ``flashgdn.bench.impls.FlashQLA`` calls
    it, forward alone and forward then backward as ``modes`` say; the kernels do nothing."""
    import torch

    from flashgdn.bench.impls import _leaves
    from flashgdn.bench.inputs import make_inputs

    inp = make_inputs(shape, 128, 128, "cpu", with_grads="fwdbwd" in modes)
    for mode in modes:
        grad = mode == "fwdbwd"
        q, k, v, g, beta, h0 = _leaves(inp, grad)
        with torch.set_grad_enabled(grad):
            o, ht = fq.chunk_gated_delta_rule(q, k, v, g, beta, scale=inp.scale, initial_state=h0,
                                              output_final_state=True, cu_seqlens=inp.cu_seqlens)
        if grad:
            torch.autograd.backward([o, ht], [inp.do, inp.dht])


def shapes_of(set_names: Sequence[str], only_heads: str = ""):
    """The named sets' shapes, those of the head configurations ``only_heads`` names (``parse_heads``) if any."""
    from flashgdn.bench.shapes import named_set, parse_heads

    keep = set(parse_heads(only_heads)) if only_heads else None
    return [s for name in set_names for s in named_set(name) if keep is None or (s.h_qk, s.h_v) in keep]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--site", required=True, help="a folder holding the flash_qla package")
    p.add_argument("--set", default="", help="benchmark sets, comma-separated (cp, bwd, canonical)")
    p.add_argument("--shape", action="append", default=[], help="one more shape HQK/HV:SEQLENS (repeatable)")
    p.add_argument("--only-heads", default="", help="HQK/HV,... of those sets only")
    p.add_argument("--modes", default="fwd,fwdbwd", help="fwd and/or fwdbwd")
    p.add_argument("--compile", action="store_true", help="compile each build into TILELANG_CACHE_DIR")
    p.add_argument("--jobs", type=int, default=1, help="compile this many builds at once (forked workers)")
    p.add_argument("--out", help="write the builds (factory and arguments) here as JSON")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not set(modes) <= {"fwd", "fwdbwd"}:
        raise SystemExit(f"--modes: fwd and/or fwdbwd, got {a.modes!r}")
    from flashgdn.bench.shapes import parse_shape

    shapes = shapes_of([s for s in a.set.split(",") if s], a.only_heads)
    shapes += [parse_shape(t) for t in a.shape]
    if not shapes:
        raise SystemExit("no shapes: name a --set or a --shape")
    if a.compile and not os.environ.get("TILELANG_CACHE_DIR"):
        raise SystemExit("--compile: set TILELANG_CACHE_DIR to the cache that goes to the GPU machine")
    calls: Dict[str, Tuple[object, tuple, dict]] = {}
    with sm90_host():
        fq = load_flashqla(a.site)
        with recorded_factories(calls):
            for shape in shapes:
                dry_run(fq, shape, modes)
        builds: List[str] = sorted(calls)
        print(f"{len(shapes)} shapes, {len(builds)} FlashQLA builds")
        for key in builds:
            print("  " + key)
        if a.out:
            with open(a.out, "w") as f:
                json.dump([json.loads(k) for k in builds], f, indent=1)
        if a.compile:
            compile_builds(calls, builds, a.jobs)
    return 0


def compile_builds(calls: Dict[str, Tuple[object, tuple, dict]], builds: Sequence[str], jobs: int) -> None:
    """Each recorded build (``calls[key]`` for each key of ``builds``) made again with compiling on, here or
    (``jobs`` > 1) in that many forked workers taking every jobs-th build: forked inside ``sm90_host``, each has the
    recorded factories and the sm_90a target, and nothing needs pickling. A worker that fails prints its error and
    makes the whole call fail."""
    n = len(builds)

    def run(indices):
        for i in indices:
            factory, args, kwargs = calls[builds[i]]
            t0 = time.perf_counter()
            factory(*args, **kwargs)  # as the operator calls it (its mode inferred first), now compiling
            print(f"[{i + 1}/{n}] {json.loads(builds[i])[0]}: {time.perf_counter() - t0:.1f} s", flush=True)

    if jobs <= 1:
        run(range(n))
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for w in range(min(jobs, n)):
        pid = os.fork()
        if pid == 0:  # the worker: its share, then out without running the parent's cleanup
            code = 0
            try:
                run(range(w, n, jobs))
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in pids)
    if failed:
        raise SystemExit(f"--compile: {failed} of {len(pids)} workers failed (their errors are above)")


if __name__ == "__main__":
    sys.exit(main())
