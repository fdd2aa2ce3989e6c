"""Helpers the test files share: the accuracy metric, random inputs (DESIGN.md §3 and §5), and the benchmark scripts
as modules."""
from __future__ import annotations

import importlib.util
import json
import linecache
import os
import sys
from types import ModuleType
from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from flashgdn.reference.chunked import chunk_gated_delta_rule_reference
from flashgdn.reference.metrics import BARS_16BIT  # noqa: F401 (shared with the test files)
from flashgdn.reference.metrics import rel_rms as _rel_rms
from flashgdn.reference.recurrent import recurrent_gated_delta_rule

INPUT_NAMES = ("q", "k", "v", "g", "beta", "initial_state")

#: a folder: with it set, every ``rel_rms`` a test computes is appended there (one JSON line: the test, the call's
#: file, line and source text, the ``name`` the caller is checking where it has one, the value), one file per pytest
#: worker, for ``benchmarks/error_report.py`` to give each check's worst value over the run's tests
ERROR_LOG_ENV = "FLASHGDN_ERROR_LOG"


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``flashgdn.reference.metrics.rel_rms``, recorded under ``FLASHGDN_ERROR_LOG`` when that is set."""
    value = _rel_rms(x, ref)
    folder = os.environ.get(ERROR_LOG_ENV)
    if folder:
        _record_error(folder, value, sys._getframe(1))
    return value


def _record_error(folder: str, value: float, frame) -> None:
    code = frame.f_code
    name = frame.f_locals.get("name")
    record = dict(test=os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
                  file=os.path.basename(code.co_filename), line=frame.f_lineno,
                  source=linecache.getline(code.co_filename, frame.f_lineno).strip(),
                  name=name if isinstance(name, (str, int)) else None, value=value)
    os.makedirs(folder, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(folder, f"errors-{worker}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


#: the folder of the benchmark scripts (not a package: each test file loads the one it tests by path)
BENCHMARKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` loaded as a module named ``name`` (a script there imports its siblings only if
    ``BENCHMARKS_DIR`` is on ``sys.path``)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_inputs(
    seqlens: Sequence[int] = (100,),
    Hqk: int = 2,
    Hv: int = 4,
    K: int = 32,
    V: int = 32,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    seed: int = 0,
    dense: bool = False,
    pad: int = 0,
    normalize_qk: bool = True,
    gate: str = "normal",
    zero_gate_heads: Sequence[int] = (),
    initial_state: bool = True,
    state_v_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    requires_grad: bool = False,
) -> Dict[str, object]:
    """Keyword arguments for ``chunk_gated_delta_rule`` on random, realistic inputs.

    ``dense``: B = len(seqlens) equal-length sequences; otherwise one packed row with ``cu_seqlens`` and
    ``pad`` extra tokens after the last sequence. q, k, v in ``dtype``; g, beta and the initial state in float32
    (float64 when ``dtype`` is float64). q/k are L2-normalised (``normalize_qk``) or random with norms around 1.
    ``gate``: "normal" g = logsigmoid(randn) / 16; "strong" g = -A softplus(randn) with A per head up to 16
    (per-token g down to about -20 and beyond); "mixed" half the heads each. ``zero_gate_heads``: g = 0 there.
    """
    gen = torch.Generator().manual_seed(seed)
    side = torch.float64 if dtype == torch.float64 else torch.float32
    if dense:
        if len(set(seqlens)) != 1 or pad:
            raise ValueError("dense inputs need equal sequence lengths and no padding")
        B, T, cu = len(seqlens), seqlens[0], None
    else:
        B, T = 1, sum(seqlens) + pad
        cu = torch.tensor([0] + list(seqlens), dtype=torch.int64).cumsum(0)
    N = len(seqlens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = randn(B, T, Hqk, K), randn(B, T, Hqk, K)
    if normalize_qk:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    else:
        q, k = q * K ** -0.5, k * K ** -0.5
    v = randn(B, T, Hv, V)
    normal = F.logsigmoid(randn(B, T, Hv)) / 16
    A = 1 + 15 * torch.rand(Hv, generator=gen, dtype=torch.float64)
    A[0] = 16.0
    strong = -A * F.softplus(randn(B, T, Hv))
    if gate == "normal":
        g = normal
    elif gate == "strong":
        g = strong
    elif gate == "mixed":
        g = torch.where(torch.arange(Hv) % 2 == 0, strong, normal)
    else:
        raise ValueError(f"unknown gate {gate!r}")
    if zero_gate_heads:
        g = g.clone()
        g[:, :, list(zero_gate_heads)] = 0.0
    beta = torch.sigmoid(randn(B, T, Hv))
    h0 = None
    if initial_state:
        h0 = randn(N, Hv, V, K) if state_v_first else randn(N, Hv, K, V)
    out = dict(
        q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.to(side), beta=beta.to(side),
        initial_state=None if h0 is None else h0.to(side),
        cu_seqlens=cu, state_v_first=state_v_first, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
    for name in INPUT_NAMES:
        if out[name] is not None:
            out[name] = out[name].to(device).requires_grad_(requires_grad)
    if cu is not None:
        out["cu_seqlens"] = cu.to(device)
    return out


def leaves(inp: Dict[str, object]) -> Dict[str, torch.Tensor]:
    """The differentiable inputs of ``inp`` that are present."""
    return {n: inp[n] for n in INPUT_NAMES if inp.get(n) is not None}


def copy_inputs(inp: Dict[str, object], dtype: Optional[torch.dtype] = None, device=None,
                requires_grad: bool = False) -> Dict[str, object]:
    """The same inputs as fresh leaves, optionally converted (e.g. to float64 for an oracle, from the same
    rounded values)."""
    out = dict(inp)
    for name, x in leaves(inp).items():
        out[name] = x.detach().to(device=device or x.device, dtype=dtype or x.dtype).requires_grad_(requires_grad)
    if out.get("cu_seqlens") is not None and device is not None:
        out["cu_seqlens"] = out["cu_seqlens"].to(device)
    return out


def grads_of(fn, inp: Dict[str, object], output_final_state: bool = True, seed: int = 1):
    """Run ``fn(**inp)`` and backpropagate fixed random cotangents for o and the final state.

    Returns (o, final_state, {name: grad}). The cotangents depend only on the shapes and ``seed``, so two
    calls on the same problem use the same ones."""
    o, ht = fn(**inp, output_final_state=output_final_state)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype)
    loss = (o * do).sum()
    if ht is not None:
        dht = torch.randn(ht.shape, generator=gen, dtype=torch.float64).to(ht.device, ht.dtype)
        loss = loss + (ht * dht).sum()
    xs = leaves(inp)
    gs = torch.autograd.grad(loss, list(xs.values()), allow_unused=True)
    return o, ht, {n: (torch.zeros_like(x) if gr is None else gr) for (n, x), gr in zip(xs.items(), gs)}


def oracle(inp: Dict[str, object], output_final_state: bool = True):
    """The float64 token recurrence on these inputs (same rounded values), forward only."""
    x = copy_inputs(inp, dtype=torch.float64)
    with torch.no_grad():
        return recurrent_gated_delta_rule(**x, output_final_state=output_final_state)


def chunked64(inp: Dict[str, object], output_final_state: bool = True):
    """The chunked reference in float64 on these inputs, forward only."""
    x = copy_inputs(inp, dtype=torch.float64)
    with torch.no_grad():
        return chunk_gated_delta_rule_reference(**x, output_final_state=output_final_state)


def assert_same_computation(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two CPU runs of the same math agree up to the last bits. Not bitwise: the CPU BLAS may split a product
    differently between calls (its thread count can change with the machine's load), which moves a result by
    an ulp; bitwise determinism is a property of the GPU kernels, tested on the GPU."""
    rtol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[a.dtype]
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * 1e-2)
