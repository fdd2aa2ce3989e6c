"""benchmarks/switch_ab.py: one switch timed both ways in one process (on the CPU with the reference backend, where
only the harness is under test: the order of the sides, the records, the bit comparison, the switch restored)."""
import json

import pytest

from flashgdn.kernels.hopper import backward
from helpers import load_benchmark

sab = load_benchmark("switch_ab")

ARGS = ["--switch", "flashgdn.kernels.hopper.backward:FUSED_CLUSTER_SUM", "--heads", "1/2", "--seqlens", "100+30,64",
        "--backend", "reference", "--device", "cpu"]


def test_both_sides_are_timed_in_every_round_and_compared_bit_for_bit(tmp_path, monkeypatch):
    out = tmp_path / "ab.json"
    monkeypatch.setenv("FLASHGDN_CP_BACKWARD_OVERLAP", "0")  # recorded: the settings the switch is timed under
    before = backward.FUSED_CLUSTER_SUM
    assert sab.main(ARGS + ["--rounds", "3", "--out", str(out)]) == 0
    assert backward.FUSED_CLUSTER_SUM == before
    data = json.loads(out.read_text())
    assert data["switch"] == "flashgdn.kernels.hopper.backward:FUSED_CLUSTER_SUM" and data["rounds"] == 3
    assert data["env"]["FLASHGDN_CP_BACKWARD_OVERLAP"] == "0" and data["complete"] is True
    recs = data["records"]
    assert [(r["seqlens"], r["mode"]) for r in recs] == [([100, 30], "fwd"), ([100, 30], "fwdbwd"), ([64], "fwd"),
                                                         ([64], "fwdbwd")]
    for r in recs:
        assert r["same_bits"] is True  # the reference does not read the switch
        assert r["max_rel_diff"] == 0.0
        assert len(r["ms_off_rounds"]) == len(r["ms_on_rounds"]) == 3
        assert r["ratio"] == pytest.approx(r["ms_on"] / r["ms_off"])
    assert set(data["summary"]) == {"fwd,few", "fwdbwd,few"} and data["summary"]["fwd,few"]["n"] == 2


def test_a_switch_that_is_not_a_boolean_is_refused():
    with pytest.raises(SystemExit, match="neither a boolean switch nor an \"auto\" one"):
        sab.main(["--switch", "flashgdn.kernels.hopper.backward:FUSED_P_GIVEN_MIN_HV"] + ARGS[2:])


def test_an_auto_switch_is_timed_off_and_on_and_left_at_auto(tmp_path, monkeypatch):
    monkeypatch.setattr(backward, "FUSED_FOLD_MMA", "auto")
    out = tmp_path / "ab.json"
    assert sab.main(["--switch", "flashgdn.kernels.hopper.backward:FUSED_FOLD_MMA"] + ARGS[2:]
                    + ["--rounds", "2", "--out", str(out)]) == 0
    assert backward.FUSED_FOLD_MMA == "auto"
    assert len(json.loads(out.read_text())["records"]) == 4


def test_a_rounding_switch_passes_on_its_difference_bound(tmp_path, monkeypatch):
    """``--max-diff``: the run passes or fails on the two sides' relative difference instead of equal bits (here a
    stand-in op whose "on" side is off by 1e-3 relative)."""
    real = sab.op_fn

    def drifting(inp, mode, cp, backend="hopper"):
        fn = real(inp, mode, cp, backend)
        return lambda: [x * 1.01 if backward.FUSED_CLUSTER_SUM else x for x in fn()]

    monkeypatch.setattr(sab, "op_fn", drifting)
    out = tmp_path / "ab.json"
    assert sab.main(ARGS + ["--modes", "fwd", "--rounds", "1", "--out", str(out)]) == 1  # bits differ
    assert sab.main(ARGS + ["--modes", "fwd", "--rounds", "1", "--max-diff", "3e-2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["max_diff"] == 3e-2
    assert all(r["same_bits"] is False and 5e-3 < r["max_rel_diff"] < 2e-2 for r in data["records"])
    assert sab.main(ARGS + ["--modes", "fwd", "--rounds", "1", "--max-diff", "1e-3"]) == 1


def test_a_string_switch_is_set_to_its_two_values_and_restored(monkeypatch):
    """``MODULE:NAME=OFF/ON`` (a chunk loop against another, with a boolean set together): each side sees its value."""
    from flashgdn.kernels.hopper import forward

    seen = []
    real = sab.op_fn

    def recording(inp, mode, cp, backend="hopper"):
        fn = real(inp, mode, cp, backend)

        def call():
            seen.append((forward.DEFAULT_CHUNK_LOOP, forward.FUSED_REGISTER_INVERSE))
            return fn()
        return call

    monkeypatch.setattr(sab, "op_fn", recording)
    before = forward.DEFAULT_CHUNK_LOOP
    assert sab.main(["--switch", "flashgdn.kernels.hopper.forward:DEFAULT_CHUNK_LOOP=rso/fused,"
                     "flashgdn.kernels.hopper.forward:FUSED_REGISTER_INVERSE", "--modes", "fwd", "--rounds", "2"]
                    + ARGS[2:]) == 0
    assert forward.DEFAULT_CHUNK_LOOP == before and forward.FUSED_REGISTER_INVERSE is False
    assert set(seen) == {("rso", False), ("fused", True)}
    with pytest.raises(SystemExit, match="NAME=OFF/ON is for a string switch"):
        sab.main(["--switch", "flashgdn.kernels.hopper.forward:FUSED_REGISTER_INVERSE=a/b"] + ARGS[2:])
