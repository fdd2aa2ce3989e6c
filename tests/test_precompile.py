"""python -m flashgdn.precompile on the CPU: compiles every variant of a head configuration for sm_90a and exports
exactly their cache entries (each loadable: the library and its parameters)."""
import os

import pytest

pytest.importorskip("tilelang")


def test_precompile_exports_one_complete_entry_per_kernel(tmp_path, capsys):
    from flashgdn.kernels.hopper.variants import backward_variants, forward_variants
    from flashgdn.precompile import main

    out = tmp_path / "cache"
    assert main(["--heads", "2/8", "--flags", "common", "--jobs", "1", "--export", str(out)]) == 0
    printed = capsys.readouterr().out
    names = {v[0] for v in forward_variants(2, 8, flags="common")} | {v[0] for v in backward_variants(2, 8)}
    assert all(n in printed for n in names)
    entries = [d for d, _, files in os.walk(out) if "executable.so" in files]
    assert len(entries) == len(names)
    for d in entries:
        assert {"executable.so", "params.json"} <= set(os.listdir(d))


def test_precompile_rejects_bad_heads():
    from flashgdn.precompile import main

    with pytest.raises(SystemExit, match="--heads"):
        main(["--heads", "3/4"])
