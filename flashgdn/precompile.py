"""Fill the kernel cache ahead of time, so a server's first request does not wait for compiles.

    python -m flashgdn.precompile --heads 16/32,16/64 [--dtypes bfloat16,float16] [--flags all|common]
                                  [--kernels all|forward|serving|training] [--export DIR]

Kernels are compiled for sm_90a whether or not a GPU is present, into TileLang's cache
(``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``); a cache built on a GPU-less machine loads on an H100/H200.
Sequence lengths and counts are dynamic in every kernel, so head configuration, dtype and flags are all a
cache entry depends on. ``--export DIR`` also copies exactly these kernels' cache entries into DIR (a cache to
ship to a server, or to a GPU machine, without the stale entries a development cache collects).
"""
import argparse
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _parse_heads(text: str):
    out = []
    for item in text.split(","):
        try:
            hqk, hv = (int(x) for x in item.split("/"))
        except ValueError:
            raise ValueError(f"expected HQK/HV[,HQK/HV...], got {item!r}") from None
        if hqk <= 0 or hv <= 0 or hv % hqk:
            raise ValueError(f"{item!r} needs positive counts with HV a multiple of HQK")
        out.append((hqk, hv))
    return out


def _variants(hqk: int, hv: int, head_dim: int, dtype: str, kernels: str, flags: str) -> list:
    """The kernel variants ``--kernels`` names for one head configuration and dtype."""
    from flashgdn.kernels.hopper.variants import (backward_variants, forward_variants, serving_variants,
                                                  training_variants)

    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"dtype: expected bfloat16 or float16, got {dtype!r}")
    if kernels == "all":
        return (list(forward_variants(hqk, hv, head_dim, head_dim, dtype, flags))
                + list(backward_variants(hqk, hv, head_dim, head_dim, dtype)))
    chosen = dict(forward=forward_variants, serving=serving_variants, training=training_variants)[kernels]
    return list(chosen(hqk, hv, head_dim, head_dim, dtype, flags))


def preload(heads, dtype="bfloat16", training: bool = True, flags: str = "all", head_dim: int = 128) -> int:
    """Load into this process every kernel the operator may ask for at these head configurations, before the first
    call: ``heads`` is ``[(Hqk, Hv), ...]`` (or ``"16/32,16/64"``), ``dtype`` the q/k/v dtype (``torch.bfloat16``
    or ``"bfloat16"``), ``training`` adds the backward's kernels to the forward's, ``flags`` is ``"all"`` (every
    combination of initial state, final state and state layout) or ``"common"``. Returns how many kernels it went
    through.

    Why: a kernel is traced and loaded (from the disk cache, or compiled into it) the first time a call needs it,
    and which kernels a call needs depends on its sequence mix (context parallelism's passes run only where the
    plan splits a sequence). A training loop whose batches change their mix then stalls, once per process and path,
    in whichever step first takes that path (~1.2 s on an H100 for the CP passes of 16/32, notes "The eager training
    loop measured"). Loading everything up front moves that time to start-up, where ``python -m flashgdn.precompile``
    has already moved the compiles. Without a GPU it compiles for sm_90a like the command does."""
    import torch

    from flashgdn.kernels.hopper.common import TORCH_TO_TL
    from flashgdn.kernels.hopper.variants import build

    if isinstance(heads, str):
        try:
            heads = _parse_heads(heads)
        except ValueError as e:
            raise ValueError(f"heads: {e}") from None
    if isinstance(dtype, torch.dtype):
        dtype = TORCH_TO_TL.get(dtype, str(dtype))  # (a dtype without a kernel variant is refused below)
    if flags not in ("all", "common"):
        raise ValueError(f"flags: expected 'all' or 'common', got {flags!r}")
    for hqk, hv in heads:  # every argument checked before the first build
        if hqk <= 0 or hv <= 0 or hv % hqk:
            raise ValueError(f"heads: {hqk}/{hv} needs positive counts with Hv a multiple of Hqk")
    variants = [v for hqk, hv in heads
                for v in _variants(hqk, hv, head_dim, dtype, "training" if training else "serving", flags)]
    for _, builder, kwargs in variants:
        build(builder, kwargs)
    return len(variants)


def _cache_entries(cache_dir: str) -> set:
    """The cache's kernel entries (each a folder holding a compiled library), as absolute paths."""
    return {os.path.abspath(root) for root, _, files in os.walk(cache_dir) if "executable.so" in files}


def _compile_one(job):
    name, builder, kwargs, report = job
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
    from flashgdn.kernels.hopper.common import resource_usage
    from flashgdn.kernels.hopper.variants import build

    t = time.time()
    kernel = build(builder, kwargs)
    res = resource_usage(kernel) if report else None
    return name, time.time() - t, res, getattr(kernel, "_tilelang_cache_path", None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashgdn.precompile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", required=True, help="head configurations HQK/HV, comma separated, e.g. 16/32,16/64")
    ap.add_argument("--dtypes", default="bfloat16", help="q/k/v dtypes: bfloat16,float16")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--flags", choices=("all", "common"), default="all",
                    help="all flag combinations, or only initial state in / final state out / K-major state")
    ap.add_argument("--kernels", choices=("all", "forward", "serving", "training"), default="all",
                    help="every variant (all chunk loops, the backward's kernels and their A/Bs: for tests and "
                         "comparisons), every forward variant, or only what the operator with its default settings "
                         "asks for: the forward (serving), the forward and the backward (training)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)))
    ap.add_argument("--report", action="store_true", help="print registers, spills and code size (needs ptxas)")
    ap.add_argument("--export", metavar="DIR", default=None,
                    help="copy these kernels' cache entries into DIR (a TileLang cache directory of just them)")
    ap.add_argument("--expect-cached", action="store_true",
                    help="fail, naming them, if any of these kernels had no entry in the cache before this run (to "
                         "check that a shipped cache holds what the current code builds)")
    args = ap.parse_args(argv)

    try:
        heads = _parse_heads(args.heads)
    except ValueError as e:
        raise SystemExit(f"--heads: {e}")
    jobs = []
    for hqk, hv in heads:
        for dt in args.dtypes.split(","):
            if dt not in ("bfloat16", "float16"):
                raise SystemExit(f"--dtypes: expected bfloat16 or float16, got {dt!r}")
            for name, builder, kw in _variants(hqk, hv, args.head_dim, dt, args.kernels, args.flags):
                jobs.append((name, builder, kw, args.report))
    from tilelang import env as tl_env

    cache_dir = os.path.abspath(str(tl_env.TILELANG_CACHE_DIR))  # where TileLang writes them, forced value included
    before = _cache_entries(cache_dir) if args.expect_cached else None  # (a walk of the whole cache: only if asked)
    t0 = time.time()
    entries, no_entry, compiled = set(), [], []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for name, secs, res, entry in pool.map(_compile_one, jobs):
            extra = "" if res is None else (f"  regs {res['registers']}, spills {res['spill_stores']}/"
                                            f"{res['spill_loads']} B, stack {res['stack']} B, {res['instructions']} instructions"
                                            + (", wgmma serialised by ptxas" if res["wgmma_serialized"] else ""))
            print(f"{secs:6.1f}s  {name}{extra}", flush=True)
            if entry is None:
                no_entry.append(name)
            else:
                entries.add(entry)  # variants that compile to the same kernel share one
                if before is not None and os.path.abspath(entry) not in before:
                    compiled.append(name)
    print(f"{len(jobs)} kernels ready in {time.time() - t0:.0f}s (cache: {cache_dir})")
    if args.expect_cached and (compiled or no_entry):
        print(f"error: not in the cache before this run: {', '.join(compiled + no_entry)}", file=sys.stderr)
        return 1
    if args.export:
        outside = [e for e in entries if os.path.commonpath([os.path.abspath(e), cache_dir]) != cache_dir]
        if outside:
            print(f"error: cache entries outside {cache_dir}: {', '.join(sorted(outside))}", file=sys.stderr)
            return 1
        for entry in sorted(entries):
            dst = os.path.join(args.export, os.path.relpath(os.path.abspath(entry), cache_dir))
            shutil.copytree(entry, dst, dirs_exist_ok=True)
        print(f"exported {len(entries)} cache entries to {args.export}")
        if no_entry:
            print(f"error: no cache entry for {', '.join(no_entry)} (is TileLang's cache disabled?)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
