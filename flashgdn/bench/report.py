"""Rendering a results file: console and Markdown tables, and speedup plots (PNG)."""
from __future__ import annotations

import math
import os
import statistics
from collections import Counter, OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import inputs as cost
from .check import BAR_FWD, BAR_GRAD
from .results import record_backend, record_status
from .shapes import Shape, seqlens_label

IMPL_ORDER = ("flashgdn", "flashqla", "fla", "flashinfer")
SET_ORDER = ("quick", "canonical", "bwd", "cp", "custom")
MODE_TITLE = {"fwd": "forward", "fwdbwd": "forward + backward", "bwd": "backward (fwd+bwd - fwd)"}


def record_label(r: Dict[str, Any]) -> str:
    b = record_backend(r)
    return r["impl"] if b in ("", "hopper") else f"{r['impl']}[{b}]"


def _label_sort_key(label: str) -> Tuple[int, str]:
    base = label.split("[")[0]
    return (IMPL_ORDER.index(base) if base in IMPL_ORDER else len(IMPL_ORDER), label)


def _shape_of(r: Dict[str, Any]) -> Shape:
    return Shape(r["set"], r["h_qk"], r["h_v"], tuple(r["seqlens"]))


def _dims(r: Dict[str, Any]) -> Tuple[int, int]:
    return r.get("d_k") or 128, r.get("d_v") or 128


def _grouped(records: Sequence[Dict[str, Any]]):
    """{(set, mode): {(shape, dims): {label: record}}}, shapes in first-seen order, sets in SET_ORDER."""
    groups: Dict[Tuple[str, str], "OrderedDict"] = {}
    for r in records:
        g = groups.setdefault((r["set"], r["mode"]), OrderedDict())
        g.setdefault((_shape_of(r), _dims(r)), {})[record_label(r)] = r
    order = sorted(groups, key=lambda k: (SET_ORDER.index(k[0]) if k[0] in SET_ORDER else 99, k[1]))
    return OrderedDict((k, groups[k]) for k in order)


def _fmt_ms(x: Optional[float]) -> str:
    if x is None:
        return "–"
    if x < 0.001:
        return f"{x:.1e}"
    return f"{x:.3f}" if x < 100 else f"{x:.0f}"


def _fmt_err(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.1e}"


def _cell(r: Optional[Dict[str, Any]]) -> str:
    if r is None:
        return ""
    st = record_status(r)
    if st != "run":
        return st
    s = _fmt_ms(r["ms"])
    err = r.get("err")
    if err is not None:
        bad = err > BAR_FWD or any(e > BAR_GRAD.get(n, 1.0) for n, e in (r.get("err_grads") or {}).items())
        s += f" ({_fmt_err(err)}{'!' if bad else ''})"
    return s


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], fmt: str = "md") -> str:
    if fmt == "md":
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _ms(r: Optional[Dict[str, Any]]) -> Optional[float]:
    return None if r is None else r.get("ms")


def _table(shapes: "OrderedDict", mode: str, fmt: str) -> str:
    labels = sorted({lab for cells in shapes.values() for lab in cells}, key=_label_sort_key)
    anchors = [lab for lab in labels if not lab.startswith("flashgdn")]
    has_fg = any(_ms(cells.get("flashgdn")) is not None for cells in shapes.values())
    headers = ["Hqk/Hv", "seqlens", "floor ms"] + [f"{lab} ms (err)" for lab in labels]
    if has_fg:
        headers += [f"× {a}" for a in anchors]
    who = "flashgdn" if has_fg else "best"
    headers += [f"TFLOPS ({who})", f"% floor ({who})"]
    rows = []
    for (shape, (K, V)), cells in shapes.items():
        floor = cost.floor_ms(shape, K, V, mode)
        row = [shape.heads_label, shape.seqlens_label, _fmt_ms(floor)] + [_cell(cells.get(lab)) for lab in labels]
        fg = _ms(cells.get("flashgdn"))
        if has_fg:
            for a in anchors:
                t = _ms(cells.get(a))
                row.append(f"{t / fg:.2f}" if t is not None and fg is not None else "")
        ref = fg
        if not has_fg:
            times = [_ms(c) for lab, c in cells.items() if _ms(c) is not None and not lab.startswith("flashgdn[")]
            ref = min(times) if times else None
        if ref is not None:
            row += [f"{cost.nominal_tflops(shape, K, V, mode, ref):.1f}", f"{100 * floor / ref:.0f}"]
        else:
            row += ["", ""]
        rows.append(row)
    return render_table(headers, rows, fmt)


def speedup_summary(shapes: "OrderedDict") -> List[str]:
    """Per anchor, the geometric-mean speedup of flashgdn on the shapes that fill the GPU without context
    parallelism (sequences x Hv >= 64) and on the others, with how many it is faster on and its worst ratio."""
    labels = sorted({lab for cells in shapes.values() for lab in cells}, key=_label_sort_key)
    lines = []
    for a in (lab for lab in labels if not lab.startswith("flashgdn")):
        for fills, what in ((True, "sequences x Hv >= 64"), (False, "sequences x Hv < 64")):
            ratios = []
            for (shape, _), cells in shapes.items():
                fg, t = _ms(cells.get("flashgdn")), _ms(cells.get(a))
                if shape.fills_gpu == fills and fg is not None and t is not None:
                    ratios.append(t / fg)
            if ratios:
                gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
                faster = sum(r > 1 for r in ratios)
                lines.append(f"- × {a}, {what}: geometric mean {gm:.2f} over {len(ratios)} shapes; faster on "
                             f"{faster}, worst {min(ratios):.2f}")
    return lines


def _bwd_table(fwd: "OrderedDict", fwdbwd: "OrderedDict", fmt: str) -> Optional[str]:
    labels = sorted({lab for cells in fwdbwd.values() for lab in cells}, key=_label_sort_key)
    rows, used = [], set()
    for key, cells in fwdbwd.items():
        fcells = fwd.get(key)
        if not fcells:
            continue
        vals = {}
        for lab in labels:
            a, b = _ms(fcells.get(lab)), _ms(cells.get(lab))
            if a is not None and b is not None:
                vals[lab] = b - a
                used.add(lab)
        if vals:
            rows.append((key[0], vals))
    if not rows:
        return None
    labels = [lab for lab in labels if lab in used]
    anchors = [lab for lab in labels if not lab.startswith("flashgdn")]
    has_fg = "flashgdn" in labels
    headers = ["Hqk/Hv", "seqlens"] + [f"{lab} bwd ms" for lab in labels]
    if has_fg:
        headers += [f"× {a}" for a in anchors]
    out = []
    for shape, vals in rows:
        row = [shape.heads_label, shape.seqlens_label] + [_fmt_ms(vals.get(lab)) if lab in vals else "" for lab in labels]
        if has_fg:
            fg = vals.get("flashgdn")
            for a in anchors:
                row.append(f"{vals[a] / fg:.2f}" if fg and a in vals and fg > 0 else "")
        out.append(row)
    return render_table(headers, out, fmt)


def _reason(r: Dict[str, Any]) -> str:
    note = r["note"]
    reason = note.split(": ", 1)[1] if ": " in note else note
    return reason.split("; backend=")[0].strip()


def _status_lines(records: Sequence[Dict[str, Any]]) -> List[str]:
    lines = []
    for lab in sorted({record_label(r) for r in records}, key=_label_sort_key):
        rs = [r for r in records if record_label(r) == lab]
        counts = Counter(record_status(r) for r in rs)
        lines.append(f"- {lab}: " + ", ".join(f"{st} {counts[st]}" for st in ("run", "missing", "refused") if counts[st]))
        for st in ("missing", "refused"):
            reasons = list(OrderedDict.fromkeys(_reason(r) for r in rs if record_status(r) == st))
            for reason in reasons[:3]:
                lines.append(f"  - {st}: {reason}")
            if len(reasons) > 3:
                lines.append(f"  - {st}: ... and {len(reasons) - 3} more distinct reasons")
    return lines


def _first_call_lines(records: Sequence[Dict[str, Any]], fmt: str) -> str:
    stats: Dict[Tuple[str, str], List[Tuple[float, Optional[float]]]] = OrderedDict()
    for r in sorted(records, key=lambda r: (_label_sort_key(record_label(r)), r["mode"])):
        if record_status(r) == "run" and r.get("first_call_s") is not None:
            stats.setdefault((record_label(r), r["mode"]), []).append((r["first_call_s"], r.get("peak_mem_mb")))
    if not stats:
        return ""
    rows = []
    for (lab, mode), xs in stats.items():
        fc = [x[0] for x in xs]
        mem = [x[1] for x in xs if x[1] is not None]
        rows.append([lab, mode, str(len(xs)), f"{statistics.median(fc):.2f}", f"{max(fc):.1f}", f"{sum(fc):.0f}",
                     f"{max(mem):.0f}" if mem else "–"])
    return render_table(["impl", "mode", "shapes", "first call median s", "max s", "total s", "peak extra MiB (max)"],
                        rows, fmt)


def render(doc: Dict[str, Any], fmt: str = "md") -> str:
    """The whole report as Markdown (fmt="md") or aligned text for a console (fmt="text")."""
    records = doc["records"]
    h = "## " if fmt == "md" else "== "
    out = []
    if fmt == "md":
        out.append("# GDN chunked prefill benchmark\n")
    out.append(f"GPU: {doc['gpu']}  \nDate: {doc['date']}  \nCommand: `{doc['command']}`  ")
    out.append("Versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()) + "\n")
    timers = sorted({r.get("timer") for r in records if r.get("timer")})
    out.append(
        "Milliseconds per call (median; timers: " + (", ".join(timers) or "none") + "), packed varlen B = 1, "
        "inputs as DESIGN.md §5. In parentheses: relative RMS error against the float64 reference on a slice "
        f"(max of o and final state; `!` marks an error above the bar: {BAR_FWD:.0e} for o/state, "
        "8e-3 dq/dk/dv/dh0, 2e-2 dg/dbeta). `× X`: speedup of flashgdn over X (t_X / t_flashgdn). "
        "TFLOPS are nominal (4·T·Hv·K·V / t; ×3 for fwd+bwd). floor = max(FLOP time at 687 TFLOP/s, "
        "HBM time at 4.25 TB/s: the H200's measured ceilings, on any GPU); fwd+bwd counts ~3× the forward "
        "FLOPs and the backward's minimal traffic; % floor = floor / t. When flashgdn has not run, TFLOPS and "
        "% floor are those of the fastest implementation.\n"
    )
    groups = _grouped(records)
    for (set_name, mode), shapes in groups.items():
        out.append(f"{h}{set_name}: {MODE_TITLE[mode]} ({len(shapes)} shapes)\n")
        out.append(_table(shapes, mode, fmt) + "\n")
        summary = speedup_summary(shapes)
        if summary:
            out.append("\n".join(summary) + "\n")
        if mode == "fwdbwd" and (set_name, "fwd") in groups:
            t = _bwd_table(groups[(set_name, "fwd")], shapes, fmt)
            if t:
                out.append(f"{h}{set_name}: {MODE_TITLE['bwd']}\n")
                out.append(t + "\n")
    fc = _first_call_lines(records, fmt)
    if fc:
        out.append(f"{h}first calls (JIT compile, autotune) and memory\n")
        out.append(fc + "\n")
    out.append(f"{h}implementations\n")
    out.append("\n".join(_status_lines(records)) + "\n")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# plots


def _plot_series(records: Sequence[Dict[str, Any]], mode: str):
    """(title, x labels, set boundaries, {label: [ratio or None]}) for one mode."""
    groups = [(k, v) for k, v in _grouped(records).items() if k[1] == mode]
    xs: List[str] = []
    sets: List[Tuple[int, str]] = []
    rows: List[Dict[str, Optional[float]]] = []
    for (set_name, _), shapes in groups:
        sets.append((len(xs), set_name))
        for (shape, _dims_), cells in shapes.items():
            xs.append(shape.label)
            rows.append({lab: _ms(c) for lab, c in cells.items()})
    has_fg = any(row.get("flashgdn") is not None for row in rows)
    primary = [lab for row in rows for lab in row if not lab.startswith("flashgdn[") and row[lab] is not None]
    use_all = not primary
    series: Dict[str, List[Optional[float]]] = {}
    labels = sorted({lab for row in rows for lab in row}, key=_label_sort_key)
    for lab in labels:
        if lab == "flashgdn" and has_fg:
            continue
        if lab.startswith("flashgdn[") and not use_all:
            continue
        vals = []
        for row in rows:
            t = row.get(lab)
            if has_fg:
                ref = row.get("flashgdn")
            else:
                cand = [v for k, v in row.items() if v is not None and (use_all or not k.startswith("flashgdn["))]
                ref = min(cand) if cand else None
            vals.append(t / ref if t is not None and ref else None)
        series[lab] = vals
    if has_fg:
        title = f"{MODE_TITLE[mode]}: speedup of flashgdn over each (t_X / t_flashgdn; above 1: flashgdn faster)"
    else:
        title = f"{MODE_TITLE[mode]}: time relative to the fastest (t_X / t_best; 1 = fastest) — no flashgdn records"
    return title, xs, sets, series


def plot_mode(records: Sequence[Dict[str, Any]], mode: str, path: str) -> bool:
    """Write one PNG of per-shape ratios for ``mode``; False when there is no record of that mode."""
    if not any(r["mode"] == mode for r in records):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title, xs, sets, series = _plot_series(records, mode)
    n = len(xs)
    fig, ax = plt.subplots(figsize=(min(60.0, max(8.0, 0.18 * n + 2.5)), 5.5))
    markers = ["o", "s", "^", "D", "v", "P"]
    plotted = False
    for i, (lab, vals) in enumerate(series.items()):
        pts = [(j, v) for j, v in enumerate(vals) if v is not None and v > 0]
        if pts:
            gmean = math.exp(sum(math.log(p[1]) for p in pts) / len(pts))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], markers[i % len(markers)],
                    label=f"{lab} (geomean {gmean:.2f})", ms=5, alpha=0.85)
            plotted = True
    ax.axhline(1.0, color="k", lw=0.8)
    for start, name in sets:
        ax.axvline(start - 0.5, color="0.6", lw=0.8, ls="--")
        ax.text(start - 0.3, 1.0, name, transform=ax.get_xaxis_transform(), va="top", fontsize=8, color="0.3")
    if plotted:
        ax.set_yscale("log", base=2)
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no timings to compare", transform=ax.transAxes, ha="center", va="center")
    ax.set_xticks(range(n))
    ax.set_xticklabels(xs, rotation=90, fontsize=6)
    ax.set_xlim(-1, max(n, 1))
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("t_X / t_flashgdn" if "speedup" in title else "t_X / t_best")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(doc: Dict[str, Any], out_dir: str, stem: str) -> List[str]:
    """``stem.md`` and ``stem-fwd.png`` / ``stem-fwdbwd.png`` (for the modes present) in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    md = os.path.join(out_dir, f"{stem}.md")
    with open(md, "w") as f:
        f.write(render(doc, "md"))
    paths.append(md)
    for mode in ("fwd", "fwdbwd"):
        p = os.path.join(out_dir, f"{stem}-{mode}.png")
        if plot_mode(doc["records"], mode, p):
            paths.append(p)
    return paths
