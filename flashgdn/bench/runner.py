"""The benchmark loop: for each shape, each mode, each implementation: first call (compile time), accuracy
check, memory, timing; results saved after every shape."""
from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from . import inputs as cost
from .check import Checker
from .impls import Impl, Prepared, dist_version
from .inputs import Inputs, add_grad_outputs, make_inputs
from .results import save
from .shapes import DEFAULT_MODES, Shape
from .timing import measure, peak_extra_mb, timed_call


class DeviceLost(RuntimeError):
    """The device context is unusable (e.g. an illegal memory access): nothing more can run in this process."""


@dataclass
class RunConfig:
    shapes: List[Shape]
    impls: List[Impl]
    device: torch.device
    json_path: str
    command: str
    modes: Optional[Sequence[str]] = None  # None: DEFAULT_MODES per set
    head_dim: int = 128
    seed: int = 0
    check: bool = True
    check_tokens: int = 8192
    check_grad_tokens: int = 4096
    time_budget_s: Optional[float] = None
    # which shapes a flashgdn backend runs on (the PyTorch reference is slow: quick set, CPU, or when asked)
    backend_filter: Callable[[Impl, Shape], bool] = lambda impl, shape: True
    log: Callable[[str], None] = field(default=lambda s: print(s, flush=True))


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.multi_processor_count} SMs)"
    return f"cpu: {platform.machine()} {platform.processor() or ''}".strip() + " (no GPU: harness test only)"


def collect_versions(impls: Sequence[Impl], device: torch.device) -> Dict[str, str]:
    v: Dict[str, str] = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.version.cuda:
        v["cuda"] = str(torch.version.cuda)
    for name, dists in (("triton", ("triton",)), ("tilelang", ("tilelang",))):
        ver = dist_version(dists)
        if ver:
            v[name] = ver
    for impl in impls:
        if impl.missing_reason(device) is None and impl.name not in v:
            ver = impl.version()
            if ver:
                v[impl.name] = ver
    fg = dist_version(("flashgdn",), "flashgdn")
    if fg:
        v.setdefault("flashgdn", fg)
    return v


def _short(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(e).split())
    s = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _sig(x: float, digits: int = 4) -> float:
    """x to a few significant digits (for the JSON; tiny CPU-test values must not round to 0)."""
    return float(f"{x:.{digits}g}")


def _device_ok(device: torch.device) -> None:
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
    except Exception as e:
        raise DeviceLost(_short(e)) from e


def step_call(prep: Prepared, mode: str) -> Callable[[], tuple]:
    """One call of a prepared implementation: the forward alone without autograd ("fwd", gradients None), or the
    forward and the gradients of its leaves ("fwdbwd"); returns ``(outputs, gradients)``."""
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return prep.forward(), None
    else:
        def call():
            with torch.enable_grad():
                out = prep.forward()
                grads = torch.autograd.grad(tuple(out), prep.leaves, prep.grad_outputs, allow_unused=True)
            return out, grads
    return call


def shape_call(impl: Impl, shape: Shape, device: torch.device, mode: str) -> Callable[[], tuple]:
    """``step_call`` of ``impl`` on the benchmark's inputs for ``shape`` (K = V = 128; output gradients in fwdbwd)."""
    inp = make_inputs(shape, 128, 128, device, with_grads=mode == "fwdbwd")
    return step_call(impl.prepare(inp, mode), mode)


def run_one(impl: Impl, inp: Inputs, mode: str, checker: Optional[Checker], device: torch.device) -> Dict[str, Any]:
    """One record: run / missing / refused, never raising (except DeviceLost)."""
    shape = inp.shape
    rec: Dict[str, Any] = {
        "set": shape.set, "mode": mode, "h_qk": shape.h_qk, "h_v": shape.h_v, "seqlens": list(shape.seqlens),
        "impl": impl.name, "ms": None, "err": None, "note": "", "status": "run",
        "d_k": inp.K, "d_v": inp.V,
    }
    if impl.backend:
        rec["backend"] = impl.backend
    notes: List[str] = []

    def finish(status: Optional[str] = None, reason: str = "") -> Dict[str, Any]:
        if status:
            rec["status"] = status
            rec["ms"] = None
            notes.insert(0, f"{status}: {reason}")
        if impl.note_prefix:
            notes.append(impl.note_prefix)
        rec["note"] = "; ".join(n for n in notes if n)
        return rec

    reason = impl.missing_reason(device)
    if reason:
        return finish("missing", reason)
    reason = impl.refuse_reason(inp, mode)
    if reason:
        return finish("refused", reason)

    phase = "prepare"
    try:
        prep = impl.prepare(inp, mode)
        call = step_call(prep, mode)

        def bench():
            call()

        phase = "first call"
        (out, grads), first_s = timed_call(call, device)
        rec["first_call_s"] = _sig(first_s)
        if checker is not None:
            phase = "check"
            o, ht = prep.canonical(out)
            res = checker.check(o, ht, list(grads) if grads is not None else None)
            rec.update(err=res.err, err_o=res.err_o, err_state=res.err_state, check=checker.description)
            if res.err_grads:
                rec["err_grad"] = res.err_grad
                rec["err_grads"] = res.err_grads
            if res.note:
                notes.append(res.note)
            bad = res.above_bar()
            if bad:
                notes.append("ERROR ABOVE BAR: " + ", ".join(bad))
            del o, ht
        del out, grads
        phase = "memory"
        _, steady_s, peak = peak_extra_mb(bench, device)
        if peak is not None:
            rec["peak_mem_mb"] = _sig(peak)
        phase = "timing"
        t = measure(bench, device, steady_s)
        rec["ms"] = t.ms
        rec["timer"] = t.timer
        if t.note:
            notes.append(t.note)
        K, V = inp.K, inp.V
        floor = cost.floor_ms(shape, K, V, mode)
        rec["tflops"] = _sig(cost.nominal_tflops(shape, K, V, mode, t.ms))
        rec["floor_ms"] = _sig(floor)
        rec["floor_pct"] = _sig(100 * floor / t.ms)
        return finish()
    except KeyboardInterrupt:
        raise
    except Exception as e:
        _device_ok(device)  # raises DeviceLost if the context is gone
        if device.type == "cuda":
            torch.cuda.empty_cache()
        where = "" if phase == "first call" else f"{phase} failed: "
        return finish("refused", where + _short(e))


def _summary(shape: Shape, mode: str, recs: Sequence[Dict[str, Any]]) -> str:
    from .report import _cell, record_label

    cells = [f"{record_label(r)} {_cell(r)}" for r in recs]
    return f"{shape.set} {shape.label} {mode}: " + " | ".join(cells)


class _Progress:
    """tqdm when installed and on a terminal, else one line per shape."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():  # in a log file a redrawn bar is noise: plain lines instead
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="shape", file=sys.stderr, dynamic_ncols=True)
            except Exception:
                pass

    def start(self, shape: Shape):
        if self.bar is not None:
            self.bar.set_description(shape.label)
        else:
            el = time.perf_counter() - self.t0
            eta = el / self.done * (self.total - self.done) if self.done else float("nan")
            print(f"[{self.done + 1}/{self.total}] {shape.set} {shape.label}  (elapsed {el:.0f} s, eta {eta:.0f} s)",
                  file=sys.stderr, flush=True)

    def write(self, line: str):
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def step(self):
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run(cfg: RunConfig) -> Dict[str, Any]:
    device = cfg.device
    doc: Dict[str, Any] = {
        "gpu": gpu_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": cfg.command,
        "versions": collect_versions(cfg.impls, device),
        "records": [],
    }
    for impl in cfg.impls:
        reason = impl.missing_reason(device)
        cfg.log(f"  {impl.label:22s} " + (f"missing: {reason}" if reason else f"ok ({impl.version() or '?'})"))
    save(doc, cfg.json_path)
    t0 = time.perf_counter()
    progress = _Progress(len(cfg.shapes))
    stopped = None
    check_s = 0.0
    try:
        for shape in cfg.shapes:
            if cfg.time_budget_s is not None and time.perf_counter() - t0 > cfg.time_budget_s:
                stopped = (f"time budget of {cfg.time_budget_s:.0f} s reached: {progress.done} of "
                           f"{len(cfg.shapes)} shapes done, the rest not started")
                break
            progress.start(shape)
            modes = list(cfg.modes or DEFAULT_MODES[shape.set])
            impls = [i for i in cfg.impls if cfg.backend_filter(i, shape)]
            inp = make_inputs(shape, cfg.head_dim, cfg.head_dim, device, cfg.seed)
            if "fwdbwd" in modes:
                add_grad_outputs(inp)
            checker = Checker(inp, cfg.check_tokens, cfg.check_grad_tokens) if cfg.check else None
            for mode in modes:
                recs = [run_one(impl, inp, mode, checker, device) for impl in impls]
                doc["records"].extend(recs)
                progress.write(_summary(shape, mode, recs))
            if checker is not None:
                check_s += checker.seconds
            save(doc, cfg.json_path)
            del inp, checker
            if device.type == "cuda":
                torch.cuda.empty_cache()
            progress.step()
    except DeviceLost as e:
        stopped = f"device context lost ({e}); results so far saved"
    except KeyboardInterrupt:
        stopped = "interrupted; results so far saved"
    finally:
        progress.close()
        save(doc, cfg.json_path)
    el = time.perf_counter() - t0
    cfg.log(f"{progress.done} shapes in {el:.0f} s (reference checks {check_s:.1f} s); results: {cfg.json_path}")
    if stopped:
        cfg.log("STOPPED: " + stopped)
    return doc
