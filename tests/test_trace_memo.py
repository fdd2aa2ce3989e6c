"""The kernels traced with TileLang's rewrite memoised (``trace_memo``) are the kernels traced without it: the same
TVMScript for every serving and training variant of a head configuration, hence the same disk-cache keys. And a
memoised rewrite whose recorded evaluations no longer hold is done afresh."""
import importlib
import pkgutil

import pytest

tilelang = pytest.importorskip("tilelang", reason="the Hopper kernels need TileLang (pip install -e .[hopper])")

import flashgdn.kernels.hopper as hopper  # noqa: E402
from flashgdn.kernels.hopper import trace_memo  # noqa: E402
from flashgdn.kernels.hopper.variants import build, training_variants  # noqa: E402


@pytest.fixture
def traced(monkeypatch):
    """``trace(variants)`` -> {name: TVMScript}: each variant's program as its factory builds it, compiled by no one.
    The factories' in-memory caches are bypassed, so nothing traced here is left in them."""
    for info in pkgutil.iter_modules(hopper.__path__):
        module = importlib.import_module(f"{hopper.__name__}.{info.name}")
        for name, value in list(vars(module).items()):
            if name.startswith("build_") and hasattr(value, "__wrapped__") and hasattr(value, "cache_clear"):
                monkeypatch.setattr(module, name, value.__wrapped__)
    scripts = []
    monkeypatch.setattr(tilelang, "compile", lambda func, *args, **kwargs: scripts.append(func.script()))

    def trace(variants):
        out = {}
        for name, builder, kwargs in variants:
            build(builder, kwargs)
            out[name] = scripts.pop()
        assert not scripts
        return out

    yield trace
    trace_memo.uninstall()


def test_memoised_traces_are_the_same_programs(traced):
    if not trace_memo.install():
        pytest.skip(f"the memo is for TileLang {trace_memo.TILELANG_VERSION}, this is {tilelang.__version__}")
    variants = list(training_variants(16, 32, 128, 128, "bfloat16", "common"))
    assert len(variants) > 20
    trace_memo.uninstall()
    plain = traced(variants)

    assert trace_memo.install()
    before = dict(trace_memo.stats)
    first = traced(variants)  # fills the memo (macros shared between kernels are already reused)
    middle = dict(trace_memo.stats)
    again = traced(variants)  # every rewrite reused
    after = dict(trace_memo.stats)

    assert list(plain) == list(first) == list(again)
    for name in plain:
        assert first[name] == plain[name], f"{name}: the memoised trace differs from TileLang's own"
        assert again[name] == plain[name], f"{name}: the trace from reused rewrites differs from TileLang's own"
    assert middle["rewrites"] > before["rewrites"]
    assert after["rewrites"] == middle["rewrites"], "a rewrite was done again with nothing changed"
    assert after["reuses"] - middle["reuses"] >= len(variants), "not every kernel's prim_func was reused"


def test_a_rewrite_is_done_afresh_when_an_evaluation_it_rests_on_changes(traced):
    trace_memo.uninstall()  # an empty memo: what it holds below is these kernels' rewrites
    if not trace_memo.install():
        pytest.skip(f"the memo is for TileLang {trace_memo.TILELANG_VERSION}, this is {tilelang.__version__}")
    variants = list(training_variants(2, 4, 128, 128, "bfloat16", "common"))[:3]
    plain = traced(variants)
    recorded = [entry for entry in trace_memo._memo.values() if entry[1]]
    assert recorded, "no rewrite recorded an evaluation (the kernel launch's `with T.Kernel` is one)"
    # what a changed closure value would look like: every recorded evaluation now answers otherwise
    for key, (make_closure, evaluated, hints, source) in list(trace_memo._memo.items()):
        trace_memo._memo[key] = (make_closure, [(text, object()) for text, _ in evaluated], hints, source)
    before = dict(trace_memo.stats)
    again = traced(variants)
    assert trace_memo.stats["rewrites"] - before["rewrites"] >= len(recorded)
    assert again == plain


def test_off_by_environment(monkeypatch):
    trace_memo.uninstall()
    monkeypatch.setenv("FLASHGDN_TRACE_MEMO", "0")
    assert trace_memo.install() is False
    from tilelang.language.eager import ast as tl_ast

    assert tl_ast.mutate is not trace_memo._memo_mutate
