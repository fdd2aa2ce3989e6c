"""The benchmark harness end to end on the CPU: --help, --list, a tiny run with the reference backend, the
accuracy check, implementations that are missing or refuse, merge and report."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flashgdn.bench import cli, results
from flashgdn.bench.check import Checker
from flashgdn.bench.impls import Impl, Prepared, make_impls, parse_impls
from flashgdn.bench.inputs import add_grad_outputs, floor_ms, fwd_flops, make_inputs
from flashgdn.bench.runner import run_one
from flashgdn.bench.shapes import Shape

CPU = torch.device("cpu")


def _have_reference() -> bool:
    try:
        import flashgdn.reference.chunked  # noqa: F401

        return True
    except Exception:
        return False


needs_reference = pytest.mark.skipif(not _have_reference(), reason="flashgdn.reference is not importable")


def test_help_works_without_anchors():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-m", "flashgdn.bench", "--help"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for word in ("canonical", "--part", "--time-budget", "--impls", "merge", "report"):
        assert word in out.stdout


def test_list_canonical(capsys):
    assert cli.main(["--set", "canonical", "--list"]) == 0
    assert "171 shapes" in capsys.readouterr().out
    assert cli.main(["--set", "canonical", "--part", "2/3", "--list"]) == 0
    assert "57 shapes" in capsys.readouterr().out


def test_skip_done(tmp_path, capsys):
    done = {"gpu": "", "date": "", "command": "", "versions": {}, "records": [
        {"set": "canonical", "mode": "fwd", "h_qk": 2, "h_v": 8, "seqlens": [32768], "impl": "fla", "ms": 1.0,
         "err": None, "note": ""}]}
    path = tmp_path / "done.json"
    path.write_text(json.dumps(done))
    assert cli.main(["--set", "canonical", "--skip-done", str(path), "--list"]) == 0
    assert "170 shapes" in capsys.readouterr().out


def test_bad_arguments_are_reported(capsys):
    assert cli.main(["--heads", "16/64"]) == 2
    assert cli.main(["--impls", "flashqla,nonesuch", "--list"]) == 2
    assert cli.main(["--set", "nonesuch", "--list"]) == 2
    assert cli.main(["--modes", "bwd", "--list"]) == 2


def test_parse_impls():
    assert parse_impls("flashqla,fla,flashinfer,flashgdn") == (["flashqla", "fla", "flashinfer", "flashgdn"], [])
    assert parse_impls("flashgdn:hopper+reference") == (["flashgdn"], ["hopper", "reference"])
    with pytest.raises(ValueError):
        parse_impls("fla:triton")
    labels = [i.label for i in make_impls(["fla", "flashgdn"], ["hopper", "reference"])]
    assert labels == ["flashgdn", "flashgdn[reference]", "fla"]


def test_cost_model_matches_design():
    # DESIGN.md section 5: 2(3KV + 2CV) per token and value head + 4CK per token and qk head
    T, Hqk, Hv, K, V = 1000, 2, 8, 128, 128
    assert fwd_flops(T, Hqk, Hv, K, V) == T * Hv * 2 * (3 * K * V + 2 * 64 * V) + T * Hqk * 4 * 64 * K
    s = Shape("custom", 16, 64, (4096,) * 8)
    assert floor_ms(s, 128, 128, "fwdbwd") > 2.9 * floor_ms(s, 128, 128, "fwd")


def test_inputs_follow_the_design_distribution():
    inp = make_inputs(Shape("custom", 2, 4, (30, 50)), 16, 16, "cpu", base_seed=3)
    assert inp.q.dtype == inp.k.dtype == inp.v.dtype == torch.bfloat16
    assert inp.g.dtype == inp.beta.dtype == inp.h0.dtype == torch.float32
    assert inp.q.shape == (1, 80, 2, 16) and inp.v.shape == (1, 80, 4, 16) and inp.h0.shape == (2, 4, 16, 16)
    assert torch.allclose(inp.q.float().norm(dim=-1), torch.ones(1, 80, 2), atol=1e-2)
    assert bool((inp.g <= 0).all()) and bool(((inp.beta > 0) & (inp.beta < 1)).all())
    assert inp.cu_seqlens.tolist() == [0, 30, 80] and inp.cu_seqlens.dtype == torch.int32
    again = make_inputs(Shape("quick", 2, 4, (30, 50)), 16, 16, "cpu", base_seed=3)
    assert torch.equal(inp.v, again.v), "the same shape draws the same inputs in any set or part"


class _Raises(Impl):
    name = "fla"

    def _load(self, device):
        pass

    def prepare(self, inp, mode):
        def forward():
            raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")

        return Prepared(forward, lambda out: out)


class _Missing(Impl):
    name = "flashqla"

    def _load(self, device):
        import flash_qla_that_does_not_exist  # noqa: F401


def test_missing_and_refusing_implementations_do_not_crash():
    inp = make_inputs(Shape("custom", 1, 2, (40,)), 16, 16, "cpu")
    r = run_one(_Missing(), inp, "fwd", None, CPU)
    assert r["ms"] is None and r["note"].startswith("missing: ModuleNotFoundError") and r["status"] == "missing"
    r = run_one(_Raises(), inp, "fwd", None, CPU)
    assert r["ms"] is None and r["status"] == "refused"
    assert r["note"].startswith("refused: RuntimeError: Triton >= 3.4.0")
    fi = make_impls(["flashinfer"], [])[0]
    fi._loaded, fi._missing = True, None  # as if installed: it still has no backward
    r = run_one(fi, inp, "fwdbwd", None, CPU)
    assert r["status"] == "refused" and "no backward" in r["note"]
    results.validate({"gpu": "", "date": "", "command": "", "versions": {}, "records": [r]})


class _ReferenceAsImpl(Impl):
    """The float32 chunked reference as an implementation, optionally with a wrong output."""

    name = "flashgdn"
    backend = "reference"

    def __init__(self, corrupt=False):
        super().__init__()
        self.corrupt = corrupt

    def _load(self, device):
        from flashgdn.reference.chunked import chunk_gated_delta_rule_reference

        self._fn = chunk_gated_delta_rule_reference

    def prepare(self, inp, mode):
        leaves = [t.detach().clone().requires_grad_(mode == "fwdbwd") for t in
                  (inp.q, inp.k, inp.v, inp.g, inp.beta, inp.h0)]

        def forward():
            q, k, v, g, beta, h0 = leaves
            o, ht = self._fn(q, k, v, g, beta, scale=inp.scale, initial_state=h0, output_final_state=True,
                             cu_seqlens=inp.cu_seqlens, compute_dtype=torch.float32)
            if self.corrupt:  # a kernel that gets the last sequence's tail wrong
                o = torch.cat([o[:, :-5], 2 * o[:, -5:]], dim=1)
            return o, ht

        return Prepared(forward, lambda out: out, leaves, (inp.do, inp.dht) if mode == "fwdbwd" else ())


@needs_reference
@pytest.mark.parametrize("seqlens", [(37, 100, 70), (200,)])
def test_check_on_a_slice_is_exact(seqlens):
    inp = make_inputs(Shape("custom", 2, 4, seqlens), 16, 16, "cpu")
    add_grad_outputs(inp)
    checker = Checker(inp, max_tokens=64, max_grad_tokens=64)
    r = run_one(_ReferenceAsImpl(), inp, "fwdbwd", checker, CPU)
    assert r["status"] == "run" and r["ms"] > 0 and r["timer"] == "wallclock-cpu"
    # float32 against float64 on the same inputs: only rounding
    assert r["err_o"] < 1e-5 and r["err"] < 1e-5
    if min(seqlens) <= 64:  # the slice is a whole sequence: state and gradients are checked as well
        assert r["err_state"] < 1e-5
        assert set(r["err_grads"]) == {"dq", "dk", "dv", "dg", "dbeta", "dh0"}
        # dq, dk, dv come back in the inputs' bf16: their rounding (~2e-3) is all there is
        assert all(r["err_grads"][n] < 4e-3 for n in ("dq", "dk", "dv"))
        assert all(r["err_grads"][n] < 1e-5 for n in ("dg", "dbeta", "dh0"))
    else:
        assert r["err_state"] is None and "state unchecked" in r["note"]


@needs_reference
def test_check_catches_a_wrong_output():
    inp = make_inputs(Shape("custom", 2, 4, (64, 30)), 16, 16, "cpu")
    r = run_one(_ReferenceAsImpl(corrupt=True), inp, "fwd", Checker(inp), CPU)
    assert r["ms"] is not None and r["err"] > 0.05
    assert "ERROR ABOVE BAR" in r["note"] and "backend=reference" in r["note"]


@needs_reference
def test_end_to_end_on_cpu_with_the_reference(tmp_path, capsys):
    out = str(tmp_path / "run")
    argv = ["--device", "cpu", "--heads", "2/4", "--seqlens", "40+70,64", "--head-dim", "16",
            "--impls", "flashgdn,flashqla,fla,flashinfer", "--out-dir", out, "--name", "cpu"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "custom: forward" in printed
    files = sorted(os.listdir(out))
    assert files == ["cpu-fwd.png", "cpu-fwdbwd.png", "cpu.json", "cpu.md"]
    doc = results.load(os.path.join(out, "cpu.json"))
    assert doc["command"].startswith("python -m flashgdn.bench --device cpu")
    recs = doc["records"]
    # 2 shapes x 2 modes x (flashgdn hopper + reference + 3 anchors)
    assert len(recs) == 2 * 2 * 5
    ref = [r for r in recs if r.get("backend") == "reference"]
    assert len(ref) == 4 and all(r["ms"] is not None and r["err"] < 5e-3 for r in ref)
    assert all("backend=reference" in r["note"] for r in ref)
    assert all(r["timer"] == "wallclock-cpu" for r in ref)
    fwdbwd = [r for r in ref if r["mode"] == "fwdbwd"]
    assert all(r["err_grad"] is not None and r["err_grad"] < 8e-3 for r in fwdbwd)
    for r in recs:
        if r["impl"] in ("flashqla", "fla", "flashinfer"):
            assert r["ms"] is None and r["note"].startswith("missing:")
    hopper = [r for r in recs if r["impl"] == "flashgdn" and r.get("backend") == "hopper"]
    assert len(hopper) == 4 and all(r["note"].startswith("missing:") for r in hopper)

    # a second part, then merge and report
    argv2 = ["--device", "cpu", "--heads", "1/2", "--seqlens", "50", "--head-dim", "16", "--modes", "fwd",
             "--impls", "flashgdn:reference", "--out-dir", out, "--name", "cpu2", "--no-plots"]
    assert cli.main(argv2) == 0
    merged = str(tmp_path / "merged" / "latest.json")
    assert cli.main(["merge", os.path.join(out, "cpu.json"), os.path.join(out, "cpu2.json"), "-o", merged]) == 0
    m = results.load(merged)
    assert len(m["records"]) == len(recs) + 1
    assert sorted(os.listdir(tmp_path / "merged")) == ["latest-fwd.png", "latest-fwdbwd.png", "latest.json",
                                                        "latest.md"]
    rep = str(tmp_path / "rep")
    assert cli.main(["report", merged, "--out-dir", rep]) == 0
    assert sorted(os.listdir(rep)) == ["latest-fwd.png", "latest-fwdbwd.png", "latest.md"]


@needs_reference
def test_time_budget_stops_starting_shapes(tmp_path, capsys):
    out = str(tmp_path)
    argv = ["--device", "cpu", "--heads", "1/2", "--seqlens", "20,30,40", "--head-dim", "16", "--modes", "fwd",
            "--impls", "flashgdn:reference", "--out-dir", out, "--name", "b", "--no-plots", "--time-budget", "0"]
    assert cli.main(argv) == 0
    assert "time budget" in capsys.readouterr().out
    doc = results.load(os.path.join(out, "b.json"))
    assert len(doc["records"]) == 0  # nothing started, yet a valid file


@pytest.mark.gpu
def test_harness_on_the_gpu(tmp_path):
    """All implementations on a small shape on the GPU: each runs or says why not, and the file validates."""
    if not torch.cuda.is_available():  # the conftest fails or skips gpu tests first; this guards a bare run
        pytest.skip("needs a CUDA GPU")
    out = str(tmp_path)
    argv = ["--heads", "2/4", "--seqlens", "1000+3000,2048", "--out-dir", out, "--name", "gpu",
            "--impls", "flashgdn:hopper+reference,flashqla,fla,flashinfer"]
    assert cli.main(argv) == 0
    doc = results.load(os.path.join(out, "gpu.json"))
    assert "H" in doc["gpu"]
    ran = [r for r in doc["records"] if r["ms"] is not None]
    assert ran, "nothing ran"
    for r in ran:
        assert r["timer"] in ("triton.do_bench_cudagraph", "cudagraph", "cuda-events")
        assert r["err"] is not None


@needs_reference
def test_cp_option_reaches_flashgdn_and_its_note(tmp_path):
    out = str(tmp_path / "cp")
    argv = ["--device", "cpu", "--heads", "1/2", "--seqlens", "300", "--head-dim", "16", "--modes", "fwd",
            "--impls", "flashgdn:reference", "--cp", "2", "--out-dir", out, "--name", "cp", "--no-plots"]
    assert cli.main(argv) == 0
    (rec,) = results.load(os.path.join(out, "cp.json"))["records"]
    assert "cp=2" in rec["note"] and rec["err"] < 5e-3
    bad = [x if x != "2" else "sometimes" for x in argv]
    assert cli.main(bad) == 2


def test_ctas_selects_the_shapes_that_fill_the_gpu_or_not(capsys):
    assert cli.main(["--set", "canonical", "--ctas", "few", "--list"]) == 0
    few = capsys.readouterr().out
    assert "82 shapes" in few and "16/64" not in few  # 16/64 fills the GPU with one sequence
    assert cli.main(["--set", "canonical", "--ctas", "full", "--list"]) == 0
    assert "89 shapes" in capsys.readouterr().out
