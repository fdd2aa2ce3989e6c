"""Accuracy check of every implementation before it is timed, against flashgdn's float64 reference on a
slice of the shape, so that a fast wrong kernel cannot win the table.

The slice is the shortest sequence (the first of the shortest), truncated to ``max_tokens`` tokens, and the
qk heads {0, Hqk-1} with all their value heads. Sequences are independent and value heads only read their
own qk head, so on that slice the implementation's full-shape outputs must equal the reference run on the
slice alone. The final state is checked when the slice is a whole sequence; so are the gradients (fwd+bwd),
when it is also at most ``max_grad_tokens`` long. Metric: relative RMS, DESIGN.md section 3.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .inputs import Inputs

# DESIGN.md section 3
BAR_FWD = 5e-3
BAR_GRAD = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3, "dg": 2e-2, "dbeta": 2e-2}
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    if x.shape != ref.shape:
        raise ValueError(f"shape {tuple(x.shape)} != reference {tuple(ref.shape)}")
    den = ref.pow(2).mean().sqrt()
    num = (x - ref).pow(2).mean().sqrt()
    if den == 0:
        return float(num)
    return float(num / den)


def _load_reference() -> Tuple[Optional[Callable], str]:
    """flashgdn's chunked reference (equal to the token recurrence to 1e-12 in float64, and much faster on a
    GPU), else the token recurrence itself."""
    try:
        from flashgdn.reference.chunked import chunk_gated_delta_rule_reference

        return chunk_gated_delta_rule_reference, "chunked float64"
    except Exception as e_chunked:
        try:
            from flashgdn.reference.recurrent import recurrent_gated_delta_rule

            return recurrent_gated_delta_rule, "recurrent float64"
        except Exception as e:
            return None, f"no reference ({type(e_chunked).__name__}; {type(e).__name__}: {e})"


@dataclass
class CheckResult:
    err: Optional[float] = None  # max of err_o and err_state: the record's "err"
    err_o: Optional[float] = None
    err_state: Optional[float] = None
    err_grads: Dict[str, float] = field(default_factory=dict)
    note: str = ""

    @property
    def err_grad(self) -> Optional[float]:
        return max(self.err_grads.values()) if self.err_grads else None

    def above_bar(self) -> List[str]:
        bad = []
        if self.err_o is not None and self.err_o > BAR_FWD:
            bad.append(f"o {self.err_o:.1e} > {BAR_FWD:.0e}")
        if self.err_state is not None and self.err_state > BAR_FWD:
            bad.append(f"state {self.err_state:.1e} > {BAR_FWD:.0e}")
        for n, e in self.err_grads.items():
            if e > BAR_GRAD[n]:
                bad.append(f"{n} {e:.1e} > {BAR_GRAD[n]:.0e}")
        return bad


class Checker:
    """Holds the reference results of one shape (computed once, on first use) and compares outputs."""

    def __init__(self, inp: Inputs, max_tokens: int = 8192, max_grad_tokens: int = 4096):
        self.inp = inp
        lens = list(inp.shape.seqlens)
        self.seq = min(range(len(lens)), key=lambda i: (lens[i], i))
        self.start = sum(lens[: self.seq])
        self.length = min(lens[self.seq], max_tokens)
        self.whole = self.length == lens[self.seq]
        self.grad_ok = self.whole and self.length <= max_grad_tokens
        Hqk, Hv = inp.shape.h_qk, inp.shape.h_v
        G = Hv // Hqk
        self.qk_heads = sorted({0, Hqk - 1})
        self.v_heads = [h for hq in self.qk_heads for h in range(hq * G, (hq + 1) * G)]
        self._ref = None
        self._ref_grads = None
        self.ref_fn, self.ref_kind = _load_reference()
        self.seconds = 0.0

    @property
    def description(self) -> str:
        what = f"seq {self.seq} " + ("whole" if self.whole else f"first {self.length} tokens")
        return f"{what} ({self.length} tok), qk heads {self.qk_heads}, {len(self.v_heads)} v heads"

    # slices of full-shape tensors -----------------------------------------------------------------
    def _tok(self, x: torch.Tensor, heads: List[int]) -> torch.Tensor:
        sl = x[:, self.start : self.start + self.length]
        return sl.index_select(2, torch.tensor(heads, device=x.device))

    def _state(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.seq : self.seq + 1].index_select(1, torch.tensor(self.v_heads, device=x.device))

    def _ref_inputs(self, requires_grad: bool):
        i = self.inp
        ts = [
            self._tok(i.q, self.qk_heads), self._tok(i.k, self.qk_heads), self._tok(i.v, self.v_heads),
            self._tok(i.g, self.v_heads), self._tok(i.beta, self.v_heads), self._state(i.h0),
        ]
        ts = [t.detach().to(torch.float64).contiguous() for t in ts]
        if requires_grad:
            ts = [t.requires_grad_(True) for t in ts]
        return ts

    def _run_ref(self, ts):
        q, k, v, g, beta, h0 = ts
        return self.ref_fn(q, k, v, g, beta, scale=self.inp.scale, initial_state=h0, output_final_state=True,
                           compute_dtype=torch.float64)

    def reference(self):
        if self._ref is None:
            t0 = time.perf_counter()
            with torch.no_grad():
                o, ht = self._run_ref(self._ref_inputs(False))
            self._ref = (o.to(torch.float64), ht.to(torch.float64))
            self.seconds += time.perf_counter() - t0
        return self._ref

    def reference_grads(self):
        if self._ref_grads is None:
            t0 = time.perf_counter()
            ts = self._ref_inputs(True)
            with torch.enable_grad():
                o, ht = self._run_ref(ts)
                do = self._tok(self.inp.do, self.v_heads).to(o.dtype)
                dht = self._state(self.inp.dht).to(ht.dtype)
                grads = torch.autograd.grad((o, ht), ts, (do, dht), allow_unused=True)
            self._ref_grads = dict(zip(GRAD_NAMES, grads))
            self.seconds += time.perf_counter() - t0
        return self._ref_grads

    # comparison ----------------------------------------------------------------------------------
    def check(self, o: torch.Tensor, ht: torch.Tensor, grads: Optional[List[torch.Tensor]] = None) -> CheckResult:
        res = CheckResult()
        notes = []
        if self.ref_fn is None:
            res.note = f"unchecked: {self.ref_kind}"
            return res
        try:
            ref_o, ref_ht = self.reference()
            res.err_o = rel_rms(self._tok(o, self.v_heads), ref_o)
            if self.whole:
                res.err_state = rel_rms(self._state(ht), ref_ht)
            else:
                notes.append("state unchecked (slice is not a whole sequence)")
            res.err = max(e for e in (res.err_o, res.err_state) if e is not None)
        except Exception as e:
            res.note = f"check failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
            return res
        if grads is not None:
            if not self.grad_ok:
                notes.append("grads unchecked (shortest sequence too long)")
            else:
                try:
                    ref = self.reference_grads()
                    for name, gi in zip(GRAD_NAMES, grads):
                        if gi is None or ref[name] is None:
                            continue
                        if name in ("dq", "dk"):
                            mine = self._tok(gi, self.qk_heads)
                        elif name == "dh0":
                            mine = self._state(gi)
                        else:
                            mine = self._tok(gi, self.v_heads)
                        res.err_grads[name] = rel_rms(mine, ref[name])
                except Exception as e:
                    notes.append(f"grad check failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}")
        res.note = "; ".join(notes)
        return res
