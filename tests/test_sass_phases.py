"""``benchmarks/sass_phases.py`` (CPU): a barrier-phased kernel's samples, instructions and shared-memory wavefronts
split at its ``BAR`` instructions, in address order."""
import os
import sys

from helpers import load_benchmark

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))  # it imports sass_stalls
sp = load_benchmark("sass_phases")

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","L1 Wavefronts Shared",'
          '"stall_long_sb","stall_barrier"')


def source_page(tmp_path, kernel, rows):
    """A one-kernel source-page CSV of ``rows`` (each a line under HEADER), as Nsight Compute writes it."""
    path = tmp_path / "k.csv"
    path.write_text("\n".join([f'"Kernel Name","{kernel}",', HEADER, *rows]) + "\n")
    return str(path)


def test_cuts_after_each_barrier_and_sums_each_phase(tmp_path):
    path = source_page(tmp_path, "kkt_inverse_kernel", [
        '"0x00","      LDS.128 R4, [R2]","6","10","20","6","0"',
        '"0x10","      BAR.SYNC.DEFER_BLOCKING 0x0","4","10","0","0","4"',
        '"0x20","      FFMA R1, R2, R3, R4","1","40","0","0","0"',
        '"0x30","      LDS R5, [R2]","3","40","40","3","0"',
        '"0x40","@P0   BAR.SYNC 0x0","2","10","0","0","2"',
        '"0x50","      STG.E.U16 [R2], R5","4","10","0","0","0"',
        '"0x60","      EXIT","0","10","0","0","0"'])
    rows = sp.read_rows(path)
    assert [len(p) for p in sp.phases(rows)] == [2, 3, 2]
    table, stats = sp.phase_table(rows, ["loads", "substitution"])
    assert [s["name"] for s in stats] == ["loads", "substitution", "phase 2"]
    assert [s["samples"] for s in stats] == [10, 6, 4]
    assert [s["executed"] for s in stats] == [20, 90, 20]
    assert [s["wavefronts"] for s in stats] == [20, 40, 0]
    assert abs(stats[0]["share"] - 0.5) < 1e-12
    assert "| loads | 2 | 10 | 50.0% | 20 | 20 | long_sb 60%, barrier 40% | LDS 10, BAR 10 |" in table


def test_role_keeps_one_warpgroups_code_and_its_out_of_line_waits(tmp_path, capsys):
    # two roles (96 and 192 registers); the 96 role's wait retries out of line after the last role's code, and its
    # phases are cut at its own warpgroup barrier
    path = source_page(tmp_path, "chunk_forward_rs_kernel_kernel", [
        '"0x00","      USETMAXREG.DEALLOC.CTAPOOL 0x60","0","10","0","0","0"',
        '"0x10","      SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1], R2","1","10","0","0","0"',
        '"0x20","@!P0  BRA 0x90","2","10","0","2","0"',
        '"0x30","      BAR.SYNC.DEFER_BLOCKING 0x5, 0x80","3","10","0","0","3"',
        '"0x40","      LDS R5, [R2]","5","10","10","5","0"',
        '"0x50","      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc0","0","10","0","0","0"',
        '"0x60","      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ","7","10","20","0","0"',
        '"0x70","      EXIT","0","10","0","0","0"',
        '"0x80","      BRA 0x80","0","0","0","0","0"',
        '"0x90","      SYNCS.PHASECHK.TRANS64 P0, [R1], R2","11","10","0","11","0"',
        '"0xa0","@!P0  BRA 0x90","0","10","0","0","0"'])
    assert sp.main([path, "--role", "96", "--names", "wait,loads"]) == 0
    out = capsys.readouterr().out
    # the 96 role: its own 5 rows and the 2 of its retry loop; 22 samples, none of the 192 role's HGMMA
    assert out.startswith("7 instructions, 2 phases, 22 stall samples, 10 shared wavefronts")
    assert "| wait | 4 | 6 |" in out
    assert "| loads | 3 | 16 |" in out
