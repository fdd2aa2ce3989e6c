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

#: name -> the options added to the default's (a registers16, b merge16_registers, c merge32_registers, d
#: merge32_quadrants, e registers8: notes v0.38a-e)
BUILDS = {"default": {}, "a": {"registers16": True}, "a-b": {"registers16": True, "merge16_registers": True},
          "a-b-c": {"registers16": True, "merge16_registers": True, "merge32_registers": True},
          "a-b-d": {"registers16": True, "merge16_registers": True, "merge32_quadrants": True},
          "a-e": {"registers16": True, "registers8": True},
          "a-e-b-d": {"registers16": True, "registers8": True, "merge16_registers": True, "merge32_quadrants": True}}


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
