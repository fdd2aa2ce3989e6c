"""benchmarks/training_loop.py: its shapes, its batches and its report (CPU; the loop itself needs a GPU)."""
import pytest

from helpers import load_benchmark

tl = load_benchmark("training_loop")


def test_shapes_are_read_or_refused_by_name():
    assert tl.parse_loop_shape("16/32:32768/8") == (16, 32, 32768, 8)
    for bad in ("16/32:32768", "16/32", "16/33:8192/2", "2/4:4/8", "0/4:8192/1"):
        with pytest.raises(ValueError, match="--shape"):
            tl.parse_loop_shape(bad)


def test_fresh_batches_change_every_step_and_fixed_ones_never():
    fresh = [tl.step_split(32768, 8, "fresh", i) for i in range(5)]
    assert all(sum(s) == 32768 and len(s) == 8 for s in fresh)
    assert len(set(fresh)) == 5
    assert fresh == [tl.step_split(32768, 8, "fresh", i) for i in range(5)]  # the same for every implementation
    fixed = {tl.step_split(32768, 8, "fixed", i) for i in range(-2, 5)}
    assert fixed == {fresh[0]}  # warm-up included
    # fresh warm-up steps have splits of their own
    assert tl.step_split(32768, 8, "fresh", -1) not in fresh


def test_the_report_gives_each_implementation_against_flashgdn():
    def rec(impl, median, note="", loads=(0, 0, 0), **extra):
        return dict(impl=impl, h_qk=2, h_v=4, tokens=8192, sequences=4, batches="fresh", median_ms=median,
                    mean_ms=median, max_ms=2e3, slow_steps=1, step_ms=[median] * 3, warmup_ms=[900.0], note=note,
                    step_loads=list(loads), **extra)

    text = tl.report([rec("flashgdn", 2.0, loads=(0, 0, 7), preload_ms=4321.0),
                      rec("flashqla", 5.0, "stopped by the budget")])
    assert "| 2/4 8192/4 | fresh | flashqla | 5.000 | 5.000 | 2000.0 | 1 of 3 | none | 900 | 2.50x | stopped" in text
    assert "| flashgdn | 2.000 |" in text and "| step 2: 7 | 900 (preload 4321) | 1.00x |" in text
    assert "| - |" in tl.report([rec("flashgdn", 2.0, loads=(None, None, None))])  # not counted: no TileLang


def test_without_a_gpu_it_says_so():
    if tl.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert tl.main(["--steps", "1"]) == 2


def test_a_loop_of_the_reference_runs_every_step_on_its_own_batch():
    from flashgdn.bench.impls import one_impl

    impl = one_impl("flashgdn:reference")
    assert impl.missing_reason(tl.torch.device("cpu")) is None
    rec = tl.run_loop(impl, 1, 2, 130, 3, "fresh", steps=3, warmup=1, budget_s=60.0, mode="fwdbwd",
                      device=tl.torch.device("cpu"))
    assert len(rec["step_ms"]) == 3 and len(rec["warmup_ms"]) == 1 and rec["note"] == ""
    assert rec["median_ms"] > 0 and rec["slow_steps"] <= 3 and rec["max_ms"] == max(rec["step_ms"])
    # the reference loads no TileLang kernel (or there is no TileLang to count with)
    assert len(rec["step_loads"]) == 3 and all(x in (0, None) for x in rec["step_loads"])
    assert rec["steps_loading"] == 0 and "preload_ms" not in rec
    # a budget spent after the first step stops the loop there, and says so
    rec = tl.run_loop(impl, 1, 2, 130, 3, "fixed", steps=3, warmup=1, budget_s=0.0, mode="fwd",
                      device=tl.torch.device("cpu"))
    assert len(rec["step_ms"]) == 1 and "stopped by the budget" in rec["note"]


def test_a_host_profile_of_the_reference_names_its_functions():
    from flashgdn.bench.impls import one_impl

    impl = one_impl("flashgdn:reference")
    assert impl.missing_reason(tl.torch.device("cpu")) is None  # (loads it, as main does)
    text = tl.host_profile(impl, 1, 2, 130, 3, "fwdbwd", tl.torch.device("cpu"), steps=2, top=10)
    assert text.startswith("# flashgdn") and "2 steps under cProfile" in text
    assert "cumulative" in text and "chunk_gated_delta_rule" in text
