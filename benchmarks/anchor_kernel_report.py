"""FlashQLA's Hopper fused backward beside ours, compiled here for sm_90a (no GPU needed): registers, spills, shared
memory and SASS instructions of each, from the same ``common.resource_usage`` the compile tests use.

    python benchmarks/anchor_kernel_report.py --site /tmp/site --heads 16/32

``--site`` is a folder that holds the ``flash_qla`` package (the GPU machine's stack, unpacked from
``.device/stack.tar.xz``, has the pinned flash-qla). Its backward module is loaded on its own, without the package's
``__init__``, which checks for a GPU at import. Ours is the fused build the operator makes for those heads
(``variants.training_variants``' fused build, as a training step precompiles it)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types


def load_flashqla_fused_backward(site: str):
    """FlashQLA's ``chunk/hopper/fused_bwd.py`` from ``site``, with ``flash_qla.utils`` (its one import from the
    package) loaded beside it."""
    root = os.path.join(site, "flash_qla")
    path = os.path.join(root, "ops", "gated_delta_rule", "chunk", "hopper", "fused_bwd.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--site: no flash_qla Hopper backward at {path}")
    if "flash_qla" not in sys.modules:
        pkg = types.ModuleType("flash_qla")
        pkg.__path__ = [root]
        sys.modules["flash_qla"] = pkg
    if "flash_qla.utils" not in sys.modules:
        spec = importlib.util.spec_from_file_location("flash_qla.utils", os.path.join(root, "utils", "__init__.py"),
                                                      submodule_search_locations=[os.path.join(root, "utils")])
        utils = importlib.util.module_from_spec(spec)
        sys.modules["flash_qla.utils"] = utils
        spec.loader.exec_module(utils)
    spec = importlib.util.spec_from_file_location("flashqla_hopper_fused_bwd", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flashqla_kernel(site: str, Hqk: int, Hv: int):
    import torch

    from flashgdn.kernels.hopper.common import TARGET

    jit = load_flashqla_fused_backward(site).tilelang_fused_chunk_gdr_bwd
    jit.target = TARGET
    return jit(Hv, Hqk, 128, 128, 64, 128 ** -0.5, qkva_dtype=torch.bfloat16, g_dtype=torch.float32,
               b_dtype=torch.float32, h_dtype=torch.bfloat16, o_dtype=torch.bfloat16, seqlen_dtype=torch.int32,
               accum_dtype="float32", is_varlen=True, use_dht=True, state_v_first=False)


def flashgdn_kernel(Hqk: int, Hv: int):
    """The fused build a training step precompiles for these heads (with the final state's gradient), and the names
    of the options it is built with."""
    from flashgdn.kernels.hopper.variants import build, training_variants

    fused = [(builder, kw) for _, builder, kw in training_variants(Hqk, Hv, flags="common")
             if builder == "fused_backward" and kw["has_final_grad"]]
    if len(fused) != 1:
        raise RuntimeError(f"expected one fused backward build for {Hqk}/{Hv}, the training step has {len(fused)}")
    builder, kw = fused[0]
    return build(builder, kw), [k for k, v in kw.items() if v is True and k != "has_final_grad"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", help="a folder holding the flash_qla package (without it, ours alone)")
    ap.add_argument("--heads", default="16/32", help="HQK/HV")
    args = ap.parse_args(argv)
    try:
        Hqk, Hv = (int(x) for x in args.heads.split("/"))
        assert Hqk > 0 and Hv % Hqk == 0
    except (ValueError, AssertionError):
        ap.error(f"--heads: expected HQK/HV with HV a multiple of HQK, got {args.heads!r}")
    from flashgdn.kernels.hopper.common import resource_usage

    kernel, options = flashgdn_kernel(Hqk, Hv)
    print(f"flashgdn fused_backward {Hqk}/{Hv} ({','.join(sorted(options))}): {resource_usage(kernel)}")
    if args.site:
        print(f"flashqla fused_bwd {Hqk}/{Hv}: {resource_usage(flashqla_kernel(args.site, Hqk, Hv))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
