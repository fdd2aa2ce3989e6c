"""``benchmarks/fused_trace.py`` (CPU): the fused loop's trace summarised as medians counted from state path 0's start
of each chunk, with the stamps' layout and point names of the kernel's trace build (the gate's inverse phases left
unwritten, as the substitution's build leaves them)."""
from helpers import load_benchmark

ft = load_benchmark("fused_trace")


def test_a_trace_is_summarised_per_role_and_point():
    from flashgdn.kernels.hopper.chunk_forward_rs import TRACE_CHUNKS, TRACE_POINTS, TRACE_POINTS_OF

    assert len(TRACE_POINTS_OF) == len(ft.ROLES) == 3 and all(0 < len(p) <= TRACE_POINTS for p in TRACE_POINTS_OF)
    assert len(TRACE_POINTS_OF[2]) == TRACE_POINTS
    # chunks of 9000 cycles from 1000; state path 0 reaches point p at +100 p, the gate at -3000 + 700 p (one chunk
    # ahead), its points 3-6 never written; state path 1 nothing
    stamps = [[[0] * TRACE_POINTS for _ in range(TRACE_CHUNKS)] for _ in range(3)]
    for c in range(TRACE_CHUNKS):
        base = 1000 + 9000 * c
        for p in range(len(TRACE_POINTS_OF[0])):
            stamps[0][c][p] = base + 100 * p
        for p in (0, 1, 2, 7, 8, 9):
            stamps[2][c][p] = base - 3000 + 700 * p
    s = ft.summarize(stamps, TRACE_POINTS_OF)
    assert s["chunk_cycles"] == 9000
    assert [off for _, off in s["roles"]["state path 0"]] == [100 * p for p in range(len(TRACE_POINTS_OF[0]))]
    assert [off for _, off in s["roles"]["gate path"]] == [
        None if 3 <= p <= 6 else -3000 + 700 * p for p in range(TRACE_POINTS)]
    assert all(off is None for _, off in s["roles"]["state path 1"])
