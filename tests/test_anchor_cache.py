"""benchmarks/anchor_cache.py on a stand-in for FlashQLA's package (a TileLang factory per pass, host decisions from
the offsets, an import-time check of the target like FlashQLA's): which builds a dry run records, and that compiling
them fills the kernel cache for sm_90a; everything it patches is put back."""
import json
import os
import sys
import textwrap

import pytest
import torch

from helpers import load_benchmark

anchor_cache = load_benchmark("anchor_cache")

STAND_IN = textwrap.dedent('''
    import torch
    import tilelang
    import tilelang.language as T

    if tilelang.contrib.nvcc.get_target_compute_version() != "9.0":
        raise ValueError("an SM90 target only")
    SMS = torch.cuda.get_device_properties().multi_processor_count


    @tilelang.jit
    def copy_rows(H, dtype, many):
        n = T.dynamic("n")

        @T.prim_func
        def kernel(x: T.Tensor((n, H), dtype), y: T.Tensor((n, H), dtype)):
            with T.Kernel(n, threads=32) as row:
                for j in T.Parallel(H):
                    y[row, j] = x[row, j]

        return kernel


    class _Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v, cu):
            ctx.many = cu.shape[0] > 2  # a host decision from the offsets
            o = torch.empty_like(v)
            copy_rows(v.shape[2], v.dtype, ctx.many)(v, o)
            return o

        @staticmethod
        def backward(ctx, do):
            dv = torch.empty_like(do)
            copy_rows(do.shape[2], torch.float32, ctx.many)(do, dv)
            return dv, None


    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None):
        assert torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()
        with torch.cuda.device(v.device.index):
            o = _Op.apply(v, cu_seqlens)
        ht = initial_state * 1.0 if output_final_state else None
        return o, ht
''')


@pytest.fixture
def site(tmp_path):
    root = tmp_path / "site" / "flash_qla"
    root.mkdir(parents=True)
    (root / "__init__.py").write_text(STAND_IN)
    saved = {n: getattr(torch.cuda, n) for n in ("get_device_properties", "is_current_stream_capturing", "device",
                                                  "is_available")}
    yield str(tmp_path / "site")
    for name in [m for m in sys.modules if m == "flash_qla" or m.startswith("flash_qla.")]:
        del sys.modules[name]
    if str(tmp_path / "site") in sys.path:
        sys.path.remove(str(tmp_path / "site"))
    assert {n: getattr(torch.cuda, n) for n in saved} == saved  # the stubs are gone again


def test_a_dry_run_records_each_distinct_build_and_no_launch(site, tmp_path, capsys):
    out = tmp_path / "builds.json"
    assert anchor_cache.main(["--site", site, "--shape", "1/2:100", "--shape", "1/2:60+40", "--shape", "2/2:90",
                              "--modes", "fwd,fwdbwd", "--out", str(out)]) == 0
    builds = json.loads(out.read_text())
    bf16, f32 = {"torch_dtype": "bfloat16"}, {"torch_dtype": "float32"}
    # forward: bf16 for one and for two sequences; backward: float32 both ways (2/2 adds nothing new)
    assert sorted(map(json.dumps, builds)) == sorted(json.dumps(["copy_rows", [2, d, many], {}])
                                                     for d in (bf16, f32) for many in (False, True))
    assert "3 shapes, 4 FlashQLA builds" in capsys.readouterr().out
    assert anchor_cache.main(["--site", site, "--shape", "1/2:100", "--modes", "fwd", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == [["copy_rows", [2, bf16, False], {}]]


# another head count for each (TileLang keeps what it compiled in memory too: the same build again would not reach
# the new cache directory)
@pytest.mark.parametrize("jobs,hv", [(1, 2), (2, 3)])
def test_compiling_the_builds_fills_the_kernel_cache(jobs, hv, site, tmp_path, monkeypatch, capfd):
    """Each recorded build compiled once into TILELANG_CACHE_DIR, in this process or (``--jobs 2``) in forked
    workers: one kernel source in the cache per build."""
    with pytest.raises(SystemExit, match="TILELANG_CACHE_DIR"):
        monkeypatch.delenv("TILELANG_CACHE_DIR", raising=False)
        anchor_cache.main(["--site", site, "--shape", "1/2:100", "--modes", "fwd", "--compile"])
    cache = tmp_path / "cache"
    # the environment only: TileLang reads it live, while assigning its env attribute would leave a forced value
    # behind after the test (monkeypatch restores by assignment), sending later tests' kernels into this tmp dir
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(cache))
    assert anchor_cache.main(["--site", site, "--shape", f"1/{hv}:100", "--shape", f"1/{hv}:60+40", "--modes", "fwd",
                              "--compile", "--jobs", str(jobs)]) == 0
    out = capfd.readouterr().out  # (the workers write to the file descriptor)
    assert "[1/2] copy_rows" in out and "[2/2] copy_rows" in out
    sources = [f for _, _, files in os.walk(cache) for f in files if f.endswith(".cu")]
    assert len(sources) == 2, sources


def test_shapes_are_asked_for():
    with pytest.raises(SystemExit, match="no shapes"):
        anchor_cache.main(["--site", "/nonexistent"])
    with pytest.raises(SystemExit, match="--modes"):
        anchor_cache.main(["--site", "/nonexistent", "--shape", "1/2:100", "--modes", "bwd"])
