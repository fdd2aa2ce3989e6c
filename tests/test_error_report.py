"""The tests' error log (``helpers.rel_rms`` under FLASHGDN_ERROR_LOG) and ``benchmarks/error_report.py``, which gives
each check's worst value over a run."""
import json

import torch

import helpers
from helpers import load_benchmark

report = load_benchmark("error_report")


def _named(scale):
    ref = torch.ones(8, dtype=torch.float64)
    for name in ("dq", "dg"):
        helpers.rel_rms(ref * (1 + scale * (2 if name == "dg" else 1)), ref)  # the site of a named check


def _unnamed(scale):
    ref = torch.ones(8, dtype=torch.float64)
    return helpers.rel_rms(ref * (1 + scale), ref)  # a site without a name


def _checks(scale):
    _named(scale)
    return _unnamed(scale)


def test_rel_rms_is_logged_only_when_asked_and_keeps_its_value(tmp_path, monkeypatch):
    monkeypatch.delenv(helpers.ERROR_LOG_ENV, raising=False)
    assert abs(_checks(1e-3) - 1e-3) < 1e-12
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(helpers.ERROR_LOG_ENV, str(tmp_path / "errs"))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert abs(_checks(1e-3) - 1e-3) < 1e-12
    lines = (tmp_path / "errs" / "errors-gw3.jsonl").read_text().splitlines()
    records = [json.loads(s) for s in lines]
    assert [r["name"] for r in records] == ["dq", "dg", None]
    assert all(r["file"] == "test_error_report.py" and "test_rel_rms_is_logged" in r["test"] for r in records)
    assert records[0]["line"] == records[1]["line"] != records[2]["line"]
    assert records[2]["source"] == "return helpers.rel_rms(ref * (1 + scale), ref)  # a site without a name"
    assert records[2]["line"] > records[0]["line"]
    assert abs(records[1]["value"] - 2e-3) < 1e-12


def test_the_report_gives_each_sites_worst_value_and_its_test(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "errs"
    monkeypatch.setenv(helpers.ERROR_LOG_ENV, str(folder))
    for worker, scale in (("gw0", 1e-3), ("gw1", 4e-3), ("gw0", 2e-3)):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"tests/test_x.py::case[{scale}] (call)")
        _checks(scale)
    with open(folder / "errors-gw1.jsonl", "a") as f:
        f.write('{"cut short')  # a worker killed mid-line
    records = report.read_records(str(folder))
    assert len(records) == 9
    rows = report.worst_by_site(records)
    # worst first; the two at 4e-3 by line (the named site comes first in the file)
    assert [(r["name"], r["checks"], r["tests"]) for r in rows] == [("dg", 3, 3), ("dq", 3, 3), (None, 3, 3)]
    assert [round(r["worst"], 9) for r in rows] == [8e-3, 4e-3, 4e-3]
    assert all(r["worst_test"] == "tests/test_x.py::case[0.004]" for r in rows)
    out = tmp_path / "rows.json"
    assert report.main([str(folder), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "9 values from 3 tests at 3 checks" in text and "| test_error_report.py:" in text
    assert json.loads(out.read_text()) == rows
    assert report.main([str(tmp_path / "none")]) == 1


def test_a_nan_is_the_worst_value():
    rows = report.worst_by_site([dict(file="f", line=1, name=None, test="a", source="s", value=1.0),
                                 dict(file="f", line=1, name=None, test="b", source="s", value=float("nan"))])
    assert rows[0]["worst_test"] == "b" and rows[0]["worst"] != rows[0]["worst"]
