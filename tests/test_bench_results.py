"""The results file (schema, merge) and its rendering (Markdown, PNG)."""
from __future__ import annotations

import copy
import json
import os

import pytest

from flashgdn.bench import report, results


def rec(impl, ms, *, set_="quick", mode="fwd", heads=(16, 32), seqlens=(8192,), err=3.9e-3, note="", **extra):
    r = {"set": set_, "mode": mode, "h_qk": heads[0], "h_v": heads[1], "seqlens": list(seqlens), "impl": impl,
         "ms": ms, "err": err if ms is not None else None, "note": note}
    r.update(extra)
    return r


def doc(records, gpu="NVIDIA H200 (132 SMs)", date="2026-01-01T00:00:00+00:00", command="python -m flashgdn.bench"):
    return {"gpu": gpu, "date": date, "command": command, "versions": {"torch": "2.11.0"}, "records": records}


def sample_records(with_flashgdn=True):
    rs = []
    for seqlens in [(8192,), (4096,) * 8, (1000, 3000)]:
        for mode, f in (("fwd", 1.0), ("fwdbwd", 4.0)):
            if with_flashgdn:
                rs.append(rec("flashgdn", 0.20 * f, mode=mode, seqlens=seqlens, first_call_s=3.0, peak_mem_mb=12.0))
                rs.append(rec("flashgdn", 9.0 * f, mode=mode, seqlens=seqlens, note="backend=reference",
                              backend="reference"))
            rs.append(rec("flashqla", 0.30 * f, mode=mode, seqlens=seqlens, first_call_s=20.0))
            if mode == "fwd":
                rs.append(rec("fla", 0.50, mode=mode, seqlens=seqlens))
                rs.append(rec("flashinfer", 0.25, mode=mode, seqlens=seqlens, err=8e-3))
            else:
                rs.append(rec("fla", None, mode=mode, seqlens=seqlens,
                              note="refused: RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper ..."))
                rs.append(rec("flashinfer", None, mode=mode, seqlens=seqlens, note="refused: flashinfer has no backward"))
    return rs


def test_validate_accepts_a_good_file():
    results.validate(doc(sample_records()))
    results.validate(doc([]))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("gpu"),
        lambda d: d.__setitem__("versions", {"torch": 2}),
        lambda d: d["records"][0].__setitem__("impl", "flashgdn-hopper"),
        lambda d: d["records"][0].__setitem__("set", "long"),
        lambda d: d["records"][0].__setitem__("mode", "bwd"),
        lambda d: d["records"][0].__setitem__("ms", float("nan")),
        lambda d: d["records"][0].__setitem__("ms", "0.2"),
        lambda d: d["records"][0].__setitem__("seqlens", []),
        lambda d: d["records"][0].__setitem__("seqlens", [8192.0]),
        lambda d: d["records"][0].__setitem__("h_v", True),
        lambda d: d["records"][0].pop("note"),
        lambda d: d["records"][0].__setitem__("note", None),
    ],
)
def test_validate_rejects(mutate):
    d = doc(sample_records())
    mutate(d)
    with pytest.raises(results.SchemaError):
        results.validate(d)


def test_save_writes_valid_json_without_nan(tmp_path):
    d = doc([rec("flashqla", 0.3, peak_mem_mb=float("nan"))])
    p = str(tmp_path / "x.json")
    results.save(d, p)
    loaded = results.load(p)
    assert loaded["records"][0]["peak_mem_mb"] is None
    with open(p) as f:
        assert "NaN" not in f.read()


def test_record_backend_and_status():
    assert results.record_backend(rec("flashgdn", 1.0)) == "hopper"
    assert results.record_backend(rec("flashgdn", 1.0, note="backend=reference")) == "reference"
    assert results.record_backend(rec("flashgdn", None, note="missing: x; backend=reference")) == "reference"
    assert results.record_backend(rec("flashqla", 1.0)) == ""
    assert results.record_status(rec("fla", None, note="missing: ImportError")) == "missing"
    assert results.record_status(rec("fla", None, note="refused: RuntimeError")) == "refused"
    assert results.record_status(rec("fla", 0.1)) == "run"


def test_merge_parts_and_reruns():
    a = doc([rec("flashqla", 0.3), rec("fla", 0.5), rec("flashgdn", 0.2)], date="2026-01-01", command="a")
    b = doc([rec("flashqla", 0.3, seqlens=(4096,) * 8), rec("fla", 0.45),
             rec("flashgdn", None, note="missing: ImportError")], gpu="NVIDIA H200 (132 SMs)",
            date="2026-01-02", command="b")
    b["versions"] = {"torch": "2.11.0", "flash-qla": "0.1.3"}
    m = results.merge([a, b])
    results.validate(m)
    assert m["date"] == "2026-01-02" and m["command"] == "a ; b" and m["gpu"] == "NVIDIA H200 (132 SMs)"
    assert m["versions"] == {"torch": "2.11.0", "flash-qla": "0.1.3"}
    by = {(r["impl"], tuple(r["seqlens"])): r for r in m["records"]}
    assert len(m["records"]) == 4
    assert by[("fla", (8192,))]["ms"] == 0.45  # the later run wins
    assert by[("flashgdn", (8192,))]["ms"] == 0.2  # but "missing" does not erase a record that ran
    # flashgdn backends are distinct records
    c = doc([rec("flashgdn", 9.0, note="backend=reference")])
    assert len(results.merge([a, c])["records"]) == 4


def test_render_markdown_tables():
    md = report.render(doc(sample_records()), "md")
    assert "## quick: forward (3 shapes)" in md
    assert "## quick: forward + backward (3 shapes)" in md
    assert "## quick: backward (fwd+bwd - fwd)" in md
    assert "flashgdn[reference] ms (err)" in md
    assert "× flashqla" in md and "× flashinfer" in md
    # flashqla 0.30 ms vs flashgdn 0.20 ms: 1.50x; flashinfer's error above the bar is marked
    line = next(l for l in md.splitlines() if l.startswith("| 16/32 | 8192 |"))
    assert "| 1.50 |" in line and "(8.0e-03!)" in line
    # bwd = fwdbwd - fwd: flashgdn 0.8 - 0.2 = 0.6, flashqla 1.2 - 0.3 = 0.9
    bwd = md.split("backward (fwd+bwd - fwd)")[1]
    assert "0.600" in bwd and "0.900" in bwd
    assert "refused: RuntimeError: Triton >= 3.4.0" in md
    assert "first call median s" in md
    text = report.render(doc(sample_records()), "text")
    assert "== quick: forward" in text


def test_render_without_flashgdn_uses_best_anchor():
    md = report.render(doc(sample_records(with_flashgdn=False)), "md")
    assert "TFLOPS (best)" in md and "× flashqla" not in md


@pytest.mark.parametrize("with_flashgdn", [True, False])
def test_write_report_creates_md_and_pngs(tmp_path, with_flashgdn):
    paths = report.write_report(doc(sample_records(with_flashgdn)), str(tmp_path), "latest")
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["latest-fwd.png", "latest-fwdbwd.png", "latest.md"]
    for p in paths:
        assert os.path.getsize(p) > 1000
    with open(tmp_path / "latest-fwd.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_series_reference_choice():
    title, xs, sets, series = report._plot_series(sample_records(True), "fwd")
    assert "speedup of flashgdn" in title and len(xs) == 3
    assert series["flashqla"] == pytest.approx([1.5] * 3)
    assert "flashgdn[reference]" not in series and "flashgdn" not in series
    title, xs, sets, series = report._plot_series(sample_records(False), "fwd")
    assert "relative to the fastest" in title
    assert series["flashinfer"] == pytest.approx([1.0] * 3)
    assert series["fla"] == pytest.approx([2.0] * 3)


def test_write_report_with_only_missing_records(tmp_path):
    d = doc([rec("flashqla", None, note="missing: ModuleNotFoundError: No module named 'flash_qla'")])
    paths = report.write_report(d, str(tmp_path), "empty")
    assert any(p.endswith("empty.md") for p in paths)
    assert "missing: ModuleNotFoundError" in open(tmp_path / "empty.md").read()


def test_speedup_summary_splits_shapes_by_whether_they_fill_the_gpu():
    # 16/32 heads: 1 sequence = 32 CTAs (few); 2 and 8 sequences = 64 and 256 CTAs (full)
    rs = [rec("flashgdn", 0.2, seqlens=(8192,)), rec("flashqla", 0.1, seqlens=(8192,)),
          rec("flashgdn", 0.2, seqlens=(4096,) * 8), rec("flashqla", 0.4, seqlens=(4096,) * 8),
          rec("flashgdn", 0.1, seqlens=(2048,) * 2), rec("flashqla", 0.2, seqlens=(2048,) * 2)]
    (shapes,) = report._grouped(rs).values()
    lines = report.speedup_summary(shapes)
    assert lines == [
        "- × flashqla, sequences x Hv >= 64: geometric mean 2.00 over 2 shapes; faster on 2, worst 2.00",
        "- × flashqla, sequences x Hv < 64: geometric mean 0.50 over 1 shapes; faster on 0, worst 0.50",
    ]
    assert "geometric mean 2.00" in report.render(doc(rs))
