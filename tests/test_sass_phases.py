"""``benchmarks/sass_phases.py`` (CPU): a barrier-phased kernel's samples, instructions and shared-memory wavefronts
split at its ``BAR`` instructions, in address order."""
import os
import sys

from helpers import load_benchmark

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))  # it imports sass_stalls
sp = load_benchmark("sass_phases")

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","L1 Wavefronts Shared",'
          '"stall_long_sb","stall_barrier"')


def test_cuts_after_each_barrier_and_sums_each_phase(tmp_path):
    path = tmp_path / "k.csv"
    path.write_text("\n".join(['"Kernel Name","kkt_inverse_kernel",', HEADER,
                               '"0x00","      LDS.128 R4, [R2]","6","10","20","6","0"',
                               '"0x10","      BAR.SYNC.DEFER_BLOCKING 0x0","4","10","0","0","4"',
                               '"0x20","      FFMA R1, R2, R3, R4","1","40","0","0","0"',
                               '"0x30","      LDS R5, [R2]","3","40","40","3","0"',
                               '"0x40","@P0   BAR.SYNC 0x0","2","10","0","0","2"',
                               '"0x50","      STG.E.U16 [R2], R5","4","10","0","0","0"',
                               '"0x60","      EXIT","0","10","0","0","0"']) + "\n")
    rows = sp.read_rows(str(path))
    assert [len(p) for p in sp.phases(rows)] == [2, 3, 2]
    table, stats = sp.phase_table(rows, ["loads", "substitution"])
    assert [s["name"] for s in stats] == ["loads", "substitution", "phase 2"]
    assert [s["samples"] for s in stats] == [10, 6, 4]
    assert [s["executed"] for s in stats] == [20, 90, 20]
    assert [s["wavefronts"] for s in stats] == [20, 40, 0]
    assert abs(stats[0]["share"] - 0.5) < 1e-12
    assert "| loads | 2 | 10 | 50.0% | 20 | 20 | long_sb 60%, barrier 40% | LDS 10, BAR 10 |" in table
