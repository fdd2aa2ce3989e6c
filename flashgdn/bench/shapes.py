"""Benchmark shapes: the named sets, command-line shape syntax, and splitting a set into parts.

A shape is one packed varlen problem (B = 1): a head configuration (Hqk, Hv) and the lengths of the
sequences packed into it. Head dims are not part of the shape; the sets all use K = V = 128.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

SET_NAMES = ("canonical", "bwd", "quick", "cp", "custom")

#: sequences x Hv from which a shape counts as filling the GPU without context parallelism (DESIGN.md §5)
FILL_CTAS = 64

# Seed of the backward set's random sequence lengths. Changing it changes the published shape set,
# so tests pin the lengths it produces.
BWD_SEED = 20240917


@dataclass(frozen=True)
class Shape:
    set: str
    h_qk: int
    h_v: int
    seqlens: Tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def n_seqs(self) -> int:
        return len(self.seqlens)

    @property
    def ctas(self) -> int:
        """CTAs of a chunk loop with one CTA per sequence and value head (no context parallelism)."""
        return self.n_seqs * self.h_v

    @property
    def fills_gpu(self) -> bool:
        """Whether the shape fills an H100/H200 without context parallelism (DESIGN.md §5: sequences x Hv >= 64)."""
        return self.ctas >= FILL_CTAS

    @property
    def heads_label(self) -> str:
        return f"{self.h_qk}/{self.h_v}"

    @property
    def seqlens_label(self) -> str:
        return seqlens_label(self.seqlens)

    @property
    def label(self) -> str:
        return f"{self.heads_label} {self.seqlens_label}"


def seqlens_label(seqlens: Sequence[int]) -> str:
    """Inverse of one item of ``parse_seqlens``: ``8192x4``, ``32768``, ``28672+4096``, ``1024x2+7168``."""
    parts: List[str] = []
    i = 0
    seqlens = list(seqlens)
    while i < len(seqlens):
        j = i
        while j < len(seqlens) and seqlens[j] == seqlens[i]:
            j += 1
        n = j - i
        parts.append(f"{seqlens[i]}x{n}" if n > 1 else f"{seqlens[i]}")
        i = j
    return "+".join(parts)


# ---------------------------------------------------------------------------------------------------------
# parsing


def _parse_count(text: str) -> int:
    """An integer with an optional binary K suffix: ``8192``, ``8K``, ``8k``."""
    t = text.strip()
    m = re.fullmatch(r"(\d+)([kK]?)", t)
    if not m:
        raise ValueError(f"not a token count: {text!r}")
    n = int(m.group(1)) * (1024 if m.group(2) else 1)
    return n


def parse_heads(text: str) -> List[Tuple[int, int]]:
    """``"16/64,8/32"`` -> ``[(16, 64), (8, 32)]``. A bare ``"32"`` means Hqk = Hv = 32."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if "/" in item:
            a, b = item.split("/", 1)
            h_qk, h_v = int(a), int(b)
        else:
            h_qk = h_v = int(item)
        if h_qk <= 0 or h_v <= 0:
            raise ValueError(f"head counts must be positive: {item!r}")
        if h_v % h_qk != 0:
            raise ValueError(f"Hv must be a multiple of Hqk: {item!r}")
        out.append((h_qk, h_v))
    if not out:
        raise ValueError(f"no head configuration in {text!r}")
    return out


def parse_seqlens(text: str) -> List[Tuple[int, ...]]:
    """Sequence mixes: comma separates mixes, ``+`` joins sequences of one mix, ``AxN`` is N sequences of
    A tokens (A may end in K for 1024). ``"8192x4,1000+3000"`` -> ``[(8192,)*4, (1000, 3000)]``."""
    mixes = []
    for mix in text.split(","):
        mix = mix.strip()
        if not mix:
            continue
        lens: List[int] = []
        for term in mix.split("+"):
            term = term.strip().replace("×", "x")
            if "x" in term:
                a, n = term.split("x", 1)
                length, count = _parse_count(a), int(n)
            else:
                length, count = _parse_count(term), 1
            if length <= 0 or count <= 0:
                raise ValueError(f"lengths and counts must be positive: {term!r}")
            lens.extend([length] * count)
        mixes.append(tuple(lens))
    if not mixes:
        raise ValueError(f"no sequence mix in {text!r}")
    return mixes


def custom_shapes(heads: str, seqlens: str) -> List[Shape]:
    return [Shape("custom", hq, hv, mix) for hq, hv in parse_heads(heads) for mix in parse_seqlens(seqlens)]


def parse_shape(text: str) -> Shape:
    """One shape from ``HQK/HV:SEQLENS`` (``16/32:4096x8``, ``8/32:24576+8192``), in ``--heads``/``--seqlens``'
    syntax; a ValueError names what is wrong."""
    heads, sep, seqlens = text.partition(":")
    if not sep or not seqlens:
        raise ValueError(f"--shape: expected HQK/HV:SEQLENS (e.g. 16/32:4096x8), got {text!r}")
    shapes = custom_shapes(heads, seqlens)
    if len(shapes) != 1:
        raise ValueError(f"--shape: one head pair and one sequence mix, got {len(shapes)} shapes from {text!r}")
    return shapes[0]


# ---------------------------------------------------------------------------------------------------------
# the named sets

CANONICAL_HEADS = [(2, 8), (4, 16), (8, 32), (16, 64), (16, 32), (8, 24), (16, 48), (16, 16), (32, 32)]
CANONICAL_SEQLENS = parse_seqlens(
    "32768,16384,8192,4096,2048,"
    "28672+4096,24576+8192,16384+16384,8192+24576,4096+28672,"
    "12288+4096,6144+2048,4096+4096,2048+6144,1024+7168,"
    "8192x4,4096x8,2048x4,1024x8"
)

BWD_HEADS = [(16, 32), (8, 16), (4, 8), (2, 4)]
BWD_TOKENS = [8192, 32768]
BWD_SPLITS = [1, 2, 4, 8]

# The head configurations and mixes of the anchor table in DESIGN.md section 5, so a quick run can be read
# against it directly.
QUICK_HEADS = [(2, 8), (16, 32), (16, 64), (32, 32)]
QUICK_SEQLENS = parse_seqlens("32768,8192,2048,16384x2,4096x8,1024x8")

CP_HV = [4, 8, 16]
CP_SEQLENS = parse_seqlens(
    "8192,16384,32768,65536,131072,"
    "16384x2,65536x2,61440+4096,122880+8192"
)


def _splitmix64(state: int) -> Tuple[int, int]:
    """One step of splitmix64: (new state, output). Written out so the lengths never depend on the
    Python or NumPy version."""
    mask = (1 << 64) - 1
    state = (state + 0x9E3779B97F4A7C15) & mask
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return state, z ^ (z >> 31)


def random_split(total: int, n: int, seed: int) -> Tuple[int, ...]:
    """Split ``total`` tokens into ``n`` sequences of random positive lengths (distinct random cut points),
    deterministically from ``seed``."""
    if n == 1:
        return (total,)
    state = (seed * 1_000_003 + total * 131 + n) & ((1 << 64) - 1)
    cuts = set()
    while len(cuts) < n - 1:
        state, r = _splitmix64(state)
        cuts.add(1 + r % (total - 1))
    bounds = [0] + sorted(cuts) + [total]
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


def canonical_set() -> List[Shape]:
    return [Shape("canonical", hq, hv, mix) for hq, hv in CANONICAL_HEADS for mix in CANONICAL_SEQLENS]


def bwd_set() -> List[Shape]:
    return [
        Shape("bwd", hq, hv, random_split(total, n, BWD_SEED))
        for hq, hv in BWD_HEADS
        for total in BWD_TOKENS
        for n in BWD_SPLITS
    ]


def quick_set() -> List[Shape]:
    return [Shape("quick", hq, hv, mix) for hq, hv in QUICK_HEADS for mix in QUICK_SEQLENS]


def cp_set() -> List[Shape]:
    heads = [(hv // r, hv) for hv in CP_HV for r in (4, 2)]
    return [Shape("cp", hq, hv, mix) for hq, hv in heads for mix in CP_SEQLENS]


NAMED_SETS = {
    "canonical": canonical_set,
    "bwd": bwd_set,
    "quick": quick_set,
    "cp": cp_set,
}

# Modes run when --modes is not given: the forward for the large sets, both where the backward matters.
DEFAULT_MODES = {
    "canonical": ("fwd",),
    "cp": ("fwd",),
    "bwd": ("fwd", "fwdbwd"),
    "quick": ("fwd", "fwdbwd"),
    "custom": ("fwd", "fwdbwd"),
}


def named_set(name: str) -> List[Shape]:
    if name not in NAMED_SETS:
        raise ValueError(f"unknown shape set {name!r}; known: {', '.join(NAMED_SETS)}")
    return NAMED_SETS[name]()


# ---------------------------------------------------------------------------------------------------------
# parts


def shape_cost(s: Shape) -> float:
    """Rough relative run time of one shape: a fixed per-shape overhead (first calls, checks, graph capture)
    plus a term proportional to the work."""
    return 1.0 + s.tokens * s.h_v / (32768 * 32)


# JIT-compiling anchors (FlashQLA: 10-30 s) pay once per head configuration in a process, counted in
# per-shape cost units.
GROUP_COMPILE_COST = 6.0


def parse_part(text: str) -> Tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"--part must look like i/n, got {text!r}")
    i, n = int(m.group(1)), int(m.group(2))
    if not 1 <= i <= n:
        raise ValueError(f"--part {text}: need 1 <= i <= n")
    return i, n


def split_parts(shapes: Sequence[Shape], n: int) -> List[List[Shape]]:
    """Split shapes into n parts of similar estimated run time, every shape in exactly one part.

    Shapes of one head configuration stay together where possible, so a compile per configuration is paid
    in one part only; configurations are then spread over the parts largest first (LPT). With more parts
    than configurations, the largest groups are halved until there are enough. Each part keeps the input
    order of its shapes.
    """
    if n < 1:
        raise ValueError("number of parts must be >= 1")
    order = {s: i for i, s in enumerate(shapes)}
    groups: Dict[Tuple[str, int, int], List[Shape]] = {}
    for s in shapes:
        groups.setdefault((s.set, s.h_qk, s.h_v), []).append(s)
    units: List[List[Shape]] = list(groups.values())

    def cost(unit: List[Shape]) -> float:
        return GROUP_COMPILE_COST + sum(shape_cost(s) for s in unit)

    while len(units) < n and any(len(u) > 1 for u in units):
        big = max((u for u in units if len(u) > 1), key=cost)
        units.remove(big)
        h = len(big) // 2
        units += [big[:h], big[h:]]
    units.sort(key=lambda u: (-cost(u), order[u[0]]))
    parts: List[List[Shape]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for u in units:
        j = min(range(n), key=lambda p: (loads[p], p))
        parts[j] += u
        loads[j] += cost(u)
    for p in parts:
        p.sort(key=order.__getitem__)
    return parts


def select_part(shapes: Sequence[Shape], part: Tuple[int, int]) -> List[Shape]:
    i, n = part
    return split_parts(shapes, n)[i - 1]


def dedupe(shapes: Iterable[Shape]) -> List[Shape]:
    seen = set()
    out = []
    for s in shapes:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out
