"""Stage 0 of the Hopper forward: the chunk slots of a packed batch, built on the device in one small kernel.

For sequences n with lengths L_n (from ``cu_seqlens``), chunk c of sequence n is chunk slot

    first_slot[n] + c,    first_slot[n] = sum_{m < n} ceil(L_m / 64)

and ``bounds[slot] = (first token, rows)``; slots past the last real chunk are idle, ``(0, 0)``. The number of
slots S is known on the host, so nothing is read back: the exact chunk count from the host copy of the offsets
where there is one (the caller's ``cu_seqlens_cpu``, dense input, CP segments), else the bound
ceil((T + 63 N) / 64) (``forward.num_chunk_slots``).

One CTA of 1024 threads walks the sequences 1024 at a time: an exclusive scan of the chunk counts gives each
thread its sequence's first slot, and the thread writes that sequence's slots.

PyTorch counterpart: ``flashgdn.kernels.hopper.forward.chunk_plan_torch`` (and, for the table itself,
``flashgdn.reference.layout.chunk_table``).
"""
import functools

from .common import CHUNK, TARGET, pass_configs

#: threads of the one CTA that scans the sequences (a block of this many sequences per step)
SCAN_THREADS = 1024


def make_sequence_scan():
    """The block scan this kernel and ``segment_index.py`` share, as a TileLang macro
    ``sequence_scan(num_seqs, count_of, per_sequence, counts, ends, carry, mine)``: the CTA's SCAN_THREADS threads
    take the sequences a block at a time; ``count_of(n)`` is sequence n's item count (chunks, segments), an
    exclusive scan of the counts gives its first item, and ``per_sequence(n, mine)`` writes sequence n's items
    with ``mine[0]`` its count and ``mine[1]`` its first item. ``counts``/``ends`` are shared ``[SCAN_THREADS]``
    int32, ``carry`` shared ``[1]`` int32 (the items of the blocks before; the total after), ``mine`` local ``[2]``."""
    import tilelang.language as T

    NT = SCAN_THREADS

    @T.macro
    def sequence_scan(num_seqs, count_of, per_sequence, counts, ends, carry, mine):
        tx = T.get_thread_binding()
        if tx == 0:
            carry[0] = 0
        for blk in T.serial(T.ceildiv(num_seqs, NT)):
            n = blk * NT + tx
            T.sync_threads()
            if n < num_seqs:
                counts[tx] = count_of(n)
            else:
                counts[tx] = 0
            T.sync_threads()
            T.cumsum(counts, ends, dim=0)
            T.sync_threads()
            mine[0] = counts[tx]
            mine[1] = carry[0] + ends[tx] - counts[tx]
            if n < num_seqs:
                per_sequence(n, mine)
            T.sync_threads()
            if tx == 0:
                carry[0] = carry[0] + ends[NT - 1]

    return sequence_scan


@functools.lru_cache(maxsize=None)
def build_chunk_plan():
    """Compile (or load) the kernel. Arguments: cu_seqlens [N + 1] int32, bounds [S, 2] int32 (written),
    first_slot [N] int32 (written)."""
    import tilelang
    import tilelang.language as T

    C = CHUNK
    NT = SCAN_THREADS
    sequence_scan = make_sequence_scan()
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")

    @T.macro
    def write_slots(n, mine, cu_seqlens, bounds, first_slot):
        first_slot[n] = mine[1]
        for c in T.serial(mine[0]):
            bounds[mine[1] + c, 0] = cu_seqlens[n] + c * C
            bounds[mine[1] + c, 1] = T.min(cu_seqlens[n + 1] - cu_seqlens[n] - c * C, C)

    @T.prim_func
    def chunk_plan_kernel(
        cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
        bounds: T.Tensor((num_slots, 2), "int32"),
        first_slot: T.Tensor((num_seqs,), "int32"),
    ):
        with T.Kernel(1, threads=NT) as _:
            counts = T.alloc_shared((NT,), "int32")
            ends = T.alloc_shared((NT,), "int32")
            carry = T.alloc_shared((1,), "int32")
            mine = T.alloc_local((2,), "int32")  # this thread's sequence: chunk count, first slot
            tx = T.get_thread_binding()
            sequence_scan(num_seqs, lambda n: T.ceildiv(cu_seqlens[n + 1] - cu_seqlens[n], C),
                          lambda n, mine: write_slots(n, mine, cu_seqlens, bounds, first_slot),
                          counts, ends, carry, mine)
            T.sync_threads()
            mine[0] = carry[0]
            for blk in T.serial(T.ceildiv(num_slots, NT)):
                s = blk * NT + tx
                if s < num_slots:
                    if s >= mine[0]:
                        bounds[s, 0] = 0
                        bounds[s, 1] = 0

    return tilelang.compile(chunk_plan_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())
