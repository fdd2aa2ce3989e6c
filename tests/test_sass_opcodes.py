"""``benchmarks/sass_opcodes.py`` (CPU): each role's executed instructions by opcode, two kernels side by side."""
import os
import sys

import pytest

from helpers import load_benchmark

_DIR = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, _DIR)  # it imports sass_stalls and sass_wavefronts
so = load_benchmark("sass_opcodes")

HEADER = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"'
FQ_ROLES = "24=producer,144=K side,184=A side,160=state"


def _rows(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(['"Kernel Name","k",', HEADER] + lines) + "\n")
    return so.read_rows(str(path))


def test_counts_by_opcode_without_modifiers_and_sets_the_waits_apart(tmp_path):
    rows = _rows(tmp_path, "a.csv", [
        '"0x00","      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa8","0","4"',
        '"0x10","      FFMA R1, R2, R3, R4","0","10"',
        '"0x20","@P1   FFMA.FTZ R1, R2, R3, R4","0","6"',
        '"0x30","      HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24","0","2"',
        '"0x40","@!P0  SYNCS.PHASECHK.TRANS64 P0, [UR4], R3","0","30"',
        '"0x50","@!P0  BRA 0x40","0","30"',
    ])
    mix = so.opcode_mix(rows, {168: "value side"})
    assert mix["value side"] == {"USETMAXREG": 4, "FFMA": 16, "HGMMA": 2, "SYNCS": 30, "BRA": 30}
    assert so.working(mix["value side"]) == 22
    out = so.table(mix, mix, [("value side", "value side")], per=2, top=2)
    assert out.splitlines()[0] == "== value side: 41 (11 working)  |  value side: 41 (11 working)"
    assert out.splitlines()[1].split() == ["SYNCS", "15", "15", "+0"]


def test_the_committed_profiles_beside_flashqlas():
    """The fused backward beside FlashQLA's at 16/32 4096x8 (H100, notes "profile-anchor-bwd measured"): per warp
    and chunk step (256 CTAs x 4 warps x 64 steps), its value side works ~650 instructions more than FlashQLA's K
    side, and both issue the same 16 HGMMA a step on the state side."""
    prof = os.path.join(_DIR, "results", "h100", "profiles")
    ours = so.opcode_mix(so.read_rows(os.path.join(prof, "anchor-bwd-v0.33-sass-flashgdn.csv.xz")),
                         so.FUSED_BACKWARD_ROLES)
    fq = so.opcode_mix(so.read_rows(os.path.join(prof, "anchor-bwd-v0.33-sass-flashqla.csv.xz")),
                       so.parse_roles(FQ_ROLES))
    per = 256 * 4 * 64
    assert set(fq) == {"preamble", "producer", "K side", "A side", "state"}
    assert so.working(ours["value side"]) / per == pytest.approx(2333, abs=2)
    assert so.working(fq["K side"]) / per == pytest.approx(1685, abs=2)
    assert ours["state"]["HGMMA"] / per == fq["state"]["HGMMA"] / per == 16


def test_an_unknown_pair_is_refused(capsys):
    prof = os.path.join(_DIR, "results", "h100", "profiles", "anchor-bwd-v0.33-sass-flashgdn.csv.xz")
    with pytest.raises(SystemExit):
        so.main([prof, "--pair", "value side=nobody", "--other", prof])
    assert "no role named 'nobody'" in capsys.readouterr().err
