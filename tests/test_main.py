"""The main job, ``python -m flashgdn``."""
import subprocess
import sys

import pytest

from flashgdn import __main__ as job


def test_main_forward_and_backward(capsys):
    rc = job.main(["--heads", "2/4", "--seqlens", "70,0,130", "--dim", "32", "--backward", "--repeat", "1",
                   "--check-heads", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "backend: reference (asked: auto)" in out
    assert "q, k [1, 200, 2, 32] v [1, 200, 4, 32] bf16" in out
    assert "forward+backward:" in out and "dbeta" in out and "dh0" in out
    assert "sequence 0: 70 tokens; qk heads 0..1, value heads 0..3" in out
    assert out.rstrip().endswith("result: OK")


def test_main_reports_a_failed_check(capsys, monkeypatch):
    monkeypatch.setitem(job.BARS, job.DTYPES["fp32"], dict.fromkeys(job.BARS[job.DTYPES["fp32"]], 0.0))
    rc = job.main(["--heads", "1/2", "--seqlens", "20", "--dim", "8", "--dtype", "fp32", "--repeat", "1"])
    assert rc == 1
    assert "result: FAILED: o > 0e+00" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--heads", "3/4"], ["--heads", "x"], ["--seqlens", "0,0"], ["--seqlens", "1,-2"],
                                  ["--check-heads", "9"], ["--dtype", "int8"]])
def test_main_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        job.parse_args(argv)
    assert e.value.code == 2


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "flashgdn", "--heads", "1/1", "--seqlens", "5,64", "--dim", "16",
                        "--repeat", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "result: OK" in r.stdout
