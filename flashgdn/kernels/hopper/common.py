"""Shared settings of the Hopper kernels: the compile target, dtype names and the compile entry point.

Every kernel is a TileLang program built by a factory whose arguments are the *configuration* (head counts,
head dims, dtypes, flags). Token counts, sequence counts and offsets are ``T.dynamic`` or runtime data, so one
compile serves every sequence mix. Compiled kernels are cached in memory per configuration and on disk by
TileLang (``TILELANG_CACHE_DIR``), so a cache compiled ahead of time on a GPU-less machine is reused.
"""
from __future__ import annotations

import os

import torch

#: Always explicit: "auto" needs a GPU at compile time, plain "cuda" falls back to sm_50.
TARGET = {"kind": "cuda", "arch": "sm_90a"}

CHUNK = 64
#: Largest dynamic shared memory one CTA may ask for on SM90 (227 KB).
MAX_SMEM_SM90 = 232448
LOG2E = 1.4426950408889634

TORCH_TO_TL = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.int32: "int32",
    torch.int64: "int64",
}


def tl_dtype(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_TL[dtype]
    except KeyError as e:  # pragma: no cover - guarded by backend.check
        raise NotImplementedError(f"the Hopper kernels have no {dtype} variant") from e


def head_order_total(addends, acc: str, io_dtype: str):
    """The sum of a GVA group's per-value-head values as both group sums write it (``group_sum.py``, and
    ``fused_backward.py``'s ``cluster_sum``, which must give its bits): each addend widened to ``acc``, added in head
    order, rounded once to ``io_dtype``. ``addends`` is the group's values (TileLang expressions), head 0 first."""
    import tilelang.language as T

    s = T.cast(addends[0], acc)
    for x in addends[1:]:
        s = s + T.cast(x, acc)
    return T.cast(s, io_dtype)


def pass_configs():
    import tilelang

    return {
        tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    }


def quiet_tilelang() -> None:
    os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")


def launch_values(kernel) -> list:
    """The integer values (as written, e.g. ``"num_slots"`` or ``"512"``) that the host code of a compiled kernel packs
    for the device kernel's launch, in order: the kernel's integer arguments, then the grid's used dimensions, the
    block's three and the dynamic shared memory size."""
    import re

    host = kernel.get_host_source() or ""
    call = host.rfind("TVMFFIFunctionCall(")
    start = host.rfind("TVMFFIFunctionCall(", 0, call) + 1
    return re.findall(r"stack_ffi_any\)\[\d+\]\.v_int64\) = \(\(int64_t\)(\w+)\);", host[start:call])


def resource_usage(kernel) -> dict:
    """Registers, spills and stack of a compiled kernel, read from ``ptxas -v`` on its PTX for sm_90a.

    Returns ``{"registers", "spill_stores", "spill_loads", "stack", "dynamic_smem", "static_smem", "wgmma_serialized"}`` (bytes;
    the shared memory size is read from the host launch code, None if it cannot be found; ``wgmma_serialized`` is
    ptxas's performance warning that it serialised the kernel's wgmma, e.g. C7514 when a GEMM is kept in flight
    across code that touches its accumulators: then every GEMM of the kernel waits on itself); raises
    RuntimeError when ptxas is not on the PATH (it ships with the CUDA toolkit TileLang compiles with).
    """
    import re
    import shutil
    import subprocess
    import tempfile

    ptxas = shutil.which("ptxas")
    if ptxas is None:
        raise RuntimeError("ptxas is not on the PATH; install the CUDA toolkit (nvcc) to read register usage")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel._get_ptx())
        path = f.name
    try:
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", os.devnull, path],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(path)
    regs = re.search(r"Used (\d+) registers", out)
    static = re.search(r"(\d+) bytes smem", out)
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", out)
    if regs is None or spill is None:
        raise RuntimeError(f"could not read ptxas output:\n{out}")
    launch = launch_values(kernel)  # its dynamic shared memory size is packed last
    return {
        "dynamic_smem": int(launch[-1]) if launch and launch[-1].isdigit() else None,
        "static_smem": int(static.group(1)) if static else 0,
        "registers": int(regs.group(1)),
        "stack": int(spill.group(1)),
        "spill_stores": int(spill.group(2)),
        "spill_loads": int(spill.group(3)),
        "wgmma_serialized": "wgmma.mma_async instructions are serialized" in out,
    }
