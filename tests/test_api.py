"""The public op's contract (signature, dtypes, outputs, autograd) and backend dispatch."""
import inspect
import types
import warnings

import pytest
import torch

import flashgdn
from flashgdn import chunk_gated_delta_rule
from flashgdn.api import dispatch
from flashgdn.api.backend import Backend, _INSTANCES, _REGISTRY, backend_names
from helpers import assert_same_computation, make_inputs, oracle, rel_rms


def test_signature():
    params = list(inspect.signature(flashgdn.chunk_gated_delta_rule).parameters.items())
    assert [(n, p.default) for n, p in params] == [
        ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
        ("g", inspect.Parameter.empty), ("beta", inspect.Parameter.empty),
        ("scale", None), ("initial_state", None), ("output_final_state", False), ("cu_seqlens", None),
        ("cu_seqlens_cpu", None), ("use_qk_l2norm_in_kernel", False), ("state_v_first", False), ("backend", "auto"),
        ("cp", "auto"),
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_output_dtypes(dtype):
    inp = make_inputs(seqlens=(40, 30), dtype=dtype)
    o, h = chunk_gated_delta_rule(**inp, output_final_state=True)
    assert o.dtype == dtype and o.shape == inp["v"].shape
    assert h.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert h.shape == (2,) + inp["initial_state"].shape[1:]
    o2, none = chunk_gated_delta_rule(**inp)
    assert none is None
    assert_same_computation(o, o2)  # seen once in CI: a one-ulp float16 difference


def test_defaults():
    inp = make_inputs(seqlens=(70,), dense=True, initial_state=False)
    o_default, _ = chunk_gated_delta_rule(**inp)
    zeros = torch.zeros(1, 4, 32, 32)
    o_scaled, h = chunk_gated_delta_rule(**{**inp, "initial_state": zeros}, scale=32 ** -0.5, output_final_state=True)
    assert_same_computation(o_default, o_scaled)
    o_half, _ = chunk_gated_delta_rule(**inp, scale=0.5 * inp["q"].shape[-1] ** -0.5)
    torch.testing.assert_close(o_half, 0.5 * o_default)


def test_cu_seqlens_int32_and_host_copy():
    inp = make_inputs(seqlens=(70, 0, 90), pad=5)
    o64, h64 = chunk_gated_delta_rule(**inp, output_final_state=True)
    cu32 = inp["cu_seqlens"].int()
    o32, h32 = chunk_gated_delta_rule(**{**inp, "cu_seqlens": cu32}, cu_seqlens_cpu=cu32.clone(),
                                      output_final_state=True)
    assert_same_computation(o64, o32)
    assert_same_computation(h64, h32)


def test_gradients_flow_from_the_final_state_alone():
    inp = make_inputs(seqlens=(70, 20), requires_grad=True)
    _, h = chunk_gated_delta_rule(**inp, output_final_state=True)
    h.square().sum().backward()
    for name in ("k", "v", "g", "beta", "initial_state"):
        assert inp[name].grad is not None and inp[name].grad.abs().sum() > 0, name
    assert inp["q"].grad is None or inp["q"].grad.abs().sum() == 0  # o was not used


def test_auto_on_cpu_is_the_reference_without_warning():
    inp = make_inputs(seqlens=(50,), dense=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, _ = chunk_gated_delta_rule(**inp)
        o_ref, _ = chunk_gated_delta_rule(**inp, backend="reference")
    assert_same_computation(o, o_ref)
    assert "reference" in backend_names()


def test_explicit_hopper_without_the_kernels_says_what_runs():
    if "hopper" in backend_names() and dispatch.get_backend("hopper").available()[0]:
        pytest.skip("the Hopper backend is installed here")
    inp = make_inputs(seqlens=(50,), dense=True)
    with pytest.raises(RuntimeError, match=r"backend='hopper' cannot run: .*backend='reference' runs anywhere"):
        chunk_gated_delta_rule(**inp, backend="hopper")


# ------------------------------------------------------------------------------------------------------------
# dispatch logic with a stand-in Hopper backend and a stand-in CUDA device (no GPU needed)


class FakeHopper(Backend):
    name = "hopper"
    ok = True
    supports = True

    def available(self):
        return (self.ok, "ready" if self.ok else "TileLang could not load")

    def check(self, p):
        if not self.supports:
            raise NotImplementedError("head dim 48 is not compiled; backend='reference' runs it")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A registry with a stand-in 'hopper', a problem that claims to live on cuda:0, a fresh warn-once flag."""
    dispatch.load_backends()
    monkeypatch.setitem(_REGISTRY, "hopper", FakeHopper)
    monkeypatch.delitem(_INSTANCES, "hopper", raising=False)
    monkeypatch.setattr(dispatch, "_warned_cuda_fallback", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    yield types.SimpleNamespace(device=torch.device("cuda", 0))
    _INSTANCES.pop("hopper", None)


def test_auto_takes_hopper_on_sm90(fake_cuda):
    assert dispatch.select_backend(fake_cuda, "auto").name == "hopper"
    assert dispatch.select_backend(fake_cuda, "hopper").name == "hopper"
    assert dispatch.select_backend(fake_cuda, "reference").name == "reference"


def test_auto_falls_back_with_one_warning(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.warns(RuntimeWarning, match=r"compute capability 9\.0"):
        assert dispatch.select_backend(fake_cuda, "auto").name == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, not per call
        assert dispatch.select_backend(fake_cuda, "auto").name == "reference"
    with pytest.raises(RuntimeError, match=r"compute capability 9\.0.*backend='reference' runs anywhere"):
        dispatch.select_backend(fake_cuda, "hopper")


def test_auto_falls_back_when_hopper_declines(fake_cuda, monkeypatch):
    monkeypatch.setattr(FakeHopper, "supports", False)
    with pytest.warns(RuntimeWarning, match=r"does not support this problem: head dim 48"):
        assert dispatch.select_backend(fake_cuda, "auto").name == "reference"
    with pytest.raises(NotImplementedError, match=r"backend='reference' runs it"):
        dispatch.select_backend(fake_cuda, "hopper")


def test_unavailable_hopper(fake_cuda, monkeypatch):
    monkeypatch.setattr(FakeHopper, "ok", False)
    with pytest.warns(RuntimeWarning, match=r"unavailable: TileLang could not load"):
        assert dispatch.select_backend(fake_cuda, "auto").name == "reference"
    with pytest.raises(RuntimeError, match=r"unavailable: TileLang could not load"):
        dispatch.select_backend(fake_cuda, "hopper")


def test_cpu_problem_never_takes_hopper(fake_cuda):
    cpu = types.SimpleNamespace(device=torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU tensors on the reference are expected, not worth a warning
        assert dispatch.select_backend(cpu, "auto").name == "reference"
    with pytest.raises(RuntimeError, match=r"needs CUDA tensors"):
        dispatch.select_backend(cpu, "hopper")


def test_reference_backend_accuracy_smoke():
    inp = make_inputs(seqlens=(200, 56), dtype=torch.bfloat16)
    o, h = chunk_gated_delta_rule(**inp, output_final_state=True, backend="reference")
    o_ref, h_ref = oracle(inp)
    assert rel_rms(o, o_ref) < 5e-3 and rel_rms(h, h_ref) < 5e-3
