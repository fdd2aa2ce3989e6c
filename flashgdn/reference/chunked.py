"""The chunked gated delta rule (DESIGN.md §2), stage by stage, in PyTorch.

Every stage exists twice: a ``_..._chunks`` core on chunk-major, head-first tensors ``[NC, H, C, ...]`` that
the composed reference uses, and a public wrapper on token-major tensors ``[B, T, H, ...]`` with the same name
a kernel's intermediate would have, so the two can be compared directly. Within one chunk of one
(sequence, value head), with ``S`` the state at the chunk start and rows i, j = 0..C-1:

    g~_i  = sum_{s<=i} g_s                            (chunk-local cumsum)
    Gam_ij = exp(g~_i - g~_j) for i >= j, else 0
    A     = (I + StrictLower(diag(beta) K K^T))^{-1}  (gate-free)
    Ag    = Gam ⊙ A ⊙ (1 beta^T)
    Vn    = Ag (V - diag(exp(g~)) K S)
    S'    = exp(g~_C) S + K^T diag(exp(g~_C - g~)) Vn  =  M S + b
    O     = scale * (diag(exp(g~)) Q S + (Gam ⊙ Q K^T) Vn)

Every ratio of gates is the exp of a difference, never a division: under strong decay exp(g~) underflows to 0.
The chunk size is 64 throughout (``layout.CHUNK``). Stages compute in float32, or float64 when an input is
float64, unless ``compute_dtype`` says otherwise, and return in that dtype. All of it is functional (no in-place
writes on tensors autograd keeps), so the backward is torch autograd through these functions.

With GVA, value head h reads qk head h // (Hv // Hqk): wrappers take k (and q) with Hqk heads.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .layout import CHUNK, ChunkTable, CuSeqlens, chunk_table, from_chunks, to_chunks
from .recurrent import l2norm

# ---------------------------------------------------------------------------------------------------------
# helpers


def _dtype(compute_dtype: Optional[torch.dtype], *tensors: Optional[torch.Tensor]) -> torch.dtype:
    if compute_dtype is not None:
        return compute_dtype
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _table(cu_seqlens: CuSeqlens, x: torch.Tensor, chunk_size: int = CHUNK) -> ChunkTable:
    return chunk_table(cu_seqlens, x.shape[0], x.shape[1], chunk_size)


def _chunks(x: torch.Tensor, table: ChunkTable, dt: torch.dtype) -> torch.Tensor:
    """Token-major ``[B, T, H, ...]`` → chunk-major head-first ``[NC, H, C, ...]`` in ``dt``."""
    return to_chunks(x.to(dt), table).transpose(1, 2)


def _tokens(xc: torch.Tensor, table: ChunkTable) -> torch.Tensor:
    """Chunk-major head-first ``[NC, H, C, ...]`` → token-major ``[B, T, H, ...]``."""
    return from_chunks(xc.transpose(1, 2), table)


def _gcum_chunks(gcum: torch.Tensor, table: ChunkTable, dt: torch.dtype) -> torch.Tensor:
    """Token-major g~ → ``[NC, H, C]`` with every padding slot holding the chunk's last g~.

    The cores read g~_C as the last slot: a cumsum over zero-padded g gives that by itself, a token-major g~
    brought back to chunks does not (its padding is 0).
    """
    gc = _chunks(gcum, table, dt)
    C = table.chunk_size
    last = (table.chunk_len - 1).to(gc.device)
    g_last = gc.gather(-1, last[:, None, None].expand(gc.shape[0], gc.shape[1], 1))
    valid = (torch.arange(C)[None, :] < table.chunk_len[:, None]).to(gc.device)
    return torch.where(valid[:, None, :], gc, g_last)


def _lower(C: int, device, diagonal: int = 0) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril(diagonal)


def _decay_matrix(gc: torch.Tensor) -> torch.Tensor:
    """Gam ``[..., C, C]``: exp(g~_i - g~_j) on and below the diagonal, 0 above (exp(-inf), so no overflow)."""
    diff = gc[..., :, None] - gc[..., None, :]
    return diff.masked_fill(~_lower(gc.shape[-1], gc.device), float("-inf")).exp()


def _per_value_head(x: torch.Tensor, Hv: int) -> torch.Tensor:
    """Repeat qk heads (dim 1 of a head-first tensor) so value head h sees qk head h // group."""
    return x.repeat_interleave(Hv // x.shape[1], dim=1)


# ---------------------------------------------------------------------------------------------------------
# cores, chunk-major head-first: q, k [NC, Hqk, C, K]; v [NC, Hv, C, V]; g~, beta [NC, Hv, C]; A, Ag [NC, Hv, C, C];
# h [NC, Hv, K, V]


def _inverse_chunks(kc: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
    C = kc.shape[-2]
    kkt = _per_value_head(kc @ kc.transpose(-1, -2), bc.shape[1])  # K K^T once per qk head
    strict = (bc[..., :, None] * kkt) * _lower(C, kc.device, -1)
    eye = torch.eye(C, dtype=kc.dtype, device=kc.device)
    return torch.linalg.solve_triangular(eye + strict, eye.expand_as(strict), upper=False, unitriangular=True)


def _gated_inverse_chunks(A: torch.Tensor, gc: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
    return _decay_matrix(gc) * A * bc[..., None, :]


def _state_pass_chunks(kc, vc, gc, A, bc):
    kv = _per_value_head(kc, vc.shape[1])
    X = -(bc[..., None] * (A.transpose(-1, -2) @ kv))
    g_last = gc[..., -1]
    to_end = (g_last[..., None] - gc).exp()
    eye = torch.eye(kv.shape[-1], dtype=kv.dtype, device=kv.device)
    Xt = X.transpose(-1, -2)
    M = g_last.exp()[..., None, None] * (eye + Xt @ kv)
    b = -(Xt @ (to_end[..., None] * vc))
    return X, M, b


def _chunk_states_chunks(M, b, initial_state, table: ChunkTable):
    """Walk ``S' = M_c S + b_c`` through every sequence's chunks. Sequences are sorted by chunk count, longest
    first, so the sequences still running at chunk step j are a prefix of that order."""
    N, NC = table.N, table.NC
    dev = M.device
    counts = table.seq_num_chunks
    order = torch.argsort(counts, descending=True, stable=True)
    first = table.seq_first_chunk[order]
    steps = int(counts.max()) if N else 0
    active = (counts[None, :] > torch.arange(steps + 1)[:, None]).sum(1).tolist()  # still running at step j

    S = initial_state.index_select(0, order.to(dev))
    h_parts, h_ids, final_parts = [], [], []
    for j in range(len(active) - 1):
        n = active[j]
        ids = first[:n] + j
        S = S[:n]
        h_parts.append(S)
        h_ids.append(ids)
        ids_dev = ids.to(dev)
        S = M.index_select(0, ids_dev) @ S + b.index_select(0, ids_dev)
        final_parts.append(S[active[j + 1] :])  # sequences whose last chunk this was
    # in sorted order: the last to finish first, ..., the first to finish, then the empty sequences
    empty = initial_state.index_select(0, order[active[0] :].to(dev))
    finals_sorted = torch.cat(final_parts[::-1] + [empty], 0)
    final = finals_sorted.index_select(0, torch.argsort(order).to(dev))

    if h_parts:
        pos = torch.empty(NC, dtype=torch.int64)
        pos[torch.cat(h_ids)] = torch.arange(NC)
        h = torch.cat(h_parts, 0).index_select(0, pos.to(dev))
    else:
        h = M.new_zeros((0,) + tuple(b.shape[1:]))
    return h, final


def _new_values_chunks(kc, vc, gc, Ag, h):
    kv = _per_value_head(kc, vc.shape[1])
    return Ag @ (vc - gc.exp()[..., None] * (kv @ h))


def _outputs_chunks(qc, kc, gc, Vn, h, scale):
    Hv = Vn.shape[1]
    qkt = _per_value_head(qc @ kc.transpose(-1, -2), Hv)  # Q K^T once per qk head
    qv = _per_value_head(qc, Hv)
    return scale * (gc.exp()[..., None] * (qv @ h) + (_decay_matrix(gc) * qkt) @ Vn)


def _initial_state_kv(initial_state, N, Hv, K, V, state_v_first, dt, device):
    if initial_state is None:
        return torch.zeros(N, Hv, K, V, dtype=dt, device=device)
    h0 = initial_state.to(dt)
    return h0.transpose(-1, -2) if state_v_first else h0


# ---------------------------------------------------------------------------------------------------------
# stages on token-major tensors


def chunk_local_cumsum(g: torch.Tensor, cu_seqlens: CuSeqlens = None, chunk_size: int = CHUNK) -> torch.Tensor:
    """g~ ``[B, T, H]``: ``g~_t = sum of g_s over the tokens s <= t of t's chunk`` (in float32, or float64
    for float64 g). Tokens after ``cu_seqlens[-1]`` get 0."""
    table = _table(cu_seqlens, g, chunk_size)
    return from_chunks(to_chunks(g.to(_dtype(None, g)), table).cumsum(1), table)


def kkt_inverse(
    k: torch.Tensor, beta: torch.Tensor, cu_seqlens: CuSeqlens = None, compute_dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """The gate-free inverse ``A = (I + StrictLower(diag(beta) K K^T))^{-1}`` per chunk and value head,
    ``[B, T, Hv, 64]``: row t holds row i (t's position in its chunk) of its chunk's A. A is unit lower
    triangular; entries above the diagonal and in columns >= the chunk's length are 0.
    k is ``[B, T, Hqk, K]`` (after the optional L2 norm), beta ``[B, T, Hv]``."""
    dt = _dtype(compute_dtype, k, beta)
    table = _table(cu_seqlens, k)
    return _tokens(_inverse_chunks(_chunks(k, table, dt), _chunks(beta, table, dt)), table)


def gated_inverse(
    A: torch.Tensor,
    gcum: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: CuSeqlens = None,
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``Ag = Gam ⊙ A ⊙ (1 beta^T)``, i.e. ``Ag_ij = exp(g~_i - g~_j) A_ij beta_j`` for j <= i, same layout as A.
    It equals the gated inverse ``(I + StrictLower(diag(beta) (Gam ⊙ K K^T)))^{-1} diag(beta)``."""
    dt = _dtype(compute_dtype, A, gcum, beta)
    table = _table(cu_seqlens, A)
    Ac = _chunks(A, table, dt)
    return _tokens(_gated_inverse_chunks(Ac, _gcum_chunks(gcum, table, dt), _chunks(beta, table, dt)), table)


def state_pass(
    k: torch.Tensor,
    v: torch.Tensor,
    gcum: torch.Tensor,
    A: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: CuSeqlens = None,
    compute_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state-only pass: per chunk, the affine map ``S' = M S + b`` of the state across the chunk.

    ``X = -diag(beta) A^T K`` (token-major ``[B, T, Hv, K]``, independent of S),
    ``M = exp(g~_C) (I + X^T K)`` ``[NC, Hv, K, K]``, ``b = -X^T diag(exp(g~_C - g~)) V`` ``[NC, Hv, K, V]``,
    so that ``S' = exp(g~_C) S + X^T (exp(g~_C) K S - diag(exp(g~_C - g~)) V) = M S + b``.
    g~_C is the cumsum at the chunk's last token."""
    dt = _dtype(compute_dtype, k, v, gcum, A, beta)
    table = _table(cu_seqlens, k)
    X, M, b = _state_pass_chunks(
        _chunks(k, table, dt),
        _chunks(v, table, dt),
        _gcum_chunks(gcum, table, dt),
        _chunks(A, table, dt),
        _chunks(beta, table, dt),
    )
    return _tokens(X, table), M, b


def chunk_states(
    k: torch.Tensor,
    v: torch.Tensor,
    gcum: torch.Tensor,
    A: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    cu_seqlens: CuSeqlens = None,
    state_v_first: bool = False,
    compute_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The state at the start of every chunk, ``h [NC, Hv, K, V]`` (always K x V), and the final state of
    every sequence ``[N, Hv, K, V]``: ``h_0 = initial_state[n]`` (0 when absent), ``h_{c+1} = M_c h_c + b_c``.
    ``initial_state`` is ``[N, Hv, K, V]``, or ``[N, Hv, V, K]`` with ``state_v_first``. An empty sequence's
    final state is its initial state."""
    dt = _dtype(compute_dtype, k, v, gcum, A, beta, initial_state)
    table = _table(cu_seqlens, k)
    _, M, b = state_pass(k, v, gcum, A, beta, cu_seqlens, dt)
    K, V = M.shape[-1], b.shape[-1]
    h0 = _initial_state_kv(initial_state, table.N, v.shape[2], K, V, state_v_first, dt, k.device)
    return _chunk_states_chunks(M, b, h0, table)


def new_values(
    k: torch.Tensor,
    v: torch.Tensor,
    gcum: torch.Tensor,
    Ag: torch.Tensor,
    h: torch.Tensor,
    cu_seqlens: CuSeqlens = None,
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """The new values ``Vn = Ag (V - diag(exp(g~)) K S)`` ``[B, T, Hv, V]``, with S = h of the token's chunk."""
    dt = _dtype(compute_dtype, k, v, gcum, Ag, h)
    table = _table(cu_seqlens, k)
    Vn = _new_values_chunks(
        _chunks(k, table, dt), _chunks(v, table, dt), _gcum_chunks(gcum, table, dt), _chunks(Ag, table, dt), h.to(dt)
    )
    return _tokens(Vn, table)


def chunk_outputs(
    q: torch.Tensor,
    k: torch.Tensor,
    gcum: torch.Tensor,
    Vn: torch.Tensor,
    h: torch.Tensor,
    scale: Optional[float] = None,
    cu_seqlens: CuSeqlens = None,
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """The outputs ``O = scale * (diag(exp(g~)) Q S + (Gam ⊙ Q K^T) Vn)`` ``[B, T, Hv, V]`` (Gam includes its
    diagonal), with S = h of the token's chunk; scale defaults to K ** -0.5. Padding tokens get 0."""
    dt = _dtype(compute_dtype, q, k, gcum, Vn, h)
    table = _table(cu_seqlens, q)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    oc = _outputs_chunks(
        _chunks(q, table, dt), _chunks(k, table, dt), _gcum_chunks(gcum, table, dt), _chunks(Vn, table, dt), h.to(dt), scale
    )
    return _tokens(oc, table)


def compose_transitions(M: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The transition of a run of consecutive chunks of one sequence, ``S_end = M S_start + b``, from the
    per-chunk ``M [n, ..., K, K]`` and ``b [n, ..., K, V]`` (first chunk first). This is what exact context
    parallelism splices: segments' (M, b) computed independently, then ``S_{i+1} = M_i S_i + b_i``."""
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    M_run = eye.expand(M.shape[1:])
    b_run = torch.zeros_like(b[0])
    for c in range(M.shape[0]):
        M_run = M[c] @ M_run
        b_run = M[c] @ b_run + b[c]
    return M_run, b_run


# ---------------------------------------------------------------------------------------------------------
# the whole operator


def chunk_gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_v_first: bool = False,
    compute_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The chunked operator composed from the stages above; arguments as ``flashgdn.chunk_gated_delta_rule``
    (unvalidated). Computes in ``compute_dtype`` (default float32, float64 when q, k or v is float64) and returns
    ``(o [B, T, Hv, V], final_state or None)`` in that dtype. The backward is torch autograd through it.
    ``cu_seqlens_cpu``, when given, is read instead of ``cu_seqlens`` (no host sync)."""
    dt = _dtype(compute_dtype, q, k, v)
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K ** -0.5
    table = chunk_table(cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens, B, T)
    q, k = q.to(dt), k.to(dt)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    qc, kc, vc, bc = (_chunks(x, table, dt) for x in (q, k, v, beta))
    gc = _chunks(g, table, dt).cumsum(-1)  # padding g is 0, so padding slots repeat the chunk's last g~

    A = _inverse_chunks(kc, bc)
    Ag = _gated_inverse_chunks(A, gc, bc)
    _, M, b = _state_pass_chunks(kc, vc, gc, A, bc)
    h0 = _initial_state_kv(initial_state, table.N, Hv, K, V, state_v_first, dt, q.device)
    h, final = _chunk_states_chunks(M, b, h0, table)
    Vn = _new_values_chunks(kc, vc, gc, Ag, h)
    o = _tokens(_outputs_chunks(qc, kc, gc, Vn, h, scale), table)

    if not output_final_state:
        return o, None
    return o, (final.transpose(-1, -2) if state_v_first else final)
