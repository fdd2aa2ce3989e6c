"""benchmarks/anchor_kernel_report.py: FlashQLA's fused backward beside ours, compiled for sm_90a (ours on the CPU
here; FlashQLA's needs its package, which only the GPU machine's stack has)."""
import pytest

from helpers import load_benchmark

akr = load_benchmark("anchor_kernel_report")


@pytest.mark.parametrize("heads", ["16", "3/4", "a/b", "0/4"])
def test_bad_heads_are_named(heads, capsys):
    with pytest.raises(SystemExit) as e:
        akr.main(["--heads", heads])
    assert e.value.code == 2 and "--heads: expected HQK/HV" in capsys.readouterr().err


def test_a_site_without_flashqla_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--site: no flash_qla Hopper backward"):
        akr.load_flashqla_fused_backward(str(tmp_path))


def test_compile_report_of_the_operators_build(capsys):
    """Ours alone: the operator's 16/32 build (its options named) with the compile tests' resource figures."""
    assert akr.main(["--heads", "16/32"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("flashgdn fused_backward 16/32 (") and "p_given" in line and "'instructions':" in line
