"""Shared settings of the Hopper kernels: the compile target, dtype names and the compile entry point.

Every kernel is a TileLang program built by a factory whose arguments are the *configuration* (head counts,
head dims, dtypes, flags). Token counts, sequence counts and offsets are ``T.dynamic`` or runtime data, so one
compile serves every sequence mix. Compiled kernels are cached in memory per configuration and on disk by
TileLang (``TILELANG_CACHE_DIR``), so a cache compiled ahead of time on a GPU-less machine is reused.
"""
from __future__ import annotations

import functools
import inspect
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


def kernel_cache(build):
    """A kernel factory's in-memory cache, keyed by its arguments as bound to its signature with the defaults filled
    in: ``build(2, 8, K=128)`` and ``build(Hqk=2, Hv=8, K=128, blocks_per_sm=4)`` are one entry, which
    ``functools.lru_cache`` keeps apart. The operator's calls and the variant lists of ``variants.py`` (what
    ``flashgdn.preload`` builds) spell their arguments differently; with one key, a kernel loaded ahead of time is
    the one the operator finds. ``cache_info`` is the underlying ``lru_cache``'s (one miss per kernel built).

    The operator calls its factories on every call, so a spelling seen before is looked up as it was written first:
    binding a signature costs ~10 us, ~30-40 times an eager training step, where the steps of short shapes are
    host-bound (notes "The eager training loop measured")."""
    sig = inspect.signature(build)
    seen = {}  # (args, kwargs) as called -> the kernel

    @functools.lru_cache(maxsize=None)
    def bound(arguments):
        from flashgdn.kernels.hopper import trace_memo

        trace_memo.install()  # a factory's macros rewritten once per process, not once per build (its docstring)
        return build(**dict(arguments))

    @functools.wraps(build)
    def call(*args, **kwargs):
        spelling = (args, tuple(kwargs.items()))
        kernel = seen.get(spelling)
        if kernel is None:
            b = sig.bind(*args, **kwargs)
            b.apply_defaults()
            kernel = seen[spelling] = bound(tuple(b.arguments.items()))
        return kernel

    def cache_clear():
        seen.clear()
        bound.cache_clear()

    call.cache_info = bound.cache_info
    call.cache_clear = cache_clear
    return call


def kernels_in_memory() -> int | None:
    """How many compiled kernels this process holds in TileLang's in-memory caches (each loaded from the disk cache
    or compiled once): a rise between two calls of the operator is a kernel loaded in between. None without
    TileLang."""
    try:
        from tilelang.cache import _dispatch_map
    except Exception:  # noqa: BLE001 - TileLang absent or laid out otherwise: nothing to count
        return None
    return sum(len(getattr(c, "_memory_cache", {}) or {}) for c in _dispatch_map.values())


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


def barriers_in_thread_branches(src: str) -> list:
    """CTA-wide barriers (``__syncthreads()``) that the generated CUDA source ``src`` puts inside a branch on the thread
    index, as ``(line number, the branch's condition line)``: a barrier that some of the CTA's warps skip is undefined
    behaviour, and in practice matches the others' next barrier, so that their phases overlap. TileLang's
    synchronisation pass puts one wherever a branch's own shared-memory accesses conflict (a write and a read, by
    different threads as far as it can tell), whatever the branch's condition."""
    stack, last_closed, found = [], "", []
    for number, line in enumerate(src.splitlines(), 1):
        s = line.strip()
        if "__syncthreads()" in s:
            if any("threadIdx" in opened for opened in stack):
                found.append((number, next(o for o in reversed(stack) if "threadIdx" in o)))
        closes, opens = s.count("}"), s.count("{")
        for _ in range(closes):
            last_closed = stack.pop() if stack else ""
        for _ in range(opens):
            # an else takes the condition of the if it closed
            stack.append(last_closed if s.startswith("}") and "else" in s and "if" not in s else s)
    return found


def sass_instructions(cubin: bytes) -> dict:
    """SASS instructions of each kernel in a cubin (an ELF file): the size of its ``.text.<kernel>`` section over 16,
    the length of one SM90 instruction. The code size that matters where a CTA's roles run different code on the
    same schedulers and wait on instruction fetch (``docs/hopper-notes.md``, v0.28a: 11-14% of the fused backward's
    samples)."""
    import struct

    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    names_at = headers[names_index][4]

    def name(offset):
        end = cubin.index(b"\0", names_at + offset)
        return cubin[names_at + offset:end].decode()

    return {name(h[0])[len(".text."):]: h[5] // 16 for h in headers if name(h[0]).startswith(".text.")}


def _kernel_ptx(kernel) -> str:
    """The PTX of a compiled kernel as its library was built: TileLang's ``_get_ptx`` compiles the source with the
    kernel's compile flags alone, while the library build adds ``--use_fast_math`` where the pass configs ask for
    fast math (``pass_configs``), which changes the code ptxas makes (at 16/32 the fused backward's spills went
    48/64 -> 76/92 B with it)."""
    import tilelang
    import tilelang.contrib.nvcc as tl_nvcc

    # the lookup TileLang's library build makes (jit/adapter/libgen.py)
    fast = (kernel.pass_configs or {}).get(tilelang.PassConfigKey.TL_ENABLE_FAST_MATH, False)
    flags = list(kernel.compile_flags or []) + (["--use_fast_math"] if fast else [])
    with kernel.target:
        return tl_nvcc.get_ptx_from_source(kernel.get_kernel_source(), compile_flags=flags)


def library_instructions(kernel):
    """SASS instructions of the kernel in the cubin embedded in its compiled library (what runs), or None where the
    library's file is not known."""
    import re
    import struct

    path = getattr(getattr(kernel, "adapter", None), "libpath", None)
    if not path or not os.path.exists(path):
        cached = getattr(kernel, "_tilelang_cache_path", None)
        path = os.path.join(cached, "executable.so") if cached else None
    if not path or not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        blob = f.read()
    code = {}
    for m in re.finditer(b"\x7fELF\x02", blob):
        if m.start() == 0:  # the library itself
            continue
        try:
            code.update(sass_instructions(blob[m.start():]))
        except (ValueError, IndexError, struct.error):
            continue
    return sum(code.values()) if code else None


def resource_usage(kernel) -> dict:
    """Registers, spills, stack and code size of a compiled kernel, read from ``ptxas -v`` on its PTX for sm_90a and
    from the cubin it makes.

    Returns ``{"registers", "spill_stores", "spill_loads", "stack", "instructions", "library_instructions",
    "dynamic_smem", "static_smem", "wgmma_serialized"}`` (bytes; ``instructions``: SASS instructions of the kernel,
    ``sass_instructions``, and ``library_instructions`` those of the library TileLang built, None if not found: equal
    where this report describes the code that runs; the shared memory size is read from the host launch code, None if
    it cannot be found; ``wgmma_serialized`` is ptxas's performance warning that it serialised the kernel's wgmma,
    e.g. C7514 when a GEMM is kept in flight across code that touches its accumulators: then every GEMM of the
    kernel waits on itself); raises RuntimeError when ptxas is not on the PATH (it ships with the CUDA toolkit
    TileLang compiles with).
    """
    import re
    import shutil
    import subprocess
    import tempfile

    ptxas = shutil.which("ptxas")
    if ptxas is None:
        raise RuntimeError("ptxas is not on the PATH; install the CUDA toolkit (nvcc) to read register usage")
    with tempfile.TemporaryDirectory() as tmp:
        path, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(path, "w") as f:
            f.write(_kernel_ptx(kernel))
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", cubin, path],
                             capture_output=True, text=True, check=True).stderr
        with open(cubin, "rb") as f:
            code = sass_instructions(f.read())
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
        "instructions": sum(code.values()),
        "library_instructions": library_instructions(kernel),
        "wgmma_serialized": "wgmma.mma_async instructions are serialized" in out,
    }
