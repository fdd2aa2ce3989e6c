"""benchmarks/training_step_once.py: the process Nsight Compute profiles a training step in (on the CPU with the
reference backend, where only the harness is under test: the calls it makes, its arguments' errors)."""
import pytest

from helpers import load_benchmark

tso = load_benchmark("training_step_once")


def test_it_runs_the_warm_up_and_the_calls_forward_and_backward(capsys, monkeypatch):
    import torch

    grads = []
    real_grad = torch.autograd.grad

    def counting_grad(*args, **kwargs):
        out = real_grad(*args, **kwargs)
        grads.append([g is not None for g in out])
        return out

    monkeypatch.setattr(torch.autograd, "grad", counting_grad)
    assert tso.main(["--impl", "flashgdn:reference", "--shape", "1/2:100+30", "--warmup", "1", "--calls", "2",
                     "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[3:5] for line in lines] == [["warm-up", "0:"], ["call", "1:"], ["call", "2:"]]
    # a gradient for each of q, k, v, g, beta and the initial state, in every call
    assert grads == [[True] * 6] * 3


def test_the_forward_alone_takes_no_gradient(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: pytest.fail("a gradient in --mode fwd"))
    assert tso.main(["--impl", "flashgdn:reference", "--shape", "2/4:64", "--mode", "fwd", "--warmup", "0",
                     "--calls", "1", "--device", "cpu"]) == 0
    assert "fwd 2/4:64 call 0:" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--shape", "16/32"], "--shape: expected HQK/HV:SEQLENS"),
    (["--shape", "16/32,8/16:4096x8"], "one head pair and one sequence mix"),
    (["--impl", "nonesuch"], "unknown implementation"),
    (["--calls", "0"], "--calls must be at least 1"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        tso.main(argv + ["--device", "cpu"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_implementation_that_cannot_run_here_says_why(capsys):
    assert tso.main(["--impl", "flashgdn:hopper", "--shape", "1/2:64", "--device", "cpu"]) == 2
    assert "cannot run here" in capsys.readouterr().err
