"""Adapters for the implementations being compared: flashgdn's backends and the anchors (FlashQLA, FLA in
pure Triton, FlashInfer).

Each adapter imports its library lazily and says why it cannot run (``missing``) instead of raising. It
converts the shared inputs to its library's conventions before timing (``prepare``); the timed call then
does nothing but the library call. Outputs are converted back to the library's own layout
(``o [1, T, Hv, V]``, ``ht [N, Hv, K, V]``) only for the accuracy check, outside the timed region.
"""
from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .inputs import Inputs

IMPL_NAMES = ("flashgdn", "flashqla", "fla", "flashinfer")
DEFAULT_FLASHGDN_BACKEND = "hopper"

# distribution names, for versions
_DISTRIBUTIONS = {
    "flashgdn": ("flashgdn",),
    "flashqla": ("flash-qla", "flash_qla"),
    "fla": ("fla-core", "flash-linear-attention"),
    "flashinfer": ("flashinfer-python", "flashinfer"),
}


def dist_version(names: Sequence[str], module: Optional[str] = None) -> Optional[str]:
    from importlib import metadata

    for n in names:
        try:
            return metadata.version(n)
        except Exception:
            pass
    if module:
        try:
            return str(getattr(importlib.import_module(module), "__version__"))
        except Exception:
            pass
    return None


def _short_error(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(e).split())
    text = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Prepared:
    """One implementation's call on one shape, inputs already converted.

    ``forward()`` returns the library's outputs; ``canonical(out)`` turns them into
    ``(o [1, T, Hv, V], ht [N, Hv, K, V])``. For fwd+bwd, ``leaves`` are the tensors (q, k, v, g, beta, h0,
    in that order) the gradients are taken with respect to, and ``grad_outputs`` match forward()'s outputs.
    """

    forward: Callable[[], Tuple[torch.Tensor, torch.Tensor]]
    canonical: Callable[[Tuple[torch.Tensor, torch.Tensor]], Tuple[torch.Tensor, torch.Tensor]]
    leaves: List[torch.Tensor] = field(default_factory=list)
    grad_outputs: Tuple[torch.Tensor, ...] = ()


def _leaves(inp: Inputs, requires_grad: bool) -> List[torch.Tensor]:
    ts = [inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0]
    if not requires_grad:
        return ts
    return [t.detach().clone().requires_grad_(True) for t in ts]


def _accepted_kwargs(fn: Callable, kwargs: dict) -> dict:
    """Drop keyword arguments the installed version of a library does not take."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        names = set(params)
        # a **kwargs sink swallows unknown names silently; only pass the optional ones it names
        return {k: v for k, v in kwargs.items() if k in names or k not in _OPTIONAL_KWARGS}
    return {k: v for k, v in kwargs.items() if k in params}


_OPTIONAL_KWARGS = {"cu_seqlens_cpu"}


class Impl:
    """Base adapter. ``name`` is the JSON ``impl``; ``backend`` is set for flashgdn's backends only."""

    name: str = "?"
    backend: Optional[str] = None
    has_backward: bool = True

    def __init__(self):
        self._fn = None
        self._missing: Optional[str] = None
        self._loaded = False

    @property
    def label(self) -> str:
        if self.backend and self.backend != DEFAULT_FLASHGDN_BACKEND:
            return f"{self.name}[{self.backend}]"
        return self.name

    @property
    def note_prefix(self) -> str:
        """What the JSON note says about which variant ran (non-default flashgdn backends)."""
        if self.backend and self.backend != DEFAULT_FLASHGDN_BACKEND:
            return f"backend={self.backend}"
        return ""

    def _load(self, device: torch.device):
        raise NotImplementedError

    def missing_reason(self, device: torch.device) -> Optional[str]:
        """None when it can run here, else why not."""
        if not self._loaded:
            self._loaded = True
            try:
                self._load(torch.device(device))
            except BaseException as e:  # ImportError, but also libraries that fail at import on this device
                if isinstance(e, KeyboardInterrupt):
                    raise
                self._missing = _short_error(e)
        return self._missing

    def refuse_reason(self, inp: Inputs, mode: str) -> Optional[str]:
        """A reason known before calling, e.g. no backward at all."""
        if mode == "fwdbwd" and not self.has_backward:
            return f"{self.label} has no backward"
        return None

    def version(self) -> Optional[str]:
        return dist_version(_DISTRIBUTIONS.get(self.name, ()))

    def prepare(self, inp: Inputs, mode: str) -> Prepared:
        raise NotImplementedError


class FlashGDN(Impl):
    name = "flashgdn"

    def __init__(self, backend: str, cp=None):
        super().__init__()
        self.backend = backend
        self.cp = cp  # None: the operator's default

    @property
    def note_prefix(self) -> str:
        parts = [super().note_prefix, "" if self.cp is None else f"cp={self.cp}"]
        return " ".join(x for x in parts if x)

    def _load(self, device):
        from flashgdn.api.backend import backend_names, get_backend

        import flashgdn

        api = importlib.import_module("flashgdn.api")
        fn = getattr(flashgdn, "chunk_gated_delta_rule", None) or getattr(api, "chunk_gated_delta_rule")
        try:  # the built-in backends register themselves on first use of the API; do it now to list them
            importlib.import_module("flashgdn.api.dispatch").load_backends()
        except (ImportError, AttributeError):
            pass
        if self.backend not in backend_names():
            raise RuntimeError(f"backend {self.backend!r} is not registered (have: {', '.join(backend_names())})")
        ok, reason = get_backend(self.backend).available()
        if not ok:
            raise RuntimeError(f"backend {self.backend!r} unavailable: {reason}")
        self._fn = fn

    def version(self):
        v = dist_version(("flashgdn",), "flashgdn")
        return v

    def prepare(self, inp: Inputs, mode: str) -> Prepared:
        grad = mode == "fwdbwd"
        q, k, v, g, beta, h0 = _leaves(inp, grad)
        fn, cu, cu_cpu, backend, scale = self._fn, inp.cu_seqlens, inp.cu_seqlens_cpu, self.backend, inp.scale
        extra = {} if self.cp is None else {"cp": self.cp}

        def forward():
            return fn(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                      cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, backend=backend, **extra)

        return Prepared(forward, lambda out: (out[0], out[1]), [q, k, v, g, beta, h0],
                        (inp.do, inp.dht) if grad else ())


class FlashQLA(Impl):
    name = "flashqla"

    def _load(self, device):
        if device.type != "cuda":
            raise RuntimeError("needs a CUDA device")
        self._fn = importlib.import_module("flash_qla").chunk_gated_delta_rule

    def prepare(self, inp: Inputs, mode: str) -> Prepared:
        grad = mode == "fwdbwd"
        q, k, v, g, beta, h0 = _leaves(inp, grad)
        fn, cu, scale = self._fn, inp.cu_seqlens, inp.scale

        def forward():
            return fn(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu)

        return Prepared(forward, lambda out: (out[0], out[1]), [q, k, v, g, beta, h0],
                        (inp.do, inp.dht) if grad else ())


class FLATriton(Impl):
    """FLA's own Triton kernels. Its dispatcher would otherwise hand the call to FlashQLA when installed, so
    dispatch is switched off before FLA is first imported."""

    name = "fla"

    def _load(self, device):
        if device.type != "cuda":
            raise RuntimeError("needs a CUDA device")
        import sys

        if "fla" not in sys.modules:
            os.environ["FLA_DISABLE_BACKEND_DISPATCH"] = "1"
        elif os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") != "1":
            raise RuntimeError("fla was imported before FLA_DISABLE_BACKEND_DISPATCH=1 could be set")
        self._fn = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule

    def version(self):
        return dist_version(_DISTRIBUTIONS["fla"], "fla")

    def prepare(self, inp: Inputs, mode: str) -> Prepared:
        grad = mode == "fwdbwd"
        q, k, v, g, beta, h0 = _leaves(inp, grad)
        fn, scale = self._fn, inp.scale
        # FLA documents LongTensor offsets; the host copy spares it a device-to-host sync per call
        cu = inp.cu_seqlens.long()
        kwargs = _accepted_kwargs(fn, dict(cu_seqlens=cu, cu_seqlens_cpu=inp.cu_seqlens_cpu.long()))

        def forward():
            return fn(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True, **kwargs)

        return Prepared(forward, lambda out: (out[0], out[1]), [q, k, v, g, beta, h0],
                        (inp.do, inp.dht) if grad else ())


class FlashInfer(Impl):
    """FlashInfer's GDN prefill: no batch dim ([T, H, D]), the gate as the linear decay exp(g) in fp32, the
    state [N, H, V, K], and a preallocated final-state buffer. Forward only."""

    name = "flashinfer"
    has_backward = False

    def _load(self, device):
        if device.type != "cuda":
            raise RuntimeError("needs a CUDA device")
        self._fn = importlib.import_module("flashinfer.gdn_prefill").chunk_gated_delta_rule

    def prepare(self, inp: Inputs, mode: str) -> Prepared:
        q, k, v = inp.q[0], inp.k[0], inp.v[0]
        alpha = torch.exp(inp.g[0]).contiguous()
        beta = inp.beta[0].contiguous()
        h0 = inp.h0.transpose(-1, -2).contiguous()  # [N, Hv, V, K]
        out_state = torch.empty_like(h0)
        cu = inp.cu_seqlens.long()
        fn, scale = self._fn, inp.scale

        def forward():
            return fn(q, k, v, alpha, beta, scale=scale, initial_state=h0, output_final_state=True,
                      cu_seqlens=cu, output_state=out_state)

        def canonical(out):
            o, ht = out
            return o.unsqueeze(0), ht.transpose(-1, -2)

        return Prepared(forward, canonical)


def make_impls(names: Sequence[str], flashgdn_backends: Sequence[str], cp=None) -> List[Impl]:
    """Adapters in table order: flashgdn's backends first (with ``cp``, when given), then the anchors."""
    out: List[Impl] = []
    if "flashgdn" in names:
        out += [FlashGDN(b, cp) for b in flashgdn_backends]
    classes: Dict[str, type] = {"flashqla": FlashQLA, "fla": FLATriton, "flashinfer": FlashInfer}
    for n in ("flashqla", "fla", "flashinfer"):
        if n in names:
            out.append(classes[n]())
    return out


def one_impl(text: str, cp=None) -> Impl:
    """The one implementation ``text`` names (``flashgdn``, ``flashgdn:BACKEND``, ``flashqla``, ``fla``,
    ``flashinfer``), as ``make_impls`` makes it (``cp`` for flashgdn); ValueError unless it names exactly one
    (``flashgdn:hopper+reference`` names two)."""
    names, backends = parse_impls(text)
    if len(names) != 1 or len(backends) > 1:
        raise ValueError(f"--impl: one implementation, got {text!r}")
    return make_impls(names, backends or [DEFAULT_FLASHGDN_BACKEND], cp=cp)[0]


def parse_impls(text: str) -> Tuple[List[str], List[str]]:
    """``"flashqla,fla,flashinfer,flashgdn"`` -> (impl names, explicitly asked flashgdn backends).
    ``flashgdn:reference`` (or ``flashgdn:hopper+reference``) asks for particular backends."""
    names: List[str] = []
    backends: List[str] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, rest = item.partition(":")
        name = name.strip().lower()
        if name not in IMPL_NAMES:
            raise ValueError(f"unknown implementation {name!r}; known: {', '.join(IMPL_NAMES)}")
        if name not in names:
            names.append(name)
        if rest:
            if name != "flashgdn":
                raise ValueError(f"only flashgdn takes a backend, got {item!r}")
            for b in rest.split("+"):
                if b.strip() and b.strip() not in backends:
                    backends.append(b.strip())
    if not names:
        raise ValueError("no implementation selected")
    return names, backends
