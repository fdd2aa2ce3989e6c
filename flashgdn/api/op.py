"""The public operator, ``chunk_gated_delta_rule`` (FLA's name, arguments and semantics)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .dispatch import known_backends, select_backend
from .validate import validate


def chunk_gated_delta_rule(
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
    backend: str = "auto",
    cp="auto",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated delta rule attention over whole sequences (chunked prefill), with autograd.

    Args:
        q, k: ``[B, T, Hqk, K]``; v: ``[B, T, Hv, V]`` with ``Hv % Hqk == 0`` (value head h reads q/k head
            ``h // (Hv // Hqk)``). float16, bfloat16, float32 or float64, all three alike.
        g: ``[B, T, Hv]`` per-token log decay (<= 0), floating. beta: ``[B, T, Hv]`` in (0, 1), floating.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` (``[N, Hv, V, K]`` with ``state_v_first``), zeros when None.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of N sequences packed along T (then B == 1); tokens after
            ``cu_seqlens[-1]`` get ``o = 0`` and zero gradients. Dense input (None) is B sequences of length T.
        cu_seqlens_cpu: a host copy of ``cu_seqlens`` (equal to it: the Hopper backend sizes its per-chunk buffers
            and plans CP segments from it); with it, nothing reads the device copy (no host sync).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (differentiated through).
        state_v_first: the state layout, ``[..., V, K]`` instead of ``[..., K, V]``.
        backend: ``"auto"`` (Hopper kernels where they can run, else the reference), ``"hopper"`` or
            ``"reference"``.
        cp: exact context parallelism (long sequences cut into segments that run in parallel, their start
            states spliced exactly; ``flashgdn.cp``): ``"auto"`` (the backend decides: the Hopper backend by its cost model,
            the reference backend never splits), ``"off"``,
            or a segment length in chunks of 64 tokens. Needs the sequence lengths on the host (dense input,
            or ``cu_seqlens_cpu``/CPU ``cu_seqlens``).

    Returns:
        ``(o, final_state)``: o ``[B, T, Hv, V]`` in q's dtype; final_state ``[N, Hv, K, V]`` (or V, K) in
        float32 (float64 for float64 inputs) when ``output_final_state``, else None. Gradients flow to q, k, v,
        g, beta and initial_state, including through the final state.
    """
    # Under torch.compile the values of cu_seqlens are not read while tracing (a host sync and a graph break);
    # the custom op checks them when a host copy makes that free (see _compiled_call).
    compiling = torch.compiler.is_compiling()
    p = validate(
        q, k, v, g, beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        state_v_first=state_v_first,
        backend=backend,
        check_values=not compiling,
        cp=cp,
        **({} if compiling else {"known_backends": known_backends()}),
    )
    if compiling:
        return _compiled_call(p, backend)
    o, final = select_backend(p, backend)(p)
    return o, (final if output_final_state else None)


def _compiled_call(p, backend):
    """The operator as ``torch.compile`` traces it, after the shape, dtype and device checks of the eager call:
    one custom op (``custom_ops.py``) that picks the backend at run time as the eager call does. The values of
    ``cu_seqlens`` are checked inside the op when a host copy (``cu_seqlens_cpu``, or a CPU ``cu_seqlens``)
    makes that free; a CUDA ``cu_seqlens`` alone is trusted, since reading it would be a device sync."""
    from . import custom_ops  # noqa: F401 - registers torch.ops.flashgdn
    from ..reference.recurrent import l2norm_qk

    q, k = l2norm_qk(p.q, p.k) if p.use_qk_l2norm_in_kernel else (p.q, p.k)
    o, final = torch.ops.flashgdn.chunk_gdr_fwd(q, k, p.v, p.g, p.beta, p.initial_state, p.cu_seqlens,
                                                p.cu_seqlens_cpu, p.scale, p.output_final_state, p.state_v_first,
                                                backend, str(p.cp))
    return o, (final if p.output_final_state else None)
