"""``benchmarks/rso_trace.py`` (CPU): the rso loop's trace summarised as medians counted from state path 0's start of
each chunk, with the stamps' layout and point names of the kernel's trace build."""
from helpers import load_benchmark

rt = load_benchmark("rso_trace")


def test_a_trace_is_summarised_per_role_and_point():
    from flashgdn.kernels.hopper.chunk_forward_rso import TRACE_CHUNKS, TRACE_POINTS, TRACE_POINTS_OF

    assert len(TRACE_POINTS_OF) == len(rt.ROLES) == 4 and all(0 < len(p) <= TRACE_POINTS for p in TRACE_POINTS_OF)
    # chunks of 2000 cycles from 9000; state path 0 reaches point p at +40 p, the output path at +500 + 90 p (+11 on
    # odd chunks: chunks 2 .. 30 are summarised, 15 even and 14 odd, so the median is the even chunks' value); the
    # decay warp wrote only point 0, state path 1 nothing
    stamps = [[[0] * TRACE_POINTS for _ in range(TRACE_CHUNKS)] for _ in range(4)]
    for c in range(TRACE_CHUNKS):
        base = 9000 + 2000 * c
        for p in range(len(TRACE_POINTS_OF[0])):
            stamps[0][c][p] = base + 40 * p
        for p in range(len(TRACE_POINTS_OF[2])):
            stamps[2][c][p] = base + 500 + 90 * p + (11 if c % 2 else 0)
        stamps[3][c][0] = base - 30
    s = rt.summarize(stamps, TRACE_POINTS_OF)
    assert s["chunk_cycles"] == 2000
    assert [off for _, off in s["roles"]["state path 0"]] == [40 * p for p in range(len(TRACE_POINTS_OF[0]))]
    assert [off for _, off in s["roles"]["output path"]] == [500 + 90 * p for p in range(len(TRACE_POINTS_OF[2]))]
    assert s["roles"]["decay warp"][0] == (TRACE_POINTS_OF[3][0], -30)
    assert all(off is None for _, off in s["roles"]["decay warp"][1:])
    assert all(off is None for _, off in s["roles"]["state path 1"])


def test_a_trace_without_stamps_has_no_chunk_length():
    from flashgdn.kernels.hopper.chunk_forward_rso import TRACE_CHUNKS, TRACE_POINTS, TRACE_POINTS_OF

    stamps = [[[0] * TRACE_POINTS for _ in range(TRACE_CHUNKS)] for _ in range(4)]
    s = rt.summarize(stamps, TRACE_POINTS_OF)
    assert s["chunk_cycles"] is None
    assert all(off is None for rows in s["roles"].values() for _, off in rows)
