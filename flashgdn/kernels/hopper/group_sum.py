"""The backward's last step for GVA: dq and dk summed over each qk head's value heads, in one pass over both.

Math (``reference/chunked_backward.py``: q and k are shared by the ``group = Hv / Hqk`` value heads of a qk head,
so their gradients are the sums of the per-value-head ones ``chunk_grad`` writes):

    dq[t, hq, :] = RN( ((dq_v[t, hq, 0, :] + dq_v[t, hq, 1, :]) + dq_v[t, hq, 2, :]) + ... )     (same for dk)

each addend widened to float32, summed in head order and rounded once to the io dtype: deterministic, and for a
group of two exactly RN(a + b), the same bits as torch's ``sum(dim)``. It was that ``sum`` on the
``[T, Hqk, group, K]`` views, two reduce kernels that took 0.54 ms of a 4.6 ms training step on 16/32 4096x8 (H200,
``benchmarks/results/h200/backward/step-kernels-v0.7e.json``): ~2.7x the time their traffic needs, as a reduction
over a dimension of two is not what torch's reduce kernel is laid out for. Here each thread reads 16-byte vectors
of K along rows (every load a full sector) and both tensors go in one launch: 0.187 ms there (~4.3 TB/s of
traffic), the backward 0.92x of its time with torch's sums (``stages-hopper-v0.8a-bwd.json``).

One CTA per block of ``ROWS`` (token, qk head) rows, ``THREADS`` threads: rows of K elements are ``K / 8`` vectors
of eight, so 256 threads cover 16 rows per step. Rows = T x Hqk is dynamic.

PyTorch counterpart: ``HopperBackwardStages.finish_gradients``'s ``sum(3)`` (kept for a group of one, a view).
"""

from .common import TARGET, head_order_total, kernel_cache, pass_configs

ROWS = 64
THREADS = 256


@kernel_cache
def build_group_sum(group: int, K: int, io_dtype: str):
    """Compile (or load) the kernel. Arguments, in order:

      dq_v, dk_v  [rows, group, K]  io dtype: per value head, rows = T x Hqk (``[1, T, Hqk, group, K]`` flattened)
      dq, dk      [rows, K]         io dtype, written
    """
    import tilelang
    import tilelang.language as T

    assert group >= 2, "a group of one needs no sum"
    rows = T.dynamic("rows")
    acc = "float32"

    def total(x, r, j):  # in head order, as the docstring says
        return head_order_total([x[r, i, j] for i in range(group)], acc, io_dtype)

    @T.prim_func
    def group_sum_kernel(
        dq_v: T.Tensor((rows, group, K), io_dtype),
        dk_v: T.Tensor((rows, group, K), io_dtype),
        dq: T.Tensor((rows, K), io_dtype),
        dk: T.Tensor((rows, K), io_dtype),
    ):
        with T.Kernel(T.ceildiv(rows, ROWS), threads=THREADS) as b:
            r0 = b * ROWS
            for i, j in T.Parallel(ROWS, K):
                if r0 + i < rows:
                    dq[r0 + i, j] = total(dq_v, r0 + i, j)
            for i, j in T.Parallel(ROWS, K):
                if r0 + i < rows:
                    dk[r0 + i, j] = total(dk_v, r0 + i, j)

    return tilelang.compile(group_sum_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())
