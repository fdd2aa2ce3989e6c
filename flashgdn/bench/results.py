"""The results file: its schema, validation, writing and merging.

Schema (other tools read it; the keys below are fixed, and records may carry the extra keys listed in
``EXTRA_KEYS``)::

    {"gpu": str, "date": str, "command": str, "versions": {name: version},
     "records": [{"set": "canonical" | "bwd" | "cp" | "quick" | "custom", "mode": "fwd" | "fwdbwd",
                  "h_qk": int, "h_v": int, "seqlens": [int],
                  "impl": "flashgdn" | "flashqla" | "fla" | "flashinfer",
                  "ms": float | null, "err": float | null, "note": str, ...extras}]}

``ms`` is null exactly when the implementation did not run; ``note`` then starts with ``missing:`` (not
importable or not usable on this machine) or ``refused:`` (it raised on this shape and mode, or has no such
mode). A flashgdn backend other than the default ("hopper") is named in ``note`` as ``backend=NAME``.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Iterable, List, Tuple

SETS = ("canonical", "bwd", "cp", "quick", "custom")
MODES = ("fwd", "fwdbwd")
IMPLS = ("flashgdn", "flashqla", "fla", "flashinfer")
TOP_KEYS = {"gpu": str, "date": str, "command": str, "versions": dict, "records": list}

# Optional per-record keys this harness adds (all may be absent or null):
EXTRA_KEYS = {
    "status": "run | missing | refused",
    "backend": "flashgdn only: the backend that ran",
    "d_k": "head dim K", "d_v": "head dim V",
    "err_o": "relative RMS of o on the checked slice",
    "err_state": "relative RMS of the final state (when the slice is a whole sequence)",
    "err_grad": "max relative RMS over the gradients (fwdbwd, when checked)",
    "err_grads": "{dq, dk, dv, dg, dbeta, dh0: relative RMS}",
    "check": "which slice was checked against the float64 reference",
    "first_call_s": "wall time of the first call in this process (includes JIT compile and autotune)",
    "peak_mem_mb": "peak device memory allocated during one call, above what was allocated before it",
    "timer": "triton.do_bench_cudagraph | cudagraph | cuda-events | wallclock-cpu",
    "tflops": "nominal TFLOPS: 4 T Hv K V / t (x3 for fwdbwd)",
    "floor_ms": ("max(FLOP time at 687 TFLOP/s, HBM time at 4.25 TB/s: the H200's measured ceilings, on any GPU); "
                 "fwdbwd counts 3x the forward FLOPs"),
    "floor_pct": "100 * floor_ms / ms",
}


class SchemaError(ValueError):
    pass


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num_or_null(x) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x))


def validate(doc: Any) -> None:
    """Raise SchemaError naming the first thing that does not match the schema."""
    if not isinstance(doc, dict):
        raise SchemaError("top level is not an object")
    for key, typ in TOP_KEYS.items():
        if key not in doc:
            raise SchemaError(f"missing top-level key {key!r}")
        if not isinstance(doc[key], typ):
            raise SchemaError(f"{key!r} is not a {typ.__name__}")
    for name, ver in doc["versions"].items():
        if not isinstance(name, str) or not isinstance(ver, str):
            raise SchemaError(f"versions[{name!r}] is not a string")
    for i, r in enumerate(doc["records"]):
        where = f"records[{i}]"
        if not isinstance(r, dict):
            raise SchemaError(f"{where} is not an object")
        for key in ("set", "mode", "h_qk", "h_v", "seqlens", "impl", "ms", "err", "note"):
            if key not in r:
                raise SchemaError(f"{where} lacks {key!r}")
        if r["set"] not in SETS:
            raise SchemaError(f"{where}.set = {r['set']!r}")
        if r["mode"] not in MODES:
            raise SchemaError(f"{where}.mode = {r['mode']!r}")
        if r["impl"] not in IMPLS:
            raise SchemaError(f"{where}.impl = {r['impl']!r}")
        for key in ("h_qk", "h_v"):
            if not _is_int(r[key]) or r[key] <= 0:
                raise SchemaError(f"{where}.{key} = {r[key]!r}")
        if not isinstance(r["seqlens"], list) or not r["seqlens"] or not all(
            _is_int(x) and x > 0 for x in r["seqlens"]
        ):
            raise SchemaError(f"{where}.seqlens = {r['seqlens']!r}")
        for key in ("ms", "err"):
            if not _is_num_or_null(r[key]):
                raise SchemaError(f"{where}.{key} = {r[key]!r}")
        if not isinstance(r["note"], str):
            raise SchemaError(f"{where}.note is not a string")


def load(path: str) -> Dict[str, Any]:
    with open(path) as f:
        doc = json.load(f)
    validate(doc)
    return doc


def _clean(x):
    """NaN/inf are not JSON: write null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def save(doc: Dict[str, Any], path: str) -> None:
    """Validate, then write atomically (a reader never sees half a file, a crash keeps the last one)."""
    doc = _clean(doc)
    validate(doc)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def record_backend(r: Dict[str, Any]) -> str:
    """The flashgdn backend of a record ("" for anchors)."""
    if r["impl"] != "flashgdn":
        return ""
    if r.get("backend"):
        return r["backend"]
    for part in r.get("note", "").split(";"):
        part = part.strip()
        if part.startswith("backend="):
            return part[len("backend="):].split()[0]
    return "hopper"


def record_key(r: Dict[str, Any]) -> Tuple:
    return (r["set"], r["mode"], r["h_qk"], r["h_v"], tuple(r["seqlens"]), r["impl"], record_backend(r),
            r.get("d_k", 128), r.get("d_v", 128))


def record_status(r: Dict[str, Any]) -> str:
    if r.get("status"):
        return r["status"]
    if r["ms"] is not None:
        return "run"
    return "missing" if r["note"].startswith("missing") else "refused"


def merge(docs: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """Merge result files (parts of a run, or reruns). A later record replaces an earlier one with the same
    shape, mode and implementation, except that "missing" never replaces a record that ran: missing means
    the library was absent from that run, which says nothing about the shape."""
    docs = list(docs)
    if not docs:
        raise ValueError("nothing to merge")
    out: Dict[Tuple, Dict[str, Any]] = {}
    for doc in docs:
        for r in doc["records"]:
            key = record_key(r)
            old = out.get(key)
            if old is not None and record_status(r) == "missing" and record_status(old) != "missing":
                continue
            out[key] = r

    def uniq(values: List[str]) -> List[str]:
        seen: List[str] = []
        for v in values:
            if v and v not in seen:
                seen.append(v)
        return seen

    versions: Dict[str, str] = {}
    for doc in docs:
        for name, ver in doc["versions"].items():
            have = versions.get(name)
            if have is None:
                versions[name] = ver
            elif ver not in have.split(" / "):
                versions[name] = f"{have} / {ver}"
    return {
        "gpu": " + ".join(uniq([d["gpu"] for d in docs])),
        "date": max(d["date"] for d in docs),
        "command": " ; ".join(uniq([d["command"] for d in docs])),
        "versions": versions,
        "records": list(out.values()),
    }
