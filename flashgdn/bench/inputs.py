"""The benchmark's inputs (DESIGN.md section 5) and its cost model (FLOPs, bytes, floor)."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .shapes import Shape

CHUNK = 64
# Ceilings measured on the H200 (DESIGN.md section 5).
PEAK_FLOPS = 687e12  # dense bf16 GEMM, FLOP/s
PEAK_BYTES = 4.25e12  # copy, read + write, B/s
# fwd+bwd is counted as about three forwards (the backward recomputes the forward and does roughly twice
# its GEMM work); this only sets the floor and nominal TFLOPS of fwd+bwd records.
FWDBWD_FLOP_FACTOR = 3.0


@dataclass
class Inputs:
    """One shape's tensors, in the library's (FLA) layout, packed varlen with B = 1."""

    shape: Shape
    q: torch.Tensor  # [1, T, Hqk, K] bf16, L2-normalised
    k: torch.Tensor  # [1, T, Hqk, K] bf16, L2-normalised
    v: torch.Tensor  # [1, T, Hv, V] bf16
    g: torch.Tensor  # [1, T, Hv] fp32, log decay
    beta: torch.Tensor  # [1, T, Hv] fp32
    h0: torch.Tensor  # [N, Hv, K, V] fp32
    cu_seqlens: torch.Tensor  # [N + 1] int32, on the device
    cu_seqlens_cpu: torch.Tensor  # [N + 1] int32, on the host
    scale: float
    seed: int
    do: Optional[torch.Tensor] = None  # [1, T, Hv, V] bf16, gradient of o (fwd+bwd only)
    dht: Optional[torch.Tensor] = None  # [N, Hv, K, V] fp32, gradient of the final state

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def K(self) -> int:
        return self.q.shape[-1]

    @property
    def V(self) -> int:
        return self.v.shape[-1]


def shape_seed(shape: Shape, base_seed: int) -> int:
    """A seed that depends on the shape (not on its set or position), so every run and every part draws
    the same inputs for the same shape."""
    key = f"{shape.h_qk}/{shape.h_v}/{','.join(map(str, shape.seqlens))}".encode()
    return (base_seed * 1_000_003 + zlib.crc32(key)) % (2**31 - 1)


def make_inputs(shape: Shape, K: int, V: int, device, base_seed: int = 0, with_grads: bool = False) -> Inputs:
    device = torch.device(device)
    seed = shape_seed(shape, base_seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    T, N, Hqk, Hv = shape.tokens, shape.n_seqs, shape.h_qk, shape.h_v

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32)

    q = F.normalize(randn(1, T, Hqk, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(randn(1, T, Hqk, K), dim=-1).to(torch.bfloat16)
    v = randn(1, T, Hv, V).to(torch.bfloat16)
    g = F.logsigmoid(randn(1, T, Hv)) / 16
    beta = torch.sigmoid(randn(1, T, Hv))
    h0 = randn(N, Hv, K, V)
    cu = torch.tensor([0] + list(_cumsum(shape.seqlens)), dtype=torch.int32)
    inp = Inputs(shape, q, k, v, g, beta, h0, cu.to(device), cu, K ** -0.5, seed)
    if with_grads:
        add_grad_outputs(inp, gen)
    return inp


def add_grad_outputs(inp: Inputs, gen: Optional[torch.Generator] = None) -> None:
    """Random gradients of o and of the final state, for fwd+bwd."""
    if inp.do is not None:
        return
    if gen is None:
        gen = torch.Generator(device=inp.device)
        gen.manual_seed(inp.seed + 1)
    inp.do = torch.randn(inp.v.shape, generator=gen, device=inp.device, dtype=torch.float32).to(torch.bfloat16)
    inp.dht = torch.randn(inp.h0.shape, generator=gen, device=inp.device, dtype=torch.float32)


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


# ---------------------------------------------------------------------------------------------------------
# cost model


def fwd_flops(T: int, Hqk: int, Hv: int, K: int, V: int) -> float:
    """FLOPs of the chunked forward of DESIGN.md section 2: 2(3KV + 2CV) per token and value head plus 4CK
    per token and qk head."""
    return T * Hv * 2 * (3 * K * V + 2 * CHUNK * V) + T * Hqk * 4 * CHUNK * K


def fwd_bytes(T: int, N: int, Hqk: int, Hv: int, K: int, V: int) -> float:
    """HBM bytes of the forward, each tensor touched once: read q, k, v (bf16), g, beta (fp32), h0 (fp32);
    write o (bf16), ht (fp32)."""
    qk = 2 * T * Hqk * K * 2
    vo = 2 * T * Hv * V * 2
    gb = 2 * T * Hv * 4
    states = 2 * N * Hv * K * V * 4
    return qk + vo + gb + states


def fwdbwd_bytes(T: int, N: int, Hqk: int, Hv: int, K: int, V: int) -> float:
    """The forward's bytes plus the backward's minimum: read do, dht; write dq, dk, dv, dg, dbeta, dh0."""
    extra = T * Hv * V * 2 + N * Hv * K * V * 4  # do, dht
    extra += 2 * T * Hqk * K * 2 + T * Hv * V * 2 + 2 * T * Hv * 4 + N * Hv * K * V * 4
    return fwd_bytes(T, N, Hqk, Hv, K, V) + extra


def flops(shape: Shape, K: int, V: int, mode: str) -> float:
    f = fwd_flops(shape.tokens, shape.h_qk, shape.h_v, K, V)
    return f * (FWDBWD_FLOP_FACTOR if mode == "fwdbwd" else 1.0)


def hbm_bytes(shape: Shape, K: int, V: int, mode: str) -> float:
    fn = fwdbwd_bytes if mode == "fwdbwd" else fwd_bytes
    return fn(shape.tokens, shape.n_seqs, shape.h_qk, shape.h_v, K, V)


def floor_ms(shape: Shape, K: int, V: int, mode: str) -> float:
    """max(FLOP time at the GEMM ceiling, HBM time at the copy ceiling), in ms."""
    return 1e3 * max(flops(shape, K, V, mode) / PEAK_FLOPS, hbm_bytes(shape, K, V, mode) / PEAK_BYTES)


def nominal_tflops(shape: Shape, K: int, V: int, mode: str, ms: float) -> float:
    """``4 T Hv K V / t`` (the figure FlashInfer reports), times 3 for fwd+bwd."""
    f = 4.0 * shape.tokens * shape.h_v * K * V * (FWDBWD_FLOP_FACTOR if mode == "fwdbwd" else 1.0)
    return f / (ms * 1e-3) / 1e12
