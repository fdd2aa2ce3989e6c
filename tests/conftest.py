"""Shared pytest wiring: GPU tests (marker ``gpu``) skip in a normal run without a GPU, and fail instead of
skipping when the GPU suite was asked for (``-m gpu``) on a machine that has none."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

# tests import their helpers as a plain module
sys.path.insert(0, os.path.dirname(__file__))


def gpu_suite_requested(config) -> bool:
    """True when the mark expression selects gpu tests (``-m gpu``, ``-m "gpu and slow"``, not ``-m "not gpu"``)."""
    expr = config.option.markexpr or ""
    return bool(re.search(r"\bgpu\b", expr)) and not re.search(r"\bnot\s+gpu\b", expr)


def _require_cuda(config) -> None:
    if torch.cuda.is_available():
        return
    if gpu_suite_requested(config):
        pytest.fail("the GPU suite was requested (-m gpu) but torch sees no CUDA device", pytrace=False)
    pytest.skip("needs a CUDA GPU (run the GPU suite with -m gpu on the GPU machine)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        _require_cuda(item.config)


@pytest.fixture
def cuda(request) -> torch.device:
    """The CUDA device; skips without a GPU, or fails when the GPU suite was requested."""
    _require_cuda(request.config)
    return torch.device("cuda")


def _forced_tilelang_cache_dir():
    """TileLang's cache directory where forced by assignment (``tilelang.env.TILELANG_CACHE_DIR = ...``): such a
    value outlives the test, since monkeypatch restores an attribute by assigning the old value, which forces it
    too, and later tests' kernels would then land in that test's tmp dir."""
    mod = sys.modules.get("tilelang.env")
    env = getattr(mod, "env", None)
    return getattr(vars(type(env)).get("TILELANG_CACHE_DIR"), "_forced_value", None) if env is not None else None


@pytest.fixture(autouse=True)
def _cache_dir_left_as_found():
    before = _forced_tilelang_cache_dir()
    yield
    after = _forced_tilelang_cache_dir()
    assert after == before, (f"the test left TileLang's cache directory forced to {after!r} (set the environment "
                             "variable instead: monkeypatch.setenv)")
