"""Where the chunks are: the chunk table, and moving tensors between token-major and chunk-major.

Token-major tensors are ``[B, T, H, ...]`` (the API's layout). Chunk-major tensors are ``[NC, C, H, ...]``:
one row per global chunk, ``C`` (the chunk size, 64) token slots, zero padded past the chunk's length.
Chunks are aligned to the start of each sequence: chunk ``c`` of sequence ``n`` covers the tokens
``cu[n] + C*c .. min(cu[n] + C*(c+1), cu[n+1]) - 1``. Global chunks are numbered sequence-major, then by
chunk index, which is the order every kernel and the reference use for per-chunk tensors
(``h``, ``M``, ``b``: ``[NC, ...]``).

Dense input is ``B`` sequences of length ``T`` (sequence ``n`` is batch row ``n``); varlen input is ``B == 1``
with ``cu_seqlens``. Tokens after ``cu_seqlens[-1]`` belong to no chunk: moving back to token-major gives them 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Union

import torch

CHUNK = 64

CuSeqlens = Union[None, torch.Tensor, Sequence[int]]


@dataclass
class ChunkTable:
    """Per global chunk and per sequence bookkeeping for one problem. Every tensor is int64 on the CPU.

    Per chunk (``[NC]``): ``chunk_batch`` (batch row), ``chunk_seq`` (sequence id), ``chunk_start`` (first token,
    as a position in the batch row), ``chunk_len`` (tokens in the chunk, 1..C).
    Per sequence (``[N]``): ``seq_batch``, ``seq_start`` (first token in its batch row), ``seq_len``,
    ``seq_first_chunk`` (global index of its chunk 0), ``seq_num_chunks`` (0 for an empty sequence).
    """

    B: int
    T: int
    chunk_size: int
    chunk_batch: torch.Tensor
    chunk_seq: torch.Tensor
    chunk_start: torch.Tensor
    chunk_len: torch.Tensor
    seq_batch: torch.Tensor
    seq_start: torch.Tensor
    seq_len: torch.Tensor
    seq_first_chunk: torch.Tensor
    seq_num_chunks: torch.Tensor
    # gather indices, built once per device on first use
    _index_cache: Dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def N(self) -> int:
        return int(self.seq_len.numel())

    @property
    def NC(self) -> int:
        return int(self.chunk_len.numel())

    def token_index(self, device: torch.device) -> torch.Tensor:
        """``[NC * C]`` flat index into ``B * T`` tokens for every chunk slot; ``B * T`` marks a padding slot."""
        key = ("token", torch.device(device))
        if key not in self._index_cache:
            C = self.chunk_size
            pos = torch.arange(C, dtype=torch.int64)
            flat = (self.chunk_batch * self.T + self.chunk_start)[:, None] + pos[None, :]
            valid = pos[None, :] < self.chunk_len[:, None]
            idx = torch.where(valid, flat, torch.full_like(flat, self.B * self.T))
            self._index_cache[key] = idx.reshape(-1).to(device)
        return self._index_cache[key]

    def slot_index(self, device: torch.device) -> torch.Tensor:
        """``[B * T]`` flat index into ``NC * C`` chunk slots for every token; ``NC * C`` marks a token in no chunk."""
        key = ("slot", torch.device(device))
        if key not in self._index_cache:
            C = self.chunk_size
            idx = torch.full((self.B * self.T,), self.NC * C, dtype=torch.int64)
            tok = self.token_index(torch.device("cpu"))
            valid = tok < self.B * self.T
            idx[tok[valid]] = torch.arange(self.NC * C, dtype=torch.int64)[valid]
            self._index_cache[key] = idx.to(device)
        return self._index_cache[key]


def _host_offsets(cu_seqlens: CuSeqlens) -> Optional[torch.Tensor]:
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        # reading a CUDA tensor here syncs the host: callers that care pass the host copy
        return cu_seqlens.detach().to("cpu", torch.int64).reshape(-1)
    return torch.as_tensor(list(cu_seqlens), dtype=torch.int64)


def chunk_table(cu_seqlens_cpu: CuSeqlens, B: int, T: int, chunk_size: int = CHUNK) -> ChunkTable:
    """The chunk table for dense input (``cu_seqlens_cpu is None``: B sequences of length T) or varlen input
    (B == 1, offsets ``cu_seqlens_cpu`` of N + 1 entries; a tensor, preferably on the CPU, or a list)."""
    cu = _host_offsets(cu_seqlens_cpu)
    if cu is None:
        seq_batch = torch.arange(B, dtype=torch.int64)
        seq_start = torch.zeros(B, dtype=torch.int64)
        seq_len = torch.full((B,), T, dtype=torch.int64)
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (packed sequences), got B = {B}")
        seq_start = cu[:-1].clone()
        seq_len = cu[1:] - cu[:-1]
        seq_batch = torch.zeros_like(seq_start)
    num_chunks = (seq_len + chunk_size - 1) // chunk_size
    first_chunk = torch.cumsum(num_chunks, 0) - num_chunks
    NC = int(num_chunks.sum())
    chunk_seq = torch.repeat_interleave(torch.arange(seq_len.numel(), dtype=torch.int64), num_chunks)
    chunk_idx = torch.arange(NC, dtype=torch.int64) - first_chunk[chunk_seq]
    chunk_start = seq_start[chunk_seq] + chunk_idx * chunk_size
    chunk_len = torch.minimum(seq_len[chunk_seq] - chunk_idx * chunk_size, torch.tensor(chunk_size))
    return ChunkTable(
        B=B,
        T=T,
        chunk_size=chunk_size,
        chunk_batch=seq_batch[chunk_seq],
        chunk_seq=chunk_seq,
        chunk_start=chunk_start,
        chunk_len=chunk_len,
        seq_batch=seq_batch,
        seq_start=seq_start,
        seq_len=seq_len,
        seq_first_chunk=first_chunk,
        seq_num_chunks=num_chunks,
    )


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` along dim 0, where ``index == len(x)`` reads a zero row (functional, autograd-safe)."""
    padded = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))], 0)
    return padded.index_select(0, index)


def to_chunks(x: torch.Tensor, table: ChunkTable) -> torch.Tensor:
    """Token-major ``[B, T, ...]`` → chunk-major ``[NC, C, ...]`` (zero padded)."""
    B, T = x.shape[:2]
    if (B, T) != (table.B, table.T):
        raise ValueError(f"tensor has B, T = {B}, {T} but the chunk table was built for {table.B}, {table.T}")
    rest = tuple(x.shape[2:])
    flat = x.reshape((B * T,) + rest)
    out = _gather_rows(flat, table.token_index(x.device))
    return out.reshape((table.NC, table.chunk_size) + rest)


def from_chunks(xc: torch.Tensor, table: ChunkTable) -> torch.Tensor:
    """Chunk-major ``[NC, C, ...]`` → token-major ``[B, T, ...]``; tokens in no chunk get 0."""
    rest = tuple(xc.shape[2:])
    flat = xc.reshape((table.NC * table.chunk_size,) + rest)
    out = _gather_rows(flat, table.slot_index(xc.device))
    return out.reshape((table.B, table.T) + rest)
