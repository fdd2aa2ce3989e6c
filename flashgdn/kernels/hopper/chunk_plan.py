"""Stage 0 of the Hopper forward: the chunk slots of a packed batch, built on the device in one small kernel.

For sequences n with lengths L_n (from ``cu_seqlens``), chunk c of sequence n is chunk slot

    first_slot[n] + c,    first_slot[n] = sum_{m < n} ceil(L_m / 64)

and ``bounds[slot] = (first token, rows)``; slots past the last real chunk are idle, ``(0, 0)``. The number of
slots S is known on the host, so nothing is read back: the exact chunk count from the host copy of the offsets
where there is one (the caller's ``cu_seqlens_cpu``, dense input, CP segments), else the bound
ceil((T + 63 N) / 64) (``forward.num_chunk_slots``).

One CTA of 1024 threads walks the sequences 1024 at a time: an exclusive scan of the chunk counts gives each
thread its sequence's first slot, and all the threads then write the block's slots together, each finding its
slot's sequence by bisection over the scan: 3.6-4.8 us from one to 2048 chunks of one sequence, where each thread
writing its own sequence's slots took 13.4 us at 448 chunks and 50 us at 2048 (``docs/hopper-notes.md``, v0.22c).

PyTorch counterpart: ``flashgdn.kernels.hopper.forward.chunk_plan_torch`` (and, for the table itself,
``flashgdn.reference.layout.chunk_table``).
"""

from .common import CHUNK, TARGET, kernel_cache, pass_configs

#: threads of the one CTA that scans the sequences (a block of this many sequences per step)
SCAN_THREADS = 1024
#: bisection steps that find a slot's sequence among a block's SCAN_THREADS
SCAN_STEPS = 10


def make_sequence_scan():
    """The block scan this kernel and ``segment_index.py`` share, as a TileLang macro
    ``sequence_scan(num_seqs, count_of, per_sequence, counts, ends, carry, mine)``: the CTA's SCAN_THREADS threads
    take the sequences a block at a time; ``count_of(n)`` is sequence n's item count (chunks, segments), an
    exclusive scan of the counts gives its first item, and ``per_sequence(n, mine)`` writes sequence n's items
    with ``mine[0]`` its count and ``mine[1]`` its first item. ``counts``/``ends`` are shared ``[SCAN_THREADS]``
    int32, ``carry`` shared ``[1]`` int32 (the items of the blocks before; the total after), ``mine`` local ``[2]``.
    ``per_block(blk, tx)``, if given, runs on every thread once the block's scan is in ``counts``/``ends`` (the
    block's items are ``carry[0] .. carry[0] + ends[SCAN_THREADS - 1] - 1``), so that the block's threads can share
    its items' work instead of each writing its own sequence's."""
    import tilelang.language as T

    NT = SCAN_THREADS

    @T.macro
    def sequence_scan(num_seqs, count_of, per_sequence, counts, ends, carry, mine, per_block=None):
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
            if per_block is not None:
                per_block(blk, tx)
            T.sync_threads()
            if tx == 0:
                carry[0] = carry[0] + ends[NT - 1]

    return sequence_scan


@kernel_cache
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
    def write_first_slot(n, mine, first_slot):
        first_slot[n] = mine[1]

    @T.macro
    def write_block_slots(blk, tx, cu_seqlens, bounds, counts, ends, carry, found):
        # the block's slots over all its threads: slot i of the block is in the first sequence j with ends[j] > i
        # (ends: the inclusive scan of the block's chunk counts), found by bisection. Shared values go through
        # registers (found[2], found[3]): TileLang's sync pass takes no shared load in a loop bound or a condition.
        found[2] = ends[NT - 1]
        for it in T.serial(T.ceildiv(found[2], NT)):
            i = it * NT + tx
            if i < found[2]:
                found[0] = 0
                found[1] = NT - 1
                for _ in T.serial(SCAN_STEPS):
                    found[3] = ends[(found[0] + found[1]) // 2]
                    if found[3] > i:
                        found[1] = (found[0] + found[1]) // 2
                    else:
                        found[0] = (found[0] + found[1]) // 2 + 1
                n = blk * NT + found[0]
                c = i - (ends[found[0]] - counts[found[0]])
                bounds[carry[0] + i, 0] = cu_seqlens[n] + c * C
                bounds[carry[0] + i, 1] = T.min(cu_seqlens[n + 1] - cu_seqlens[n] - c * C, C)

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
            found = T.alloc_local((4,), "int32")  # the bisection's interval, the block's slot count, a probe
            tx = T.get_thread_binding()
            sequence_scan(num_seqs, lambda n: T.ceildiv(cu_seqlens[n + 1] - cu_seqlens[n], C),
                          lambda n, mine: write_first_slot(n, mine, first_slot),
                          counts, ends, carry, mine,
                          lambda blk, tx: write_block_slots(blk, tx, cu_seqlens, bounds, counts, ends, carry, found))
            T.sync_threads()
            mine[0] = carry[0]
            for blk in T.serial(T.ceildiv(num_slots, NT)):
                s = blk * NT + tx
                if s < num_slots:
                    if s >= mine[0]:
                        bounds[s, 0] = 0
                        bounds[s, 1] = 0

    return tilelang.compile(chunk_plan_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())
