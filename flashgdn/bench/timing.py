"""Timing: CUDA-graph replay (the figure that counts), eager CUDA events when a call cannot be captured or
is too slow to capture, and wall clock on a CPU (for testing the harness only)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# A call slower than this (measured eagerly after warm-up) is timed eagerly with a few repetitions:
# graph replay would not change its figure and capturing it can take many seconds (the PyTorch reference).
SLOW_CALL_S = 0.2


@dataclass
class Timing:
    ms: float
    timer: str  # "cudagraph" | "triton.do_bench_cudagraph" | "cuda-events" | "wallclock-cpu"
    note: str = ""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable, device: torch.device):
    """(result, seconds) of one call, synchronised on both sides."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def _events_median(fn: Callable, reps: int) -> float:
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _own_cudagraph(fn: Callable, rep_ms: float = 20.0, retries: int = 10) -> float:
    """Median over replays of a graph holding n unrolled calls, per call (the method of
    triton.testing.do_bench_cudagraph, for machines without Triton)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # capture needs the first call of a configuration done eagerly on the capturing stream
    torch.cuda.current_stream().wait_stream(side)
    est = _events_median(fn, 3)
    n = max(1, min(1000, int(rep_ms / max(est, 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    torch.cuda.synchronize()
    graph.replay()  # warm replay
    torch.cuda.synchronize()
    times = []
    for _ in range(retries):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    del graph
    return statistics.median(times)


def _triton_cudagraph(fn: Callable) -> Optional[float]:
    try:
        from triton.testing import do_bench_cudagraph
    except Exception:
        return None
    return float(do_bench_cudagraph(fn, rep=20, return_mode="median"))


def measure(fn: Callable, device: torch.device, steady_s: float, use_triton: bool = True) -> Timing:
    """Time ``fn`` (already warmed up; ``steady_s`` is the wall time of one warm call)."""
    if device.type != "cuda":
        reps = max(1, min(5, int(1.0 / max(steady_s, 1e-6))))
        times = []
        for _ in range(reps):
            _, dt = timed_call(fn, device)
            times.append(dt)
        return Timing(1e3 * statistics.median(times), "wallclock-cpu",
                      "wall clock on the CPU: for testing the harness, not a performance figure")
    if steady_s > SLOW_CALL_S:
        reps = max(1, min(5, int(1.0 / steady_s)))
        return Timing(_events_median(fn, reps), "cuda-events",
                      f"eager timing, median of {reps} (call slower than {SLOW_CALL_S} s)")
    try:
        ms = _triton_cudagraph(fn) if use_triton else None
        if ms is not None:
            return Timing(ms, "triton.do_bench_cudagraph")
        return Timing(_own_cudagraph(fn), "cudagraph")
    except Exception as e:  # not capturable: fall back to eager events, and say so
        reason = " ".join(str(e).split())[:160]
        torch.cuda.synchronize()
        return Timing(_events_median(fn, 20), "cuda-events",
                      f"eager timing, median of 20: graph capture failed ({type(e).__name__}: {reason})")


def peak_extra_mb(fn: Callable, device: torch.device):
    """(result, seconds, peak extra device memory in MiB) of one call."""
    if device.type != "cuda":
        out, dt = timed_call(fn, device)
        return out, dt, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out, dt = timed_call(fn, device)
    peak = torch.cuda.max_memory_allocated(device) - base
    return out, dt, peak / 2**20
