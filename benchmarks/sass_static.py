"""What each role of a warp-specialised kernel issues in one step of its main loop, read from the kernel's SASS
(CPU only: the cubin is made here by ptxas, its SASS by ``nvdisasm``; no GPU, no profile).

    python benchmarks/sass_static.py --variant 'chunk_forward_fused_state_p[32/32,bfloat16,h0=1,ht=1,v_first=0]'
    python benchmarks/sass_static.py --cubin kernel.cubin --roles "192=state path,96=gate,32=producer"
    python benchmarks/sass_static.py ... --chunk-cycles 8985     # the bounds beside a measured step
    python benchmarks/sass_static.py --ncu profile-sass.csv.xz --roles ...   # and Nsight's executed counts beside

The SASS is split into roles at each ``USETMAXREG`` (``split_roles``: as ``sass_stalls.regions`` does for Nsight
Compute's source page, but a role per warpgroup of its own code, and the out-of-line retry loops of mbarrier waits
given to the role that jumps to them). In each role a control-flow graph gives the natural loops (a back edge is one
whose target dominates its source); the waits' retry loops are told apart (a ``SYNCS.PHASECHK`` or
``USETMAXREG.TRY_ALLOC`` in a loop of a few instructions), and a role's **step** is its loop that holds most of its
instructions. Each instruction of the step counts once a step, those of a loop inside it times that loop's trip count
(read from its exit test where the counter steps by a constant from a constant, else given with ``--trips
ADDRESS=N``; unknown trips count once and are flagged). An instruction in a block that does not dominate the step's
back edge is **conditional**: it may not run every step (the first or last chunk, a tail chunk's loads, some warps of
the warpgroup only), and is counted apart; a ``BRA.DIV``'s target (a collective's slow path for a diverged warp) and
the retry loops are left out.

Per role and step it prints the warp instructions by class (tensor, ``MUFU``, float, conversions, shared memory,
global memory and TMA, shuffles, synchronisation, integer and address, uniform), each role's shared-memory opcodes,
and these lower bounds of a step from the code every step runs, for one CTA an SM:
- **issue**: each SM sub-partition issues one warp instruction a cycle, and a warpgroup puts one warp on each of the
  four, so a sub-partition issues one warp's step of every role: the sum over roles of a warp's instructions;
- **tensor**: an ``HGMMA.64xNx16`` keeps a sub-partition's tensor core N/2 cycles (dense bf16/fp16 at 512
  multiply-adds a cycle and sub-partition: H100 SXM's 989 TFLOPS over 132 SMs at 1.83 GHz), an ``HMMA.16816`` 4;
- **MUFU**: 16 results a cycle an SM, so a warp's ``MUFU`` holds its sub-partition's unit 8 cycles;
- **shared memory**: one 128-byte wavefront a cycle for the SM: the wavefronts of all warps' loads and stores
  (``shared_wavefronts``: without bank conflicts) and those of the ``HGMMA`` operands read from shared memory, their
  bytes over 128 once a warpgroup. Nsight Compute counts both in its shared wavefronts: on the rso loop's profile
  of v0.20 (``results/h200/profiles/forward-v0.20-rso-1wave-*``, the same SASS as today's build but for addresses)
  the HGMMAs hold 56% of them, and its 2527 wavefronts a chunk are the 1112 + 1408 counted here.

Why: the fused loop's trace (notes, "v0.41a measured") was read as a chunk bound by what the SM does for all roles
together rather than by one role's latency. Nsight Compute's counts need a GPU; the SASS says what each role issues,
and so how near each of the SM's units a step comes, before building anything more. These are static counts:
predicated-off instructions count (they take an issue slot too), retry loops do not, and a step's instructions count
once even where warps diverge.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_stalls import FUSED_BACKWARD_ROLES, parse_roles  # noqa: E402
from sass_wavefronts import ncu_kernels, opcode  # noqa: E402

#: the roles of ``chunk_forward_rs`` (its two state paths run code of their own: named in code order, as ptxas lays
#: out the builds read so far: state path 1's code first) at 192/96/32 (the fused loop) or 192/72/56, and of
#: ``chunk_forward_rso`` (its output path first, then its state paths, all at 160 registers)
FORWARD_ROLES = {192: "state path 1|state path 0", 96: "gate", 72: "gate", 56: "producer", 32: "producer",
                 160: "output|state path 1|state path 0"}


def default_roles(kernel: str) -> Dict[int, str]:
    """The role names of a kernel by its name: the fused backward's (``sass_stalls``), else the forward loops'."""
    return dict(FUSED_BACKWARD_ROLES) if "fused_backward" in kernel else dict(FORWARD_ROLES)

#: instruction classes by opcode (without modifiers); the rest is "other"
CLASSES = {
    "tensor": ("HGMMA", "HMMA", "WARPGROUP"),
    "mufu": ("MUFU",),
    "float": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK", "FSWZADD", "HFMA2", "HMUL2", "HADD2", "FMNMX3",
              "FADD2", "FMUL2", "FFMA2", "DFMA", "DADD", "DMUL"),
    "convert": ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "FRND"),
    "shared": ("LDS", "STS", "LDSM", "STSM", "ATOMS", "LDGSTS"),
    "global": ("LDG", "STG", "RED", "ATOMG", "LD", "ST", "UTMALDG", "UTMASTG", "UBLKCP", "UTMAPF", "UTMACCTL",
               "CCTL", "LDL", "STL"),
    "shuffle": ("SHFL", "VOTE", "VOTEU", "MATCH", "REDUX"),
    "sync": ("SYNCS", "BAR", "WARPSYNC", "NANOSLEEP", "DEPBAR", "MEMBAR", "FENCE", "ERRBAR", "CGAERRBAR", "USETMAXREG",
             "ELECT", "BSSY", "BSYNC", "ACQBULK", "UCGABAR_ARV", "UCGABAR_WAIT"),
    "branch": ("BRA", "EXIT", "RET", "CALL", "BRX", "JMP", "BREAK", "BPT"),
}
_CLASS_OF = {op: c for c, ops in CLASSES.items() for op in ops}
#: an SM's sub-partitions, and what one of them does a cycle (see the module's docstring)
SUBPARTITIONS = 4
MACS_PER_CYCLE = 512
MUFU_CYCLES = 8
WAVEFRONT_BYTES = 128


@dataclass
class Instruction:
    address: int
    text: str  # the instruction without its address and final ';', branch targets as hex addresses

    @property
    def opcode(self) -> str:
        return opcode(self.text)

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def predicated(self) -> bool:
        return self.text.startswith("@")

    @property
    def target(self) -> Optional[int]:
        if self.base not in ("BRA", "BSSY", "CALL", "BREAK"):
            return None
        m = re.search(r"(0x[0-9a-f]+)\s*$", self.text)
        return int(m.group(1), 16) if m else None


_INTEGER = {"IMAD", "IADD3", "IADD", "LOP3", "LEA", "SHF", "ISETP", "MOV", "SEL", "PRMT", "IABS", "IMNMX", "VIADD",
            "VIMNMX", "PLOP3", "P2R", "R2P", "S2R", "S2UR", "CS2R", "POPC", "FLO", "BMSK", "SGXT", "IDP",
            "IMUL", "ISCADD", "SHL", "SHR", "BREV", "LOP", "R2UR", "LDC", "NOP", "I2IP", "VIMNMX3", "IADD32I"}


def instruction_class(ins: Instruction) -> str:
    if ins.base.startswith("U") and ins.base not in _CLASS_OF:
        return "uniform"
    return _CLASS_OF.get(ins.base, "integer" if ins.base in _INTEGER else "other")


def shared_wavefronts(ins: Instruction) -> int:
    """128-byte wavefronts the warp's shared-memory instruction needs at least (0 for others): ``LDS.128`` 4, an
    ``LDS.U16`` 1 (a wavefront serves one request however little of it is used), ``LDSM``/``STSM`` one a matrix
    (``.4``: four 8x8 matrices of 16-bit values), without bank conflicts."""
    op, base = ins.opcode, ins.base
    if base in ("LDSM", "STSM"):
        m = re.search(r"\.(\d)(?:\.|$)", op.split(".", 1)[1] if "." in op else "")
        return int(m.group(1)) if m and m.group(1) in "124" else 1
    if base in ("LDS", "STS", "ATOMS"):
        width = 32
        for w in (128, 64):
            if f".{w}" in op:
                width = w
        return max(1, 32 * width // 8 // WAVEFRONT_BYTES)
    return 0


def operand_bytes(ins: Instruction) -> int:
    """Bytes of shared memory an ``HGMMA.MxNxK`` of 16-bit inputs reads for its warpgroup: B (N x K), and A (M x K)
    where A is not in registers (``HGMMA ... R24, gdesc[..]`` rather than ``R24, R120, gdesc[..]``)."""
    shape = hgmma_shape(ins)
    if not shape:
        return 0
    m, n, k = shape
    a_in_registers = re.search(r"HGMMA\S*\s+R\d+,\s+R\d+,\s+gdesc", ins.text) is not None
    return 2 * k * (n + (0 if a_in_registers else m))


def hgmma_shape(ins: Instruction) -> Optional[Tuple[int, int, int]]:
    m = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", ins.opcode)
    return tuple(int(x) for x in m.groups()) if m else None


def tensor_cycles(ins: Instruction) -> float:
    """Cycles of a sub-partition's tensor core the warp's instruction takes at least: an ``HGMMA.MxNxK`` is a
    warpgroup's, so a warp's share is (M/4) N K multiply-adds; an ``HMMA.16816`` (``mma.sync``) 16 x 8 x 16."""
    shape = hgmma_shape(ins)
    if shape:
        return shape[0] // SUBPARTITIONS * shape[1] * shape[2] / MACS_PER_CYCLE
    m = re.match(r"HMMA\.(\d\d)(\d)(\d+)", ins.opcode)
    if m:
        return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) / MACS_PER_CYCLE
    return 0.0


def parse_sass(text: str, kernel: Optional[str] = None) -> List[Instruction]:
    """``nvdisasm -c`` output (one kernel's section, the first unless ``kernel`` is named) as instructions in address
    order, label operands ``(.L_x_12)`` replaced by the addresses the labels stand for."""
    sections = re.split(r"\n\s*\.section\s+\.text\.", "\n" + text)
    body = None
    for s in sections[1:]:
        name = s.split(",", 1)[0].strip()
        if kernel is None or name == kernel:
            body = s
            break
    if body is None:
        raise ValueError(f"no kernel {kernel!r} in the SASS" if kernel else "no .text section in the SASS")
    out: List[Instruction] = []
    labels: Dict[str, int] = {}
    pending: List[str] = []
    for line in body.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;?\s*$", line)
        if m:
            a = int(m.group(1), 16)
            for label in pending:
                labels[label] = a
            pending = []
            out.append(Instruction(a, m.group(2).rstrip(" ;")))
            continue
        m = re.match(r"\s*(\.L_x_\d+|\.L_\d+):\s*$", line)
        if m:
            pending.append(m.group(1))
    end = max((i.address for i in out), default=0) + 16
    for label in pending:
        labels[label] = end
    for ins in out:
        ins.text = re.sub(r"`\((\.L[_x]*_\d+)\)", lambda m: hex(labels.get(m.group(1), -1)), ins.text)
    return out


@dataclass
class Loop:
    header: int  # block index
    latches: List[int]
    blocks: Set[int]
    wait: bool = False
    parent: Optional["Loop"] = None
    children: List["Loop"] = field(default_factory=list)
    trips: Optional[int] = None
    trips_from: str = "unknown"


class RoleGraph:
    """The control-flow graph of one role's instructions: basic blocks, dominators, natural loops."""

    def __init__(self, code: List[Instruction]):
        code = sorted(code, key=lambda i: i.address)
        at = {ins.address: n for n, ins in enumerate(code)}
        leaders = {0}
        for n, ins in enumerate(code):
            t = ins.target
            if ins.base in ("BRA", "EXIT", "RET", "BRX", "JMP"):
                if n + 1 < len(code):
                    leaders.add(n + 1)
                if t is not None and t in at and ins.base == "BRA":
                    leaders.add(at[t])
            elif n + 1 < len(code) and code[n + 1].address != ins.address + 16:
                leaders.add(n + 1)  # a gap: the next row belongs to code placed elsewhere
        starts = sorted(leaders)
        self.blocks = [code[s:e] for s, e in zip(starts, starts[1:] + [len(code)])]
        first = {b[0].address: i for i, b in enumerate(self.blocks)}
        self.succ: List[List[int]] = []
        for i, b in enumerate(self.blocks):
            last, out = b[-1], []
            falls = i + 1 < len(self.blocks) and self.blocks[i + 1][0].address == last.address + 16
            if last.base == "BRA":
                if last.target in first:
                    out.append(first[last.target])
                if (last.predicated or ".DIV" in last.opcode) and falls:
                    out.append(i + 1)
            elif last.base in ("EXIT", "RET"):
                if last.predicated and falls:
                    out.append(i + 1)
            elif falls:
                out.append(i + 1)
            self.succ.append(out)
        self.pred: List[List[int]] = [[] for _ in self.blocks]
        for i, s in enumerate(self.succ):
            for j in s:
                self.pred[j].append(i)
        self.dom = self._dominators()
        self.loops = self._loops()

    def _dominators(self) -> List[Set[int]]:
        n = len(self.blocks)
        reach, stack = {0}, [0]
        while stack:
            for j in self.succ[stack.pop()]:
                if j not in reach:
                    reach.add(j)
                    stack.append(j)
        dom = [set(reach) if i in reach else {i} for i in range(n)]
        dom[0] = {0}
        changed = True
        while changed:
            changed = False
            for i in sorted(reach):
                if i == 0:
                    continue
                preds = [p for p in self.pred[i] if p in reach]
                new = set.intersection(*(dom[p] for p in preds)) | {i} if preds else {i}
                if new != dom[i]:
                    dom[i], changed = new, True
        return dom

    def _loops(self) -> List[Loop]:
        by_header: Dict[int, Loop] = {}
        for u, s in enumerate(self.succ):
            for h in s:
                if h in self.dom[u]:  # a back edge
                    body, stack = {h, u}, ([u] if u != h else [])
                    while stack:
                        for p in self.pred[stack.pop()]:
                            if p not in body:
                                body.add(p)
                                stack.append(p)
                    loop = by_header.setdefault(h, Loop(h, [], set()))
                    loop.latches.append(u)
                    loop.blocks |= body
        loops = sorted(by_header.values(), key=lambda l: len(l.blocks))
        for n, loop in enumerate(loops):
            size = sum(len(self.blocks[b]) for b in loop.blocks)
            loop.wait = size <= 8 and any(i.opcode.startswith(("SYNCS.PHASECHK", "USETMAXREG.TRY_ALLOC"))
                                          for b in loop.blocks for i in self.blocks[b])
            loop.parent = next((o for o in loops[n + 1:] if loop.blocks <= o.blocks and o is not loop), None)
            if loop.parent is not None:
                loop.parent.children.append(loop)
            loop.trips, loop.trips_from = self._trip_count(loop)
        return loops

    def _trip_count(self, loop: Loop) -> Tuple[Optional[int], str]:
        """Trips of a loop whose latch ends ``@P BRA header`` after ``ISETP.<cmp> P, PT, R, IMM`` on a counter that
        steps by a constant (``IADD3/VIADD R, R, IMM``) from a constant set before the loop."""
        if len(loop.latches) != 1:
            return None, "unknown"
        code = [i for b in sorted(loop.blocks) for i in self.blocks[b]]
        latch = self.blocks[loop.latches[0]]
        branch = latch[-1]
        m = re.match(r"@(!?)(U?P\d)\s+BRA", branch.text)
        if not m:
            return None, "unknown"
        negate, pred = m.group(1) == "!", m.group(2)
        setp = next((i for i in reversed(code) if re.match(rf"U?ISETP\.\w+(\.U32)?\.AND {pred}, U?PT, ", i.text)), None)
        if setp is None:
            return None, "unknown"
        sm = re.match(r"U?ISETP\.(\w+)(?:\.U32)?\.AND \S+ U?PT, (U?R\d+), (0x[0-9a-f]+|\d+), U?PT", setp.text)
        if not sm:
            return None, "unknown"
        cmp, reg, limit = sm.group(1), sm.group(2), int(sm.group(3), 0)
        step = None
        for i in code:
            am = re.match(rf"(?:U?IADD3|VIADD) {reg}, (?:U?P?T?, )?{reg}, (0x[0-9a-f]+|-?\d+)", i.text)
            if am:
                step = int(am.group(1), 0)
        if not step:
            return None, "unknown"
        init = None
        header_first = self.blocks[loop.header][0].address
        for b in range(loop.header - 1, -1, -1):
            if b in loop.blocks:
                continue
            for i in reversed(self.blocks[b]):
                if i.address >= header_first:
                    continue
                mm = re.match(rf"(?:MOV|IMAD\.MOV\.U32|UMOV) {reg}, (?:RZ, RZ, )?(0x[0-9a-f]+|\d+|U?RZ)", i.text)
                if mm:
                    init = 0 if mm.group(1).endswith("RZ") else int(mm.group(1), 0)
                    break
                if re.match(rf"\S+ {reg},", re.sub(r"^@!?U?P\w+\s+", "", i.text)):
                    return None, "unknown"  # set otherwise first
            if init is not None:
                break
        if init is None:
            return None, "unknown"
        # the branch back is taken while the test holds (or fails, with '!'); the counter was stepped before the test
        # when the add precedes it in the latch
        count, value = 0, init
        stepped_first = any(i.address < setp.address and re.match(rf"(?:U?IADD3|VIADD) {reg},", i.text)
                            for i in latch)
        for _ in range(4096):
            count += 1
            if stepped_first:
                value += step
            holds = {"NE": value != limit, "LT": value < limit, "LE": value <= limit, "GT": value > limit,
                     "GE": value >= limit, "EQ": value == limit}.get(cmp)
            if holds is None:
                return None, "unknown"
            if not stepped_first:
                value += step
            if holds == negate:
                return count, "read"
        return None, "unknown"


def whole_role(graph: RoleGraph) -> Loop:
    """A role without a loop as one step: every block it reaches, its exits as the latches (what dominates them all
    runs every time)."""
    loop = Loop(0, [], set(range(len(graph.blocks))))
    loop.blocks = {b for b in loop.blocks if 0 in graph.dom[b]}
    loop.latches = [b for b in loop.blocks if not graph.succ[b]] or [max(loop.blocks)]
    loop.children = [l for l in graph.loops if l.parent is None]
    for l in loop.children:
        l.parent = loop
    return loop


def step_loop(graph: RoleGraph) -> Optional[Loop]:
    """The role's step: the loop (not a wait) with the most instructions of its own and its inner loops'."""
    best, best_size = None, 0
    for loop in graph.loops:
        size = sum(len(graph.blocks[b]) for b in loop.blocks)
        if loop.wait or size <= 2:  # a retry loop, or the trap ptxas puts after the code (BRA to itself)
            continue
        if loop.parent is not None and not loop.parent.wait:
            parent_size = sum(len(graph.blocks[b]) for b in loop.parent.blocks)
            if size < 0.5 * parent_size:
                continue
        if size > best_size:
            best, best_size = loop, size
    return best


@dataclass
class StepCount:
    """One role's step: warp instructions by class and opcode, and the resources they take, for the code that runs
    every step (``always``) and for the conditional code apart."""
    classes: Counter = field(default_factory=Counter)
    conditional: Counter = field(default_factory=Counter)
    opcodes: Counter = field(default_factory=Counter)  # every step, with modifiers
    shared_wavefronts: float = 0.0
    operand_bytes: float = 0.0
    tensor_cycles: float = 0.0
    mufu: float = 0.0
    waits: float = 0.0
    unknown_trips: List[str] = field(default_factory=list)
    inner: List[str] = field(default_factory=list)

    @property
    def issued(self) -> float:
        return sum(self.classes.values())


def skipped_blocks(graph: RoleGraph, loop: Loop) -> Set[int]:
    """The blocks of ``loop`` that are not a step's work: the retry loops of waits, and what a ``BRA.DIV`` jumps to
    (a collective's slow path, run only where the warp has diverged)."""
    skipped: Set[int] = set()
    for inner in graph.loops:
        if inner.wait and inner.blocks <= loop.blocks:
            skipped |= inner.blocks
    first = {b[0].address: i for i, b in enumerate(graph.blocks)}
    for b in loop.blocks:
        last = graph.blocks[b][-1]
        if last.opcode.startswith("BRA.DIV") and last.target in first:
            t = first[last.target]
            skipped |= {x for x in loop.blocks if t in graph.dom[x]}
    return skipped


def block_weight(graph: RoleGraph, loop: Loop, b: int, trips: Dict[int, int]) -> Tuple[float, List[int]]:
    """How many times block ``b`` runs a step of ``loop``: the product of the trips of the loops between them
    (``trips`` by a loop's first address, else read), and the first addresses of those whose trips are unknown
    (counted once)."""
    w, unknown = 1.0, []
    l = next((x for x in graph.loops if b in x.blocks and not x.wait), None)
    while l is not None and l is not loop:
        addr = graph.blocks[l.header][0].address
        n = trips.get(addr, l.trips)
        if n is None:
            unknown.append(addr)
        w *= n or 1
        l = l.parent
    return w, unknown


def count_step(graph: RoleGraph, loop: Loop, trips: Dict[int, int]) -> StepCount:
    """A warp's instructions in one step of ``loop`` (the module's docstring), inner loops at their trips."""
    out = StepCount()
    latch_doms = set.intersection(*(graph.dom[l] for l in loop.latches))
    skipped = skipped_blocks(graph, loop)

    def weight(b: int) -> float:
        w, unknown = block_weight(graph, loop, b, trips)
        out.unknown_trips += [f"{a:#x}" for a in unknown if f"{a:#x}" not in out.unknown_trips]
        return w

    for inner in sorted((l for l in graph.loops if not l.wait and l.parent is loop), key=lambda l: l.header):
        addr = graph.blocks[inner.header][0].address
        n = trips.get(addr, inner.trips)
        size = sum(len(graph.blocks[b]) for b in inner.blocks)
        out.inner.append(f"loop at {addr:#x}: {size} instructions a trip, {n if n is not None else '?'} trips "
                         f"({'given' if addr in trips else inner.trips_from}), "
                         f"{'every step' if inner.header in latch_doms else 'conditional'}")
    for b in sorted(loop.blocks):
        w = weight(b)
        for ins in graph.blocks[b]:
            if b in skipped:
                out.waits += 1
                continue
            if b not in latch_doms:
                out.conditional[instruction_class(ins)] += w
                continue
            out.classes[instruction_class(ins)] += w
            out.opcodes[ins.opcode] += w
            out.shared_wavefronts += w * shared_wavefronts(ins)
            out.operand_bytes += w * operand_bytes(ins)
            out.tensor_cycles += w * tensor_cycles(ins)
            out.mufu += w * (ins.base == "MUFU")
    return out


def split_roles(code: List[Instruction], roles: Dict[int, str]) -> List[Tuple[str, List[Instruction]]]:
    """The instructions split at each ``USETMAXREG`` into roles, in code order, the preamble left out. A role is
    named by its register count: ``roles``' name for it, or the next of its names (``"output|state path 1|state path
    0"``) where warpgroups of the same count run code of their own, then ``#2``, ``#3`` after the last name. The
    out-of-line code after the last role (the waits' retry loops) goes to the role whose branch jumps to it, as in
    ``sass_stalls.regions`` (which merges roles of one name)."""
    named: List[Tuple[str, Instruction]] = []
    seen: Counter = Counter()
    name, first_last = None, 0
    for n, ins in enumerate(code):
        if ins.base == "USETMAXREG":
            regs = int(ins.text.replace(",", " ").split()[-1], 16)
            names = roles.get(regs, f"{regs} registers").split("|")
            k = seen[regs]
            seen[regs] += 1
            name = names[k] if k < len(names) else f"{names[-1]}#{k - len(names) + 2}"
            first_last = n
        named.append((name, ins))
    last = name
    targets = {ins.target for ins in code if ins.target is not None}
    # the last role's own code ends at an EXIT that the next row does not fall into
    end_of_last = next((n for n in range(first_last, len(code)) if code[n].base == "EXIT" and not code[n].predicated
                        and (n + 1 == len(code) or code[n + 1].address in targets)), len(code) - 1)
    jumps: Dict[int, str] = {}
    for n, (owner, ins) in enumerate(named[:end_of_last + 1]):
        if ins.target is not None and owner is not None:
            jumps.setdefault(ins.target, owner)
    owner = last
    for n in range(first_last, len(named)):
        if n > end_of_last and code[n].address in jumps:
            owner = jumps[code[n].address]
        named[n] = (owner if n > end_of_last else last, code[n])
    out: Dict[str, List[Instruction]] = {}
    for owner, ins in named:
        if owner is not None:
            out.setdefault(owner, []).append(ins)
    return list(out.items()) if out else [("kernel", list(code))]  # no warpgroup sets its registers: one role


def role_steps(code: List[Instruction], roles: Dict[int, str], trips: Dict[int, int]):
    """``[(role, RoleGraph, step Loop or None, StepCount or None)]`` in code order, the preamble left out."""
    out = []
    for name, mine in split_roles(code, roles):
        graph = RoleGraph(mine)
        loop = step_loop(graph) or whole_role(graph)
        out.append((name, graph, loop, count_step(graph, loop, trips)))
    return out


def bounds(steps, warps: Dict[str, int]) -> Dict[str, float]:
    """The lower bounds of a step (cycles) from the code every step runs, one CTA an SM (the module's docstring)."""
    counts = [(n, s) for n, _, _, s in steps if s]
    return {
        "issue": sum(s.issued for _, s in counts),
        "issue_with_conditional": sum(s.issued + sum(s.conditional.values()) for _, s in counts),
        "tensor": sum(s.tensor_cycles for _, s in counts),
        "mufu": sum(s.mufu for _, s in counts) * MUFU_CYCLES,
        "shared": sum(s.shared_wavefronts * warps.get(n, SUBPARTITIONS) for n, s in counts),
        # an HGMMA is issued by each warp of its warpgroup, which reads its operands once
        "operands": sum(s.operand_bytes * warps.get(n, SUBPARTITIONS) / SUBPARTITIONS for n, s in counts)
        / WAVEFRONT_BYTES,
    }


def report(steps, warps: Dict[str, int], chunk_cycles: Optional[float] = None) -> str:
    """The classes per role and step, each role's loop and its shared-memory opcodes, and the step's bounds."""
    lines = []
    width = max(16, max((len(n) for n, _, _, _ in steps), default=0) + 2)
    cell = lambda v: f"{v:>{width}.0f}"  # noqa: E731
    dash = f"{'-':>{width}s}"
    lines.append(f"{'warp instructions a step':34s}" + "".join(f"{n:>{width}s}" for n, _, _, _ in steps))
    for c in list(CLASSES) + ["integer", "uniform", "other"]:
        if any(s and s.classes[c] for _, _, _, s in steps):
            lines.append(f"{c:34s}" + "".join(cell(s.classes[c]) if s else dash for _, _, _, s in steps))
    rows = [("total, every step", lambda s: s.issued),
            ("conditional (not every step)", lambda s: sum(s.conditional.values())),
            ("shared wavefronts a warp", lambda s: s.shared_wavefronts),
            ("HGMMA operands a warpgroup (B)", lambda s: s.operand_bytes),
            ("tensor cycles a sub-partition", lambda s: s.tensor_cycles),
            ("MUFU a warp", lambda s: s.mufu),
            ("waits, slow paths (left out)", lambda s: s.waits)]
    for title, f in rows:
        lines.append(f"{title:34s}" + "".join(cell(f(s)) if s else dash for _, _, _, s in steps))
    lines.append("")
    for name, graph, loop, s in steps:
        if s is None:
            lines.append(f"{name}: no loop")
            continue
        start = graph.blocks[loop.header][0].address
        inside = {i.address for b in loop.blocks for i in graph.blocks[b]}
        spills = [i.address in inside for b in graph.blocks for i in b if i.base in ("STL", "LDL")]
        lines.append(f"{name}: step loop at {start:#x}, {warps.get(name, SUBPARTITIONS)} warps; local-memory "
                     f"(spill) instructions: {sum(spills)} in the step, {len(spills) - sum(spills)} outside it")
        for text in s.inner:
            lines.append(f"  {text}")
        if s.unknown_trips:
            lines.append(f"  trips unknown (counted once): {', '.join(s.unknown_trips)}; give them with --trips")
        shared = Counter({k: v for k, v in s.opcodes.items() if k.split(".")[0] in CLASSES["shared"]})
        lines.append("  shared: " + ", ".join(f"{k} {v:.0f}" for k, v in shared.most_common(8)))
        base = Counter()
        for k, v in s.opcodes.items():
            base[k.split(".")[0]] += v
        lines.append("  top: " + ", ".join(f"{k} {v:.0f}" for k, v in base.most_common(12)))
    b = bounds(steps, warps)
    lines.append("")
    lines.append("lower bounds of a step (cycles) from the code every step runs, one CTA an SM:")
    lines.append(f"  issue (a sub-partition issues one warp of each role): {b['issue']:.0f} "
                 f"({b['issue_with_conditional']:.0f} with the conditional code)")
    lines.append(f"  tensor (a sub-partition's, all roles): {b['tensor']:.0f}")
    lines.append(f"  MUFU (a sub-partition's): {b['mufu']:.0f}")
    lines.append(f"  shared memory (the SM's wavefronts): {b['shared'] + b['operands']:.0f}, {b['shared']:.0f} by "
                 f"loads and stores (without bank conflicts) and {b['operands']:.0f} by the HGMMA operands")
    if chunk_cycles:
        lines.append(f"  against the measured step of {chunk_cycles:.0f} cycles: issue "
                     f"{b['issue'] / chunk_cycles:.0%}, tensor {b['tensor'] / chunk_cycles:.0%}, MUFU "
                     f"{b['mufu'] / chunk_cycles:.0%}, shared {(b['shared'] + b['operands']) / chunk_cycles:.0%}")
    return "\n".join(lines)


def instructions_from_rows(rows: List[Dict[str, str]]) -> List[Instruction]:
    """Nsight Compute's source page (``sass_wavefronts.read_rows``) as instructions: its SASS is the kernel's, with
    absolute addresses."""
    return [Instruction(int(r["Address"], 16), r.get("Source", "").strip()) for r in rows]


def check_executed(steps, executed: Dict[int, float], trips: Optional[Dict[int, int]] = None) -> List[str]:
    """Each role's static step against Nsight Compute's executed counts of the same SASS (``executed``: warp
    instructions by address): the warp-steps (the executions of the step's first instruction), what a warp-step
    executed on average beside the static count every step and with the conditional code, and the instructions of the
    code that runs every step whose executions are not the warp-steps times their weight (none where the static
    count is right)."""
    out, trips = [], trips or {}
    for name, graph, loop, count in steps:
        head = graph.blocks[loop.header][0]
        n = executed.get(head.address, 0.0)
        if not n:
            out.append(f"{name}: its step's first instruction never ran")
            continue
        latch_doms = set.intersection(*(graph.dom[l] for l in loop.latches))
        skipped = skipped_blocks(graph, loop)
        total, off = 0.0, []
        weights = {b: block_weight(graph, loop, b, trips)[0] for b in loop.blocks}
        for b in sorted(loop.blocks - skipped):
            for ins in graph.blocks[b]:
                e = executed.get(ins.address, 0.0)
                total += e
                if b in latch_doms and abs(e - n * weights[b]) > 1e-6 * max(n, 1):
                    off.append(f"{ins.address:#x} {ins.text[:48]}: {e / n:.3f} a step, counted {weights[b]:g}")
        out.append(f"{name}: {n:.0f} warp-steps; executed {total / n:.1f} a warp-step (waits left out) against "
                   f"{count.issued:.0f} every step, "
                   f"{count.issued + sum(count.conditional.values()):.0f} with the conditional code; "
                   f"{len(off)} instructions of the every-step code off their count")
        out += [f"  {x}" for x in off[:8]]
    return out


def find_nvdisasm(given: Optional[str] = None) -> str:
    """``nvdisasm`` from ``given``, the PATH, the CUDA toolkit beside ptxas, or the ``nvidia-cuda-nvdisasm`` wheel."""
    candidates = [given] if given else []
    candidates.append(shutil.which("nvdisasm"))
    ptxas = shutil.which("ptxas")
    if ptxas:
        candidates.append(os.path.join(os.path.dirname(os.path.realpath(ptxas)), "nvdisasm"))
    try:
        import nvidia  # the wheels' namespace package

        for root in getattr(nvidia, "__path__", []):
            for sub in ("cu13/bin", "cuda_nvdisasm/bin"):
                candidates.append(os.path.join(root, sub, "nvdisasm"))
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise SystemExit("nvdisasm not found: pass --nvdisasm, or `pip install nvidia-cuda-nvdisasm` (it ships with the "
                     "CUDA toolkit's full install too)")


def variant_cubin(name: str, out_dir: str) -> str:
    """Compile the variant of ``flashgdn.kernels.hopper.variants`` named ``name`` (``chunk_forward_fused_state_p[32/32,
    bfloat16,h0=1,ht=1,v_first=0]``) for sm_90a, the kernel cache used where it holds it, and write its cubin as
    ``resource_usage`` makes it: ptxas on the PTX the library build compiles. The build options the host's switches
    add (``variants.with_switches``) are added, so that this is the kernel the operator runs."""
    from flashgdn.kernels.hopper.common import _kernel_ptx
    from flashgdn.kernels.hopper.variants import (backward_variants, build, forward_variants, training_variants,
                                                  with_switches)

    m = re.search(r"\[(\d+)/(\d+),(\w+)", name)
    if not m:
        raise SystemExit(f"--variant: expected a name such as chunk_forward_rso[32/32,bfloat16,h0=1,ht=1,v_first=0], "
                         f"got {name!r}")
    Hqk, Hv, dtype = int(m.group(1)), int(m.group(2)), m.group(3)
    found = None
    for family in (forward_variants, training_variants):
        found = next(((b, kw) for vname, b, kw in family(Hqk, Hv, dtype=dtype) if vname == name), None)
        if found:
            break
    if found is None:
        found = next(((b, kw) for vname, b, kw in backward_variants(Hqk, Hv, dtype=dtype) if vname == name), None)
    if found is None:
        raise SystemExit(f"--variant: no variant {name!r}")
    kernel = build(*with_switches((name, *found))[1:])
    ptx = os.path.join(out_dir, "kernel.ptx")
    cubin = os.path.join(out_dir, "kernel.cubin")
    with open(ptx, "w") as f:
        f.write(_kernel_ptx(kernel))
    subprocess.run([shutil.which("ptxas") or "ptxas", "-arch=sm_90a", "-o", cubin, ptx], check=True)
    return cubin


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--variant", help="a variant name of flashgdn.kernels.hopper.variants (compiled here)")
    src.add_argument("--cubin", help="a cubin file")
    src.add_argument("--sass", help="nvdisasm -c output")
    src.add_argument("--ncu", help="Nsight Compute's source page CSV (plain or .xz): its SASS, and its executed "
                                   "counts checked against the static ones")
    ap.add_argument("--roles", default=None, help='"192=state path,96=gate,32=producer" (default: the forward\'s)')
    ap.add_argument("--warps", default="", help="warps of a role where not 4 (for the shared-memory bound): producer=1")
    ap.add_argument("--trips", default="", help="trip counts of inner loops by their first address: 0x6210=16,...")
    ap.add_argument("--chunk-cycles", type=float, default=None, help="a measured step, for the ratio")
    ap.add_argument("--ncu-kernel", default=None, help="with --ncu: a regex of the kernel's name (default: the kernel "
                                                           "of the file that executed the most instructions)")
    ap.add_argument("--nvdisasm", default=None)
    ap.add_argument("--save-sass", default=None, help="write the SASS here")
    args = ap.parse_args(argv)
    given = parse_roles(args.roles) if args.roles else None
    warps = {k.strip(): int(v) for k, v in (x.split("=") for x in args.warps.split(",") if x)}
    trips = {int(k, 16): int(v) for k, v in (x.split("=") for x in args.trips.split(",") if x)}
    if args.ncu:
        from sass_wavefronts import number

        kernels = ncu_kernels(args.ncu)
        if args.ncu_kernel:
            kernels = [(n, r) for n, r in kernels if re.search(args.ncu_kernel, n)]
        if not kernels:
            raise SystemExit(f"--ncu: no kernel{' matching ' + args.ncu_kernel if args.ncu_kernel else ''} in "
                             f"{args.ncu}")
        # the kernel that executed the most instructions, where several were profiled
        name, rows = max(kernels, key=lambda k: sum(number(r, "Instructions Executed") for r in k[1]))
        print(f"kernel: {name}")
        steps = role_steps(instructions_from_rows(rows), given or default_roles(name), trips)
        print(report(steps, warps, args.chunk_cycles))
        print("\nexecuted (Nsight Compute) against the static counts:")
        executed = {int(r["Address"], 16): number(r, "Instructions Executed") for r in rows}
        print("\n".join(check_executed(steps, executed, trips)))
        # CTA steps: the most warp-steps of a role, over its warps
        cta_steps = max(executed.get(g.blocks[l.header][0].address, 0.0) / warps.get(n, SUBPARTITIONS)
                        for n, g, l, _ in steps)
        if cta_steps and any("L1 Wavefronts Shared" in r for r in rows[:1]):
            b = bounds(steps, warps)
            measured = sum(number(r, "L1 Wavefronts Shared") for r in rows) / cta_steps
            print(f"shared wavefronts a CTA step: {measured:.0f} measured (the whole kernel's, over {cta_steps:.0f} "
                  f"CTA steps), {b['shared'] + b['operands']:.0f} counted every step")
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.sass:
            with open(args.sass) as f:
                text = f.read()
        else:
            cubin = args.cubin
            if args.variant:
                cubin = variant_cubin(args.variant, tmp)
            text = subprocess.run([find_nvdisasm(args.nvdisasm), "-c", cubin], capture_output=True, text=True,
                                  check=True).stdout
        if args.save_sass:
            with open(args.save_sass, "w") as f:
                f.write(text)
    name = re.search(r"\.section\s+\.text\.([^,\s]+)", text)
    name = name.group(1) if name else ""
    print(f"kernel: {name}")
    steps = role_steps(parse_sass(text), given or default_roles(name), trips)
    print(report(steps, warps, args.chunk_cycles))


if __name__ == "__main__":
    main()
