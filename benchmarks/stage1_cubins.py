"""Stage 1's builds (the default and the v0.38 A/Bs) compiled for sm_90a here, as cubins for a disassembler: ptxas
on the PTX of each build's library (fast math as the library has it), into DIR (default .device/sass, which travels
to the GPU machine, where scripts/sass_segments.sh disassembles them; this machine has no cuobjdump).
    python3 benchmarks/stage1_cubins.py [DIR]
"""
import os
import subprocess
import sys

from flashgdn.kernels.hopper.common import _kernel_ptx
from flashgdn.kernels.hopper.forward import KKT_ASYNC_LOADS, _kkt_build_options
from flashgdn.kernels.hopper.kkt_inverse import build_kkt_inverse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stage1_trace import REGISTER_BUILDS  # noqa: E402

#: name -> the options added to the default's: the default and the builds stage1_trace.py times beside it
BUILDS = {"default": {}, **REGISTER_BUILDS}


def main(out=".device/sass"):
    os.makedirs(out, exist_ok=True)
    for Hqk, Hv in ((32, 32), (16, 32)):
        for name, extra in BUILDS.items():
            opts = {"async_loads": KKT_ASYNC_LOADS, **_kkt_build_options(Hv // Hqk), **extra}
            kernel = build_kkt_inverse(Hqk, Hv, 128, "bfloat16", "bfloat16", **opts)
            base = os.path.join(out, f"stage1-{Hqk}x{Hv}-{name}")
            with open(base + ".ptx", "w") as f:
                f.write(_kernel_ptx(kernel))
            subprocess.run(["ptxas", "-arch=sm_90a", "-o", base + ".cubin", base + ".ptx"], check=True)
            os.remove(base + ".ptx")
            print(base + ".cubin")


if __name__ == "__main__":
    main(*sys.argv[1:])
