"""``benchmarks/sass_wavefronts.py`` (CPU): shared-memory wavefronts by opcode and the instructions with bank
conflicts, from Nsight Compute's per-instruction CSV."""
import lzma
import os

from helpers import load_benchmark

sw = load_benchmark("sass_wavefronts")

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"L1 Wavefronts Shared","L1 Wavefronts Shared Ideal"')


def test_counts_wavefronts_by_opcode_and_finds_the_conflicted_instruction(tmp_path):
    path = tmp_path / "k.csv.xz"
    text = "\n".join(['"Kernel Name","k",', HEADER,
                      '"0x10","      LDS.U16 R1, [R2+0x10]","5","100","400","100"',
                      '"0x20","@!P0  HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0","7","10","1,000","1,000"',
                      '"0x30","      FFMA R1, R2, R3, R4","3","100","0","0"']) + "\n"
    with lzma.open(path, "wt") as fh:
        fh.write(text)
    rows = sw.read_rows(str(path))
    assert [sw.opcode(r["Source"]) for r in rows] == ["LDS.U16", "HGMMA.64x64x16.F32.BF16", "FFMA"]
    out = sw.summarize(rows, top=5)
    assert "shared wavefronts 1400, ideal 1100 (excess 300); stall samples 15" in out
    assert "| HGMMA.64x64x16.F32.BF16 | 1000 | 0.714 | 1000 | 10 |" in out
    assert "| 0: LDS.U16 R1, [R2+0x10] | 300 | 4.00 |" in out
    assert "FFMA" not in out.split("| instruction")[1]  # no excess, not listed


def test_the_committed_rso_profile_shows_its_v_reads_conflicted():
    """The v0.12 profile the swizzled-v change came from: 12.6M excess wavefronts, all on LDS.U16."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "h200", "profiles",
                        "forward-v0.12-rso-sass.csv.xz")
    out = sw.summarize(sw.read_rows(path), top=3)
    assert "(excess 12582912)" in out
    assert "| LDS.U16 | 16777216 | 0.304 | 4194304 | 4194304 |" in out
