"""Context parallelism's segment index tensors, built on the device in one small kernel.

For sequences n with lengths L_n (from ``cu_seqlens``) cut into segments of ``step`` tokens (a multiple of the
chunk), a plan's index tensors (``flashgdn.cp.SegmentIndex``) are

    count[n]  = max(1, ceil(L_n / step))        (an empty sequence is one empty segment)
    first[n]  = sum_{m < n} count[m]
    seg_seq[first[n] + i] = n,   seg_cu[first[n] + i] = cu[n] + i step,   seg_cu[S] = cu[N]

with S, the number of segments, known on the host from the plan. The torch version
(``flashgdn.cp.plan.segment_index_tensors``) takes about 16 small kernels; this is one, on the chunk plan's block
scan (``chunk_plan.make_sequence_scan``): one CTA of 1024 threads walks the sequences 1024 at a time, an exclusive
scan of the counts gives each thread its sequence's first segment, and the thread writes that sequence's
segments.

PyTorch counterpart: ``flashgdn.cp.plan.segment_index_tensors``.

The second kernel here, ``build_chain_index``, is the backward's chains from the forward's segment starts
(``flashgdn.cp.exact.starts_from_known``): with the forward's segments m times the backward's, forward segment f
of sequence n = known_seq[f] starts the chain of the backward's segments m jf .. m jf + m - 1 of n, where

    jf[f]          = f - known_first[n]                       (its place in its sequence)
    chain_first[f] = first[n] + m jf[f]
    chain_count[f] = min(count[n] - m jf[f], m)

one thread per forward segment, instead of eight small torch kernels (an arange, three gathers, three adds, a
clamp). PyTorch counterpart: ``flashgdn.cp.exact.chain_index_tensors``.
"""

from .chunk_plan import SCAN_THREADS, make_sequence_scan
from .common import TARGET, kernel_cache, pass_configs


@kernel_cache
def build_segment_index(cu_dtype: str):
    """Compile (or load) the kernel. Arguments: cu_seqlens [N + 1] (``cu_dtype``, int32 or int64), step int32
    (segment length in tokens), seg_cu [S + 1] (``cu_dtype``), seg_seq [S] int64, first [N] int64, count [N]
    int64 (all written)."""
    import tilelang
    import tilelang.language as T

    NT = SCAN_THREADS
    sequence_scan = make_sequence_scan()
    num_seqs = T.dynamic("num_seqs")
    num_segments = T.dynamic("num_segments")

    @T.macro
    def write_segments(n, mine, cu_seqlens, step, seg_cu, seg_seq, first, count):
        first[n] = T.cast(mine[1], "int64")
        count[n] = T.cast(mine[0], "int64")
        for i in T.serial(mine[0]):
            seg_seq[mine[1] + i] = T.cast(n, "int64")
            seg_cu[mine[1] + i] = cu_seqlens[n] + T.cast(i * step, cu_dtype)

    @T.prim_func
    def segment_index_kernel(
        cu_seqlens: T.Tensor((num_seqs + 1,), cu_dtype),
        step: T.int32,
        seg_cu: T.Tensor((num_segments + 1,), cu_dtype),
        seg_seq: T.Tensor((num_segments,), "int64"),
        first: T.Tensor((num_seqs,), "int64"),
        count: T.Tensor((num_seqs,), "int64"),
    ):
        with T.Kernel(1, threads=NT) as _:
            counts = T.alloc_shared((NT,), "int32")
            ends = T.alloc_shared((NT,), "int32")
            carry = T.alloc_shared((1,), "int32")
            mine = T.alloc_local((2,), "int32")  # this thread's sequence: segment count, first segment
            tx = T.get_thread_binding()
            sequence_scan(num_seqs,
                          lambda n: T.max(T.ceildiv(T.cast(cu_seqlens[n + 1] - cu_seqlens[n], "int32"), step), 1),
                          lambda n, mine: write_segments(n, mine, cu_seqlens, step, seg_cu, seg_seq, first, count),
                          counts, ends, carry, mine)
            if tx == 0:
                seg_cu[num_segments] = cu_seqlens[num_seqs]

    return tilelang.compile(segment_index_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())


CHAIN_THREADS = 256


@kernel_cache
def build_chain_index():
    """Compile (or load) the chains' index kernel. Arguments: known_seq [F] int64 (the forward's segments'
    sequences), known_first [N] int64, first [N] int64, count [N] int64 (the backward's plan), m int32, then
    written: jf [F], chain_first [F], chain_count [F] (int64)."""
    import tilelang
    import tilelang.language as T

    NT = CHAIN_THREADS
    num_seqs = T.dynamic("num_seqs")
    num_known = T.dynamic("num_known")

    @T.prim_func
    def chain_index_kernel(
        known_seq: T.Tensor((num_known,), "int64"),
        known_first: T.Tensor((num_seqs,), "int64"),
        first: T.Tensor((num_seqs,), "int64"),
        count: T.Tensor((num_seqs,), "int64"),
        m: T.int32,
        jf: T.Tensor((num_known,), "int64"),
        chain_first: T.Tensor((num_known,), "int64"),
        chain_count: T.Tensor((num_known,), "int64"),
    ):
        with T.Kernel(T.ceildiv(num_known, NT), threads=NT) as bx:
            tx = T.get_thread_binding()
            f = bx * NT + tx
            if f < num_known:
                n = known_seq[f]
                j = T.cast(f, "int64") - known_first[n]
                jf[f] = j
                chain_first[f] = first[n] + j * T.cast(m, "int64")
                chain_count[f] = T.min(count[n] - j * T.cast(m, "int64"), T.cast(m, "int64"))

    return tilelang.compile(chain_index_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())
