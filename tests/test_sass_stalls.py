"""``benchmarks/sass_stalls.py`` (CPU): a warp-specialised kernel's stall samples split by role at its
``USETMAXREG`` instructions, the out-of-line mbarrier retry loops given to the role that jumps to them."""
import os
import sys

from helpers import load_benchmark

_DIR = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, _DIR)  # it imports sass_wavefronts
ss = load_benchmark("sass_stalls")

HEADER = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_wait"'


def _csv(tmp_path, lines):
    path = tmp_path / "k.csv"
    path.write_text("\n".join(['"Kernel Name","k",', HEADER] + lines) + "\n")
    return ss.read_rows(str(path))


def test_splits_by_role_and_gives_the_wait_loops_to_their_callers(tmp_path):
    rows = _csv(tmp_path, [
        '"0x00","      LDC R1, c[0x0][0x28]","1","10","0","1"',
        '"0x10","      USETMAXREG.DEALLOC.CTAPOOL 0x28","0","10","0","0"',
        '"0x20","@!P0  BRA 0x90","5","10","5","0"',                       # producer: to its wait loop
        '"0x30","      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa8","0","10","0","0"',
        '"0x40","      FFMA R1, R2, R3, R4","2","10","0","2"',             # value side
        '"0x50","@!P0  BRA 0xb0","3","10","3","0"',                       # value side: to its wait loop
        '"0x60","      USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa0","0","10","0","0"',
        '"0x70","      HMMA R0, R2, R4, R0","4","10","0","4"',             # state
        '"0x80","      EXIT","0","10","0","0"',
        '"0x90","@!P0  NANOSLEEP.SYNCS 0x989680","20","10","20","0"',     # the producer's retry loop
        '"0xa0","      BRA 0x20","1","10","1","0"',
        '"0xb0","@!P0  NANOSLEEP.SYNCS 0x989680","30","10","30","0"',     # the value side's
    ])
    got = {name: sum(ss.number(r, ss.SAMPLES) for r in rs) for name, rs in ss.regions(rows, ss.FUSED_BACKWARD_ROLES)}
    assert got == {"preamble": 1, "producer": 26, "value side": 35, "state": 4}
    out = ss.summarize(rows, ss.FUSED_BACKWARD_ROLES, top=1)
    assert "value side: 35 stall samples (53.0%), 40 instructions executed" in out
    assert "reasons: long_sb 94%, wait 6%" in out
    ab = ss.compare(rows, rows, ss.FUSED_BACKWARD_ROLES)
    assert "| producer | 26 | 26 | 1.000 | long_sb 26 -> 26 |" in ab


def test_the_committed_fused_backward_profile_by_role():
    """The v0.14b profile of the fused backward (16/32 4096x8): its four roles and their leading reasons, as notes
    v0.15 read them (the state warpgroup waiting on mbarriers, the gate side on short scoreboards)."""
    path = os.path.join(_DIR, "results", "h200", "profiles", "backward-v0.14b-fused-sass.csv.xz")
    parts = dict(ss.regions(ss.read_rows(path), ss.FUSED_BACKWARD_ROLES))
    assert set(parts) == {"preamble", "producer", "gate side", "value side", "state"}
    gate = ss.reasons(parts["gate side"]).most_common(1)[0][0]
    state = ss.reasons(parts["state"]).most_common(1)[0][0]
    assert (gate, state) == ("short_sb", "long_sb")
