"""``benchmarks/fused_backward_trace.py`` (CPU): a trace of per-phase cycle stamps summarised as medians counted from
the value side's start of each chunk step, with the stamps' layout and point names of the kernel's trace build."""
from helpers import load_benchmark

ft = load_benchmark("fused_backward_trace")


def test_a_trace_is_summarised_per_role_and_point():
    from flashgdn.kernels.hopper.fused_backward import TRACE_CHUNKS, TRACE_POINTS, TRACE_POINTS_OF

    assert len(TRACE_POINTS_OF) == 4 and all(0 < len(p) <= TRACE_POINTS for p in TRACE_POINTS_OF)
    # steps of 1000 cycles from 5000; the value side reaches point p at +50 p, the gate side at +30 p (+7 on odd
    # steps: steps 2 .. 30 are summarised, 15 even and 14 odd, so the median is the even steps' value); the state
    # side wrote only point 0; the producer nothing
    stamps = [[[0] * TRACE_POINTS for _ in range(TRACE_CHUNKS)] for _ in range(4)]
    for c in range(TRACE_CHUNKS):
        base = 5000 + 1000 * c
        stamps[0][c][0] = base - 20
        for p in range(len(TRACE_POINTS_OF[1])):
            stamps[1][c][p] = base + 50 * p
        for p in range(len(TRACE_POINTS_OF[2])):
            stamps[2][c][p] = base + 30 * p + (7 if c % 2 else 0)
    s = ft.summarize(stamps, TRACE_POINTS_OF)
    assert s["step_cycles"] == 1000
    assert [off for _, off in s["roles"]["value side"]] == [50 * p for p in range(len(TRACE_POINTS_OF[1]))]
    assert [off for _, off in s["roles"]["gate side"]] == [30 * p for p in range(len(TRACE_POINTS_OF[2]))]
    assert s["roles"]["state"][0] == (TRACE_POINTS_OF[0][0], -20)
    assert all(off is None for _, off in s["roles"]["state"][1:])
    assert all(off is None for _, off in s["roles"]["producer"])


def test_the_ctas_edges_are_read_from_step_zeros_last_points():
    from flashgdn.kernels.hopper.fused_backward import TRACE_CHUNKS, TRACE_EDGES, TRACE_POINTS, TRACE_POINTS_OF

    # the edges sit past every role's per-step points
    assert all(len(p) <= TRACE_POINTS - len(TRACE_EDGES) for p in TRACE_POINTS_OF)
    stamps = [[[0] * TRACE_POINTS for _ in range(TRACE_CHUNKS)] for _ in range(4)]
    assert ft.edges_of(stamps, TRACE_POINTS, TRACE_EDGES) == []
    for e in range(len(TRACE_EDGES)):
        stamps[0][0][TRACE_POINTS - len(TRACE_EDGES) + e] = 1000 + 700 * e
    assert ft.edges_of(stamps, TRACE_POINTS, TRACE_EDGES) == [(d, 700 * e) for e, d in enumerate(TRACE_EDGES)]


def test_option_arguments_of_the_trace_and_the_options_benchmark(monkeypatch):
    """``--options`` of the trace (default: the switches' build, none, or names) and ``fused_backward_options.py``'s
    shapes and option sets (``default+`` adds names to the build the switches give for the shape's head count)."""
    from flashgdn.kernels.hopper import backward

    fo = load_benchmark("fused_backward_options")

    assert ft.parse_options("default") is None
    assert ft.parse_options("none") == {}
    assert ft.parse_options("p_first,lean_gates") == {"p_first": True, "lean_gates": True}
    assert fo.parse_shape("16/32:4096x8") == (16, 32, [4096] * 8)
    assert fo.parse_shape("2/8:700,64,9") == (2, 8, [700, 64, 9])
    monkeypatch.setattr(backward, "FUSED_P_FIRST", "auto")
    monkeypatch.setattr(backward, "FUSED_LEAN_GATES", "auto")
    monkeypatch.setattr(backward, "FUSED_P_GIVEN", "auto")
    monkeypatch.setattr(backward, "FUSED_FOLD_MMA", "auto")
    # from FUSED_P_GIVEN_MIN_HV value heads the default build is given P, and with pair sums (groups of two and four)
    # the gate side folds by the tensor cores beside it (in other groups it folds element-wise); below, the value
    # side folds by them
    assert fo.set_options("default", 32) == {"p_given": True}
    assert fo.set_options("default", 32, 2) == {"pair_sums": True, "p_given": True, "fold_mma": True}
    assert fo.set_options("default", 32, 4) == {"pair_sums": True, "p_given": True, "fold_mma": True}
    assert fo.set_options("default", 48, 6) == {"p_given": True}
    assert fo.set_options("default", 16) == {"p_first": True, "lean_gates": True, "fold_mma": True}
    # without P given the gate side makes it, so the gate-side options come with it at any head count (the build
    # without them is serialised by ptxas)
    monkeypatch.setattr(backward, "FUSED_P_GIVEN", False)
    assert fo.set_options("default", 32) == {"p_first": True, "lean_gates": True, "fold_mma": True}
    # not beside cluster_sum when the switch asks for it
    monkeypatch.setattr(backward, "FUSED_CLUSTER_SUM", True)
    assert backward.fused_backward_options(32, 2) == {"cluster_sum": True, "p_first": True, "lean_gates": True}
    monkeypatch.setattr(backward, "FUSED_CLUSTER_SUM", False)
    # forced on, beside p_given too, and beside cluster_sum
    monkeypatch.setattr(backward, "FUSED_FOLD_MMA", True)
    monkeypatch.setattr(backward, "FUSED_P_GIVEN", "auto")
    assert backward.fused_backward_options(32, 2) == {"pair_sums": True, "p_given": True, "fold_mma": True}
    monkeypatch.setattr(backward, "FUSED_CLUSTER_SUM", True)
    assert backward.fused_backward_options(32, 2) == {"cluster_sum": True, "p_first": True, "lean_gates": True,
                                                      "fold_mma": True}
    monkeypatch.setattr(backward, "FUSED_CLUSTER_SUM", False)
    monkeypatch.setattr(backward, "FUSED_P_GIVEN", False)
    monkeypatch.setattr(backward, "FUSED_FOLD_MMA", False)
    # where P is not given the default build has both options, where it is given neither
    assert fo.set_options("default", 8) == {"p_first": True, "lean_gates": True}
    assert fo.set_options("default", 32) == {"p_first": True, "lean_gates": True}
    assert fo.set_options("none", 8) == {}
    assert fo.set_options("lean_gates", 32) == {"lean_gates": True}
    monkeypatch.setattr(backward, "FUSED_P_GIVEN", "auto")
    assert fo.set_options("default", 24) == {"p_first": True, "lean_gates": True}
    assert fo.set_options("default", 32) == {"p_given": True}
    assert fo.set_options("default+p_first", 32) == {"p_given": True, "p_first": True}
    monkeypatch.setattr(backward, "FUSED_P_GIVEN", False)
    # cluster_sum by name, or by the switch for a group of two to eight
    monkeypatch.setattr(backward, "FUSED_PAIR_SUMS", "auto")
    assert fo.set_options("default+cluster_sum", 32, 2) == {"cluster_sum": True, "p_first": True, "lean_gates": True}
    # pair_sums by the switch: on its own ("auto") for groups of two and four
    assert fo.set_options("default", 32, 2) == {"pair_sums": True, "p_first": True, "lean_gates": True}
    assert fo.set_options("default", 32, 4) == {"pair_sums": True, "p_first": True, "lean_gates": True}
    assert fo.set_options("default", 48, 6) == {"p_first": True, "lean_gates": True}
    monkeypatch.setattr(backward, "FUSED_CLUSTER_SUM", True)
    assert fo.set_options("default", 8, 4) == {"p_first": True, "lean_gates": True, "cluster_sum": True}
    assert fo.set_options("default", 8, 1) == {"p_first": True, "lean_gates": True}
    # the per-value-head dq and dk of the other builds, summed as a cluster_sum build writes them
    import torch

    x = torch.tensor([1.0, 2.0 ** -9, 2.0 ** -9, 3.0]).to(torch.bfloat16).reshape(1, 1, 4, 1)
    got = fo.summed([None, x, x, None], 1)
    assert got[1].shape == (1, 1, 1, 1) and got[1].item() == 4.0  # ((1 + 2^-9) + 2^-9) + 3 in float32, then bf16
    assert fo.summed([None, x, x, None], 4)[1] is x
