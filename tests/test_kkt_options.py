"""benchmarks/kkt_options.py: its shape parsing on the CPU, and one small run on the GPU (same bits, exit status)."""
import pytest

from helpers import load_benchmark

kkt_options = load_benchmark("kkt_options")


def test_shapes_are_parsed():
    assert kkt_options.parse_shapes("16/32:4096x8,2/8:1000x3") == [(16, 32, [4096] * 8), (2, 8, [1000] * 3)]


@pytest.mark.parametrize("bad", ["16/32", "16/30:4096x8", "16/32:4096", "a/b:1x1", "2/8:0x4"])
def test_bad_shapes_are_clear_errors(bad):
    with pytest.raises(SystemExit, match="--shapes"):
        kkt_options.parse_shapes(bad)


def test_option_sets_take_flags_and_integer_settings():
    assert kkt_options.parse_options("diag16+mma32+blocks_per_sm=7") == dict(diag16=True, mma32=True, blocks_per_sm=7)
    for bad in ("diag16+", "blocks_per_sm=x", "=3"):
        with pytest.raises(SystemExit, match="--options"):
            kkt_options.parse_options(bad)
    with pytest.raises(SystemExit, match="--base"):
        kkt_options.main(["--options", "triangle", "--base", "diag16"])


@pytest.mark.gpu
def test_triangle_option_runs_with_the_same_bits(cuda, tmp_path):
    out = tmp_path / "kkt.json"
    assert kkt_options.main(["--shapes", "2/8:1000x3", "--options", "triangle", "--rounds", "1",
                             "--out", str(out)]) == 0
    import json

    row = json.loads(out.read_text())["rows"][0]
    assert row["same_bits"] == {"triangle": True} and row["finite"]


@pytest.mark.gpu
def test_diag16_option_differs_in_bits_and_passes_within_max_diff(cuda, tmp_path):
    out = tmp_path / "kkt.json"
    args = ["--shapes", "2/8:1000x3", "--options", "diag16", "--rounds", "1"]
    assert kkt_options.main(args) == 1  # its tf32 products round differently: not the same bits
    assert kkt_options.main(args + ["--max-diff", "5e-3", "--out", str(out)]) == 0
    import json

    row = json.loads(out.read_text())["rows"][0]
    assert row["same_bits"] == {"diag16": False} and row["finite"] and 0 < row["max_rel_diff"]["diag16"] <= 5e-3


@pytest.mark.gpu
def test_an_occupancy_setting_against_another_base_runs_with_the_same_bits(cuda, tmp_path):
    """``--base`` compares with the named set (the build without options is then not run), and integer settings
    reach the build: a group of one at seven CTAs per SM gives the five-per-SM build's bits (notes v0.33c)."""
    out = tmp_path / "kkt.json"
    assert kkt_options.main(["--shapes", "2/2:1000x3", "--options", "diag16+mma32,diag16+mma32+blocks_per_sm=7",
                             "--base", "diag16+mma32", "--rounds", "1", "--out", str(out)]) == 0
    import json

    row = json.loads(out.read_text())["rows"][0]
    assert row["base"] == "diag16+mma32" and set(row["ms"]) == {"diag16+mma32", "diag16+mma32+blocks_per_sm=7"}
    assert row["same_bits"] == {"diag16+mma32+blocks_per_sm=7": True} and row["finite"]
