"""``chunk_gated_delta_rule`` as PyTorch custom ops, the form ``torch.compile`` sees.

Under ``torch.compile`` the operator is one opaque node, ``flashgdn::chunk_gdr_fwd``, with a fake (meta)
implementation that gives the output shapes from the input shapes alone, and an autograd formula that calls
``flashgdn::chunk_gdr_bwd``. So a model that calls ``chunk_gated_delta_rule`` compiles with
``fullgraph=True``: Dynamo never looks at sequence lengths (no data-dependent control flow, no host reads),
and nothing recompiles when they change.

* ``chunk_gdr_fwd`` picks the backend exactly as the eager call does (``backend="auto"`` included) and runs its
  forward without autograd. It returns ``(o, final_state)``; ``final_state`` is an empty tensor when it was not
  asked for (a custom op cannot return None).
* ``chunk_gdr_bwd`` computes all six gradients with the backward of the backend the forward picked (the same
  choice, made again from the same arguments): ``Backend.backward``, the Hopper backend's kernels or the
  written-out backward of the chunked form. Gradients of the final state are taken when given.

L2 normalisation of q and k is applied by the caller as ordinary (traced) torch ops in front of the op.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _state_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], state_v_first: bool) -> Tuple[int, ...]:
    B, _, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    return (N, Hv, V, K) if state_v_first else (N, Hv, K, V)


@torch.library.custom_op("flashgdn::chunk_gdr_fwd", mutates_args=())
def chunk_gdr_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    cu_seqlens_cpu: Optional[Tensor],
    scale: float,
    output_final_state: bool,
    state_v_first: bool,
    backend: str,
    cp: str,
) -> Tuple[Tensor, Tensor]:
    from .dispatch import known_backends, select_backend
    from .validate import validate

    # the values of cu_seqlens are checked when that costs no device sync: a host copy, or a CPU cu_seqlens
    host_values = cu_seqlens_cpu is not None or (cu_seqlens is not None and cu_seqlens.device.type == "cpu")
    p = validate(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                 cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first,
                 backend=backend, known_backends=known_backends(), check_values=host_values, cp=cp)
    with torch.no_grad():
        o, final = select_backend(p, backend)(p)
    if final is None:
        final = q.new_empty((0,), dtype=_state_dtype(q.dtype))
    return o, final


@chunk_gdr_fwd.register_fake
def _chunk_gdr_fwd_fake(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state,
                        state_v_first, backend, cp):
    B, T = q.shape[0], q.shape[1]
    o = q.new_empty((B, T, v.shape[2], v.shape[3]))
    shape = _state_shape(q, v, cu_seqlens, state_v_first) if output_final_state else (0,)
    return o, q.new_empty(shape, dtype=_state_dtype(q.dtype))


@torch.library.custom_op("flashgdn::chunk_gdr_bwd", mutates_args=())
def chunk_gdr_bwd(
    do: Tensor,
    dht: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    cu_seqlens_cpu: Optional[Tensor],
    scale: float,
    state_v_first: bool,
    backend: str,
    cp: str,
) -> List[Tensor]:
    from .dispatch import known_backends, select_backend
    from .validate import validate

    p = validate(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                 cu_seqlens_cpu=cu_seqlens_cpu, state_v_first=state_v_first, backend=backend,
                 known_backends=known_backends(), check_values=False, cp=cp)
    grads = select_backend(p, backend).backward(p, q, k, do, dht)
    res = [gr.to(x.dtype) for x, gr in zip((q, k, v, g, beta), grads[:5])]
    if initial_state is None:
        res.append(q.new_empty((0,), dtype=_state_dtype(q.dtype)))
    else:
        res.append(grads[5].to(initial_state.dtype))
    return res


@chunk_gdr_bwd.register_fake
def _chunk_gdr_bwd_fake(do, dht, q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, scale, state_v_first,
                        backend, cp):
    res = [torch.empty_like(x) for x in (q, k, v, g, beta)]
    res.append(q.new_empty((0,), dtype=_state_dtype(q.dtype)) if initial_state is None
               else torch.empty_like(initial_state))
    return res


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state, state_v_first, backend, cp = inputs
    ctx.has_initial_state = initial_state is not None
    ctx.has_cu_seqlens = cu_seqlens is not None
    ctx.cu_seqlens_cpu = cu_seqlens_cpu  # host copy: the recompute plans its chunks without a device sync
    ctx.save_for_backward(q, k, v, g, beta,
                          initial_state if initial_state is not None else q.new_empty((0,)),
                          cu_seqlens if cu_seqlens is not None else q.new_empty((0,), dtype=torch.int32))
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.state_v_first = state_v_first
    ctx.backend = backend
    ctx.cp = cp


def _backward(ctx, do, dht):
    q, k, v, g, beta, h0, cu = ctx.saved_tensors
    h0 = h0 if ctx.has_initial_state else None
    cu = cu if ctx.has_cu_seqlens else None
    dht = dht if ctx.output_final_state else None
    if do is None:
        do = torch.zeros((q.shape[0], q.shape[1], v.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.flashgdn.chunk_gdr_bwd(
        do.contiguous(), None if dht is None else dht.contiguous(), q, k, v, g, beta, h0, cu, ctx.cu_seqlens_cpu,
        ctx.scale, ctx.state_v_first, ctx.backend, ctx.cp)
    return dq, dk, dv, dg, dbeta, (dh0 if ctx.has_initial_state else None), None, None, None, None, None, None, None


chunk_gdr_fwd.register_autograd(_backward, setup_context=_setup_context)
