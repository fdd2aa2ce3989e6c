"""``benchmarks/sass_static.py`` (CPU): each role's step read from the SASS, and the step's bounds."""
import os
import sys

import pytest

from helpers import load_benchmark

_DIR = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
sys.path.insert(0, _DIR)  # it imports sass_stalls
ss = load_benchmark("sass_static")

# nvdisasm -c's layout: a producer (24 registers) whose step is one TMA load, and a consumer (240) whose step waits
# on an mbarrier (its retry loop out of line after the last role), runs two HGMMAs, three shared loads, an inner loop
# of 8 trips, and a store that only some steps make
SASS = """
	.section	.text.k,"ax",@progbits
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x80, PT ;
        /*0020*/              @!P0 BRA `(.L_x_0) ;
        /*0030*/                   USETMAXREG.DEALLOC.CTAPOOL 0x18 ;
        /*0040*/                   MOV R1, RZ ;
.L_x_1:
        /*0050*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0060*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0070*/                   ISETP.NE.AND P1, PT, R1, UR5, PT ;
        /*0080*/               @P1 BRA `(.L_x_1) ;
        /*0090*/                   EXIT ;
.L_x_0:
        /*00a0*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;
        /*00b0*/                   MOV R2, RZ ;
        /*00c0*/                   MOV R3, RZ ;
.L_x_2:
        /*00d0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R3], R4 ;
        /*00e0*/              @!P2 BRA `(.L_x_9) ;
.L_x_3:
        /*00f0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0100*/                   HGMMA.64x64x16.F32.BF16 R88, R152, gdesc[UR8], R88 ;
        /*0110*/                   LDS.128 R8, [R5] ;
        /*0120*/                   LDS.U16 R9, [R5+0x2] ;
        /*0130*/                   LDSM.16.M88.4 R12, [R6] ;
        /*0140*/                   MOV R7, RZ ;
.L_x_4:
        /*0150*/                   MUFU.EX2 R10, R10 ;
        /*0160*/                   FFMA R11, R10, R10, R11 ;
        /*0170*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0180*/                   ISETP.NE.AND P3, PT, R7, 0x8, PT ;
        /*0190*/               @P3 BRA `(.L_x_4) ;
        /*01a0*/                   ISETP.NE.AND P4, PT, R0, RZ, PT ;
        /*01b0*/               @P4 BRA `(.L_x_5) ;
        /*01c0*/                   STS [R5], R11 ;
.L_x_5:
        /*01d0*/                   IADD3 R2, R2, 0x1, RZ ;
        /*01e0*/                   ISETP.NE.AND P5, PT, R2, UR6, PT ;
        /*01f0*/               @P5 BRA `(.L_x_2) ;
        /*0200*/                   EXIT ;
.L_x_9:
        /*0210*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R3], R4 ;
        /*0220*/              @!P2 BRA `(.L_x_9) ;
        /*0230*/                   BRA `(.L_x_3) ;
.L_x_10:
        /*0240*/                   BRA `(.L_x_10) ;
.L_x_11:
"""
ROLES = {24: "producer", 240: "consumer"}


def _steps(trips=None):
    return {name: (graph, loop, count) for name, graph, loop, count in
            ss.role_steps(ss.parse_sass(SASS), ROLES, trips or {})}


def test_labels_become_addresses_and_roles_split_at_setmaxnreg():
    code = ss.parse_sass(SASS)
    assert code[2].text == "@!P0 BRA 0xa0" and code[2].target == 0xA0
    roles = dict(ss.split_roles(code, ROLES))
    assert list(roles) == ["producer", "consumer"]  # the preamble left out
    assert [i.address for i in roles["producer"]] == list(range(0x30, 0xA0, 0x10))
    # the out-of-line retry loop and the trap after the last role's EXIT go to the role that jumps there
    assert {0x210, 0x220, 0x230, 0x240} <= {i.address for i in roles["consumer"]}


def test_repeated_register_counts_take_the_next_name():
    text = SASS.replace("USETMAXREG.DEALLOC.CTAPOOL 0x18", "USETMAXREG.DEALLOC.CTAPOOL 0xf0")
    names = [n for n, _ in ss.split_roles(ss.parse_sass(text), {240: "state path 1|state path 0"})]
    assert names == ["state path 1", "state path 0"]
    names = [n for n, _ in ss.split_roles(ss.parse_sass(text), {240: "path"})]
    assert names == ["path", "path#2"]


def test_the_step_counts_inner_loops_by_their_trips_and_leaves_waits_out():
    steps = _steps()
    graph, loop, count = steps["consumer"]
    assert graph.blocks[loop.header][0].address == 0xD0
    inner = [l for l in graph.loops if l.parent is loop and not l.wait]
    assert len(inner) == 1 and inner[0].trips == 8 and inner[0].trips_from == "read"
    assert any(l.wait for l in graph.loops)  # the retry loop
    # every step: wait + branch (2), two HGMMAs, three shared loads and a MOV (6), the inner loop 8 x 5, the test of
    # the store (2) and the latch (3)
    assert count.issued == 2 + 6 + 40 + 2 + 3
    assert count.classes["tensor"] == 2 and count.classes["shared"] == 3 and count.classes["mufu"] == 8
    assert count.mufu == 8
    # the store some steps make, and the branch back from the retry loop, are conditional
    assert sum(count.conditional.values()) == 2 and count.conditional["shared"] == 1
    assert count.waits == 2  # the retry loop's two instructions
    # 64x128x16: a warp's 16 rows x 128 x 16 at 512 a cycle, 64; 64x64x16, 32
    assert count.tensor_cycles == 96
    # shared A and B of the first (2 x 16 x (64 + 128)), B of the second (2 x 16 x 64)
    assert count.operand_bytes == 6144 + 2048
    assert count.shared_wavefronts == 4 + 1 + 4
    _, _, producer = steps["producer"]
    assert producer.issued == 4 and producer.classes["global"] == 1


def test_given_trips_override_and_unknown_trips_are_flagged():
    graph, loop, count = _steps({0x150: 2})["consumer"]
    assert count.issued == 2 + 6 + 10 + 2 + 3
    text = SASS.replace("ISETP.NE.AND P3, PT, R7, 0x8, PT", "ISETP.NE.AND P3, PT, R7, UR9, PT")
    steps = {n: c for n, _, _, c in ss.role_steps(ss.parse_sass(text), ROLES, {})}
    assert steps["consumer"].unknown_trips == ["0x150"] and steps["consumer"].issued == 2 + 6 + 5 + 2 + 3


def test_bounds_and_report():
    steps = ss.role_steps(ss.parse_sass(SASS), ROLES, {})
    b = ss.bounds(steps, {})
    assert b["issue"] == 53 + 4
    assert b["tensor"] == 96 and b["mufu"] == 8 * ss.MUFU_CYCLES
    assert b["shared"] == 9 * 4  # four warps of the consumer
    assert b["operands"] == (6144 + 2048) / 128  # one read a warpgroup
    text = ss.report(steps, {}, chunk_cycles=570)
    assert "consumer: step loop at 0xd0" in text and "loop at 0x150: 5 instructions a trip, 8 trips (read)" in text
    assert "issue 10%" in text
    assert "consumer: step loop at 0xd0, 4 warps; local-memory (spill) instructions: 0 in the step, 0 outside" in text
    spilled = ss.role_steps(ss.parse_sass(SASS.replace("LDS.U16 R9, [R5+0x2]", "STL [R1], R9")), ROLES, {})
    assert "1 in the step, 0 outside" in ss.report(spilled, {})


def test_shared_wavefronts_by_width():
    wf = lambda t: ss.shared_wavefronts(ss.Instruction(0, t))  # noqa: E731
    assert wf("LDS.128 R8, [R5]") == 4 and wf("LDS.64 R8, [R5]") == 2 and wf("LDS R8, [R5]") == 1
    assert wf("STS.U16 [R5], R8") == 1 and wf("LDSM.16.MT88.4 R8, [R5]") == 4 and wf("STSM.16.M88.2 [R5], R8") == 2
    assert wf("FFMA R1, R2, R3, R4") == 0


@pytest.mark.slow
def test_a_fused_loop_build_read_from_its_sass():
    """The state_p build of the fused loop at 2/2 (compiled for sm_90a here): four roles, each with its step, and each
    state path's tensor cycles those of its GEMMs a chunk (S^T K^T and S^T Q^T 8 x 64x64x16 each, its half of Q K^T
    8 x 64x32x16, Vn^T, O^T's update 4 x 64x64x16 each, S^T's 4 x 64x128x16: 1152)."""
    pytest.importorskip("tilelang")
    try:
        nvdisasm = ss.find_nvdisasm()
    except SystemExit:
        pytest.skip("nvdisasm is not installed (`pip install -e .[bench]` brings it)")
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cubin = ss.variant_cubin("chunk_forward_fused_state_p[2/2,bfloat16,h0=1,ht=1,v_first=0]", tmp)
        text = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    steps = ss.role_steps(ss.parse_sass(text), ss.FORWARD_ROLES, {})
    assert [n for n, *_ in steps] == ["producer", "gate", "state path 1", "state path 0"]
    counts = {n: c for n, _, _, c in steps}
    assert all(c is not None for c in counts.values())
    assert counts["state path 0"].tensor_cycles == counts["state path 1"].tensor_cycles == 1152
    assert counts["gate"].mufu > 0 and counts["state path 0"].mufu > 0  # Ag's gating, P's


def test_static_counts_agree_with_a_profile_of_the_same_sass():
    """Nsight Compute's source page of the fused backward (``results/h100/profiles/anchor-bwd-v0.33-*``, an H100):
    read as SASS, each role's step as counted here against the warp instructions it executed. The code that runs
    every step ran once a warp-step (times its trips in the gate side's inner loop of 8), and what a warp-step
    executed lies between the static count every step and with the conditional code."""
    from sass_wavefronts import number, read_rows

    rows = read_rows(os.path.join(_DIR, "results", "h100", "profiles", "anchor-bwd-v0.33-sass-flashgdn.csv.xz"))
    roles = {160: "state", 168: "value side", 144: "gate side", 40: "producer"}
    steps = ss.role_steps(ss.instructions_from_rows(rows), roles, {})
    executed = {int(r["Address"], 16): number(r, "Instructions Executed") for r in rows}
    lines = ss.check_executed(steps, executed)
    counts = {name: (loop, count) for name, _, loop, count in steps}
    assert [l for l in counts["gate side"][0].children if not l.wait][0].trips == 8
    for name in ("state", "value side", "gate side"):
        line = next(l for l in lines if l.startswith(name + ":"))
        per_step = float(line.split("executed ")[1].split(" ")[0])
        _, count = counts[name]
        assert count.issued <= per_step <= count.issued + sum(count.conditional.values()), line
        off = int(line.split("; ")[-1].split(" ")[0])
        assert off <= 1, line  # the gate side's one: a BSYNC its convergence passes twice


def test_an_ncu_file_of_several_kernels_is_split_by_kernel(tmp_path):
    head = '"Address","Source","Instructions Executed"'
    path = tmp_path / "two.csv"
    path.write_text("\n".join([
        '"Kernel Name","prep_kernel",', head, '"0x10","      EXIT","4"',
        '"Kernel Name","main_kernel",', head, '"0x20","      FFMA R1, R2, R3, R4","80"', '"0x30","      EXIT","8"',
    ]) + "\n")
    kernels = ss.ncu_kernels(str(path))
    assert [n for n, _ in kernels] == ["prep_kernel", "main_kernel"]
    assert [r["Address"] for r in kernels[1][1]] == ["0x20", "0x30"]
    code = ss.instructions_from_rows(kernels[1][1])
    assert code[0].address == 0x20 and code[0].opcode == "FFMA"


def test_shared_wavefronts_with_the_wgmma_operands_are_what_a_profile_counts():
    """The rso loop's profile of v0.20 (``results/h200/profiles/forward-v0.20-rso-1wave-*``, an H200): Nsight
    Compute's shared wavefronts a chunk (loads, stores and the HGMMAs' operand reads, no bank conflicts there) are the
    static count of the loads and stores plus the operands' bytes over 128, and each role's executed instructions a
    warp-step lie between its static counts."""
    from sass_wavefronts import number

    path = os.path.join(_DIR, "results", "h200", "profiles", "forward-v0.20-rso-1wave-sass.csv.xz")
    (name, rows), = ss.ncu_kernels(path)
    assert "chunk_forward_rso" in name
    steps = ss.role_steps(ss.instructions_from_rows(rows), ss.default_roles(name), {})
    assert [n for n, *_ in steps] == ["producer", "output", "state path 1", "state path 0"]
    executed = {int(r["Address"], 16): number(r, "Instructions Executed") for r in rows}
    graph, loop, _ = next((g, l, c) for n, g, l, c in steps if n == "state path 0")
    chunks = executed[graph.blocks[loop.header][0].address] / 4  # CTAs x chunks: the step's warp-steps over 4 warps
    measured = sum(number(r, "L1 Wavefronts Shared") for r in rows) / chunks
    b = ss.bounds(steps, {})
    assert abs(b["shared"] + b["operands"] - measured) < 0.01 * measured, (b, measured)
    for line in ss.check_executed(steps, executed):
        if line.startswith(("output", "state path")):
            per_step = float(line.split("executed ")[1].split(" ")[0])
            role = line.split(":")[0]
            count = next(c for n, _, _, c in steps if n == role)
            assert count.issued <= per_step <= count.issued + sum(count.conditional.values()), line
