"""``flashgdn.preload`` and the kernel factories' cache (CPU): one cache entry however a factory's arguments are
spelled, so that what ``preload`` builds from ``variants.py``'s lists is what the operator's calls find; and ``preload``
builds exactly the serving or training list of each head configuration, with clear errors on bad arguments."""
import pytest
import torch

import flashgdn
from flashgdn.kernels.hopper.common import kernel_cache, kernels_in_memory


def test_kernel_cache_keys_by_the_bound_arguments():
    calls = []

    @kernel_cache
    def build_thing(Hqk: int, Hv: int, K: int = 128, flag: bool = False):
        calls.append((Hqk, Hv, K, flag))
        return object()

    a = build_thing(2, 8)
    assert build_thing(2, 8, 128) is a
    assert build_thing(Hqk=2, Hv=8, flag=False) is a
    assert build_thing(2, Hv=8, K=128, flag=False) is a
    b = build_thing(2, 8, flag=True)
    assert b is not a and build_thing(Hv=8, Hqk=2, flag=True) is b
    assert calls == [(2, 8, 128, False), (2, 8, 128, True)]
    assert build_thing.cache_info().misses == 2 and build_thing.cache_info().hits == 4
    # a spelling seen before is found as it was written, without binding the signature again
    assert build_thing(2, 8) is a and build_thing(Hqk=2, Hv=8, flag=False) is a
    assert build_thing.cache_info().hits == 4 and calls == [(2, 8, 128, False), (2, 8, 128, True)]
    with pytest.raises(TypeError):
        build_thing(2, 8, bogus=1)  # a misspelt argument still fails, as it did without the cache
    build_thing.cache_clear()
    assert build_thing(2, 8) is not a


def test_every_kernel_factory_is_cached_by_its_bound_arguments():
    from flashgdn.kernels.hopper.kkt_inverse import build_kkt_inverse
    from flashgdn.kernels.hopper.splice import build_splice

    for factory in (build_kkt_inverse, build_splice):
        assert hasattr(factory, "cache_info") and factory.__wrapped__.__name__ == factory.__name__


def _record_builds(monkeypatch):
    built = []
    import flashgdn.kernels.hopper.variants as variants

    monkeypatch.setattr(variants, "build", lambda builder, kwargs: built.append((builder, kwargs)))
    return built


def test_preload_builds_the_serving_or_training_list_of_each_head_configuration(monkeypatch):
    from flashgdn.kernels.hopper.variants import serving_variants, training_variants

    built = _record_builds(monkeypatch)
    n = flashgdn.preload([(2, 8), (4, 4)], dtype=torch.bfloat16, training=False, flags="common")
    want = [(b, kw) for h in ((2, 8), (4, 4)) for _, b, kw in serving_variants(*h, 128, 128, "bfloat16", "common")]
    assert n == len(want) and built == want
    built.clear()
    n = flashgdn.preload("16/32", dtype="float16")
    want = [(b, kw) for _, b, kw in training_variants(16, 32, 128, 128, "float16", "all")]
    assert n == len(want) and built == want
    assert any(b == "fused_backward" or b == "chunk_grad" for b, _ in built)  # the backward's kernels are in it


@pytest.mark.parametrize("kwargs, message", [
    (dict(heads="16-32"), "heads: expected HQK/HV"),
    (dict(heads=[(16, 24)]), "heads: 16/24 needs positive counts"),
    (dict(heads=[(2, 8), (0, 4)]), "heads: 0/4 needs positive counts"),  # nothing built for the good one first
    (dict(heads=[(2, 8)], dtype=torch.float32), "dtype: expected bfloat16 or float16"),
    (dict(heads=[(2, 8)], flags="some"), "flags: expected 'all' or 'common'"),
])
def test_preload_rejects_bad_arguments(monkeypatch, kwargs, message):
    built = _record_builds(monkeypatch)
    with pytest.raises(ValueError, match=message):
        flashgdn.preload(**kwargs)
    assert built == []


def test_kernels_in_memory_counts_what_tilelang_holds():
    pytest.importorskip("tilelang")
    from tilelang.cache import _dispatch_map

    before = kernels_in_memory()
    assert isinstance(before, int) and before >= 0
    cache = next(iter(_dispatch_map.values()))
    cache._memory_cache["flashgdn-test-key"] = object()
    try:
        assert kernels_in_memory() == before + 1
    finally:
        del cache._memory_cache["flashgdn-test-key"]
    assert kernels_in_memory() == before
