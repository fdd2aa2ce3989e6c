"""The Hopper backward's walk and per-chunk gradients in one kernel: one CTA per (sequence, value head) walks the
chunks last to first with the state gradient in registers, and makes every gradient of each chunk on the way.

Math (``reference/chunked_backward.py``), per chunk, S its start state (the states pass's), dS' the state gradient
at its end (carried from the chunk after it), gamma_i = exp(g~_i), d_i = exp(g~_last - g~_i), Gam_ij = exp(g~_i - g~_j):

    P = scale Gam ⊙ Q K^T (i >= j)      KS = K S      W = V - diag(gamma) KS      Vn = Ag W
    dVn = diag(d) K dS' + P^T dO        dW = Ag^T dVn = dV
    dAg = (dVn W^T) (i >= j)            dP = (dO Vn^T) (i >= j)      dQK = scale Gam ⊙ dP
    E = dAg ⊙ Gam     dA = E ⊙ (1 beta^T)     dL = -(A^T dA A^T) (i > j)     dKK = diag(beta) dL
    dQ = dQK K + scale diag(gamma) dO S^T
    dK = dQK^T Q - diag(gamma) dW S^T + diag(d) Vn dS'^T + (dKK + dKK^T) K
    dbeta_j = sum_i (E ⊙ A)_ij + sum_k (dL ⊙ K K^T)_jk
    dS^T = gamma_C dS'^T - (diag(gamma) dW)^T K + (scale diag(gamma) dO)^T Q        (the chain)

and dg as ``chunk_grad.py`` writes it (row terms, the g~_last terms, a reverse cumsum over the chunk). These are
``chunk_grad``'s formulas; what changes is that dS' never leaves the CTA (no ``ds_end`` buffer, 512 B per token and
value head, and no walk kernel), and that the per-chunk work runs N x Hv CTAs instead of one CTA per chunk.

Roles (512 threads; the split of the state gradient from the two sides of the per-chunk work follows FlashQLA's
Hopper backward, read for its structure):
* warpgroup 0, ``state``: dS^T [V, K] float32 in registers (all of it: 128 per thread); per chunk it writes dS'^T
  in bf16 for the others, scales by gamma_C, makes the chain's scale gamma ⊙ dO (and d ⊙ Vn for the value side's
  dk) and adds the chain's two products;
* warpgroup 1, ``value side``: K dS', P^T dO -> dVn; Ag^T dVn -> dW (dv); the S^T products of dq and dk, dq, dk;
  the gate's row terms that use these;
* warpgroup 2, ``gate side``: Q K^T -> P, K S -> W, Ag W -> Vn, dVn W^T, dO Vn^T -> dQK, the inverse's dL -> dKK,
  dbeta, and dg (its reverse cumsum a serial sum per token);
* warpgroup 3, producer: each chunk's tiles, last chunk first, single-buffered in three groups, each loaded for
  the next chunk as soon as its last reader in this one is done: V, Ag and S^T (once Vn, dW and the S^T products
  are made); Q, dO, A, g~ and beta (once the chain, dq's and dk's Q products and the inverse's dL are); K once
  the gate side's K K^T, the chain and the value side's dk products are done.

All warpgroups step through a chunk together on mbarriers (one completion per chunk each). Shared memory is 26
tiles of 8 KB placed by hand: the loop keeps every buffer alive across chunks, so TileLang cannot overlap them,
and each tile takes the next value once its last reader is done (P's tile then holds dQK, dVn's -gamma ⊙ dW, dA's
A^T dA and then dKK, W's the chain's scale gamma ⊙ dO, dO's d ⊙ Vn, V's dv and Vn's dq and then dk on their way
out).

Measured on the H200 (``docs/hopper-notes.md``, v0.14 and v0.15): ~13.8 us per chunk step of a CTA where its CTAs
fill the GPU at v0.15c, 12.4 at v0.15d on 16/32 (v0.14: 20.7; the walk's 3.5 and ``chunk_grad``'s 20.8 SM-us per
chunk together), so the backward takes 0.64x-0.65x the two kernels' time on 256-512 CTAs (v0.15c), with 0.75x their
peak memory, and loses where a few long walks set the time; ``backward.fused_backward_wanted`` chooses. What v0.15
changed, from the trace build's timeline: no loop over an accumulator that writes shared memory (TileLang puts a
warpgroup barrier in each of its unrolled steps), batched column sums, V swizzled, dg's reverse cumsum as a serial
sum, the chain's scale gamma ⊙ dO made by the state warpgroup, dq and dk stored in 16-byte rows through Vn's tile
and dv through V's, P released before W is made, K freed by the gate side at its last read, d ⊙ Vn made by the state
warpgroup. The value side is the longer path (its wait for P, its row terms, the S^T products).

PyTorch counterpart: ``flashgdn.reference.chunked_backward.chunk_gated_delta_rule_backward_reference`` (steps 1 and 2).
"""

from .common import CHUNK, LOG2E, TARGET, head_order_total, kernel_cache, pass_configs

#: registers per thread of each role (512 in all): the state side holds 128 for dS^T; the value side two [64, 128]
#: float32 tiles (at 160 it spilled 56 B, with a third tile 256 B and every wgmma serialised); the producer's masked
#: loads spilled at 24 and 32. Each split tried is in docs/hopper-notes.md (v0.14).
STATE_REGS, VALUE_REGS, GATE_REGS, PRODUCER_REGS = 160, 168, 144, 40
#: ``ag_from_a``'s gating: the 64 x 64 tile's 36 blocks of 8 x 8 on or below the diagonal, by the producer's 128
#: threads (a row of a block each, sixteen blocks a step), in this many steps (the last takes four blocks)
LOWER_BLOCKS, GATING_THREADS, LOWER_BLOCK_STEPS = 36, 128, 3


def lower_block_piece(step, thread, to_int=int):
    """``(block row, block column)`` of the 8 x 8 block whose row ``thread % 8`` producer thread ``thread`` (0-127)
    takes at ``step`` (0-2): block ``b = 16 step + thread // 8`` of the blocks on or below the diagonal numbered row by
    row (block row ``rb`` holds blocks ``rb (rb + 1) / 2`` to ``rb (rb + 1) / 2 + rb``); ``b`` past the last (35) is
    no block, and the thread skips that step (``lower_block_taken``). Eight threads on one block read and write its
    eight rows' 16-byte pieces of one column of pieces, which the tile's 128-byte swizzle puts on eight different bank
    groups. Written for Python ints (a test checks the cover) and for TIR expressions (``to_int`` then casts a
    comparison to int32)."""
    b = _lower_block_number(step, thread)
    rb = sum(to_int(b >= k * (k + 1) // 2) for k in range(1, 8))
    return rb, b - rb * (rb + 1) // 2


def lower_block_taken(step, thread):
    """Whether ``thread`` has a block at ``step`` (``lower_block_piece``'s ``b`` is one of the 36)."""
    return _lower_block_number(step, thread) < LOWER_BLOCKS


def _lower_block_number(step, thread):
    # b of lower_block_piece: eight threads a block, GATING_THREADS // 8 blocks a step
    return step * (GATING_THREADS // 8) + thread // 8


#: the gate side's column sums (dim 0 of a [64, 64] accumulator: across warps) are reduced this many columns at a
#: time, each batch through one shared workspace between two barriers (TileLang's default, one column at a time,
#: takes ~10 named barriers per column)
COLUMN_SUM_BATCH = 8

#: a trace build (``trace=True``) records the SM's cycle counter at these many points of each role's chunk step,
#: for the first TRACE_CHUNKS chunk steps of one CTA (``benchmarks/fused_backward_trace.py`` reads it): where the
#: ~20 us of a step go, role by role. The point numbers of each role are listed in ``TRACE_POINTS_OF``.
TRACE_CHUNKS, TRACE_POINTS = 32, 24
#: what each trace point of each role (state, value side, gate side, producer) marks
TRACE_POINTS_OF = (
    ('chunk step begins', "dS'^T written", 'g~ loaded', '-gamma dW ready', 'scaled dO written', 'd ⊙ Vn written', '(gamma dW)^T K done', 'chain done'),
    ('chunk step begins', "inputs and dS'^T ready", "K dS' done", 'P ready', 'dVn written', 'dW done', 'Vn ready', 'row terms done', 'dv stored, dVn free', '-gamma dW written', 'S^T products done', 'd ⊙ Vn and dQK ready', 'dq, dk products done', 'dq stored', 'dKK ready', 'dk products done'),
    ('chunk step begins', 'inputs ready', 'Q K^T, K S done', 'P, then W written', 'Vn written', 'dVn ready', 'dVn W^T, dO Vn^T done', 'E and dA stored', "dbeta's column sum done", 'E and dQK written', 'row and column sums done', 'K K^T, A^T dA done', 'dKK written', 'value-side row terms ready', 'dg and dbeta stored'),
    ('chunk step begins', 'V, Ag, S^T free', 'V, Ag, S^T issued', 'Q, dO, A, g~, beta free', 'Q, dO issued', 'K free', 'K issued', 'A, g~, beta issued',
     # cluster_sum's exchange of the step's dq and dk, by the producer's first warp during the next step
     'exchange: dq staged', 'exchange: the group ready', 'exchange: dq rows sent', 'exchange: dq rows landed', 'exchange: its dq quarter summed', 'exchange: every dq quarter summed', 'exchange: dk staged', 'exchange: the group summed dq', 'exchange: dk rows landed', 'exchange: its dk quarter summed', 'exchange: its dk rows landed everywhere'),
)

#: and, once per CTA, the state side's edges of its walk, in the last four points of chunk step 0's row (past every
#: role's per-step points): the CTA's start, dht read into registers, the last step done, dh0 written. What a CTA costs
#: beside its steps (the cost model's per-item term, larger on short segments than fitted).
TRACE_EDGES = ('state side begins', 'dht read', 'last step done', 'dh0 written')

#: ``cluster_sum``'s largest group: a cluster of more than eight CTAs is not portable on SM90
CLUSTER_SUM_MAX_GROUP = 8

#: device helpers of the ``cluster_sum`` build: rows of a [64, 128] 2-byte tile sent to the same rows' place of
#: another CTA's tile by bulk shared-to-shared copies, and arrivals on another CTA's mbarrier. The tiles are stored as
#: two [64, 64] halves of 128-byte rows with the 128-byte swizzle (what TileLang lays out for these wgmma operands;
#: the swizzle depends on the row modulo 8, so a block of rows starting at a multiple of 8 moves as two contiguous
#: byte ranges and lands where the receiver's layout expects it: ``test_cluster_sum_gives_the_group_sums_bits``).
CLUSTER_PRELUDE = r"""
namespace flashgdn_cluster {
__device__ __forceinline__ unsigned peer_address(const void *local, int peer) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(local)), r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(peer));
  return r;
}
// one arrival on the same mbarrier of CTA ``peer``. Every such signal here says that a tile may be written (its reads
// are done and were ordered before by a local barrier) or that rows have landed (the bulk copy's own completion):
// none publishes this thread's writes, so the arrival keeps the default CTA-scope release; a cluster-scope release
// would wait for the thread's outstanding global stores (the sums') at every signal
template <typename Bar> __device__ __forceinline__ void arrive_on_peer(Bar *bar, int peer) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(peer_address(bar, peer)) : "memory");
}
// rows [src_row, src_row + rows) of this CTA's tile ``src`` to rows [dst_row, dst_row + rows) of tile ``dst`` in CTA
// ``peer``: one arrival there on ``bar`` expecting the bytes, which the two copies complete
template <typename Bar> __device__ __forceinline__ void push_rows(void *dst, void *src, int src_row, int dst_row,
                                                                  int rows, int peer, Bar *bar) {
  unsigned bytes = rows * 128u;
  unsigned b = peer_address(bar, peer), d = peer_address(dst, peer);
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(src));
  asm volatile("mbarrier.arrive.expect_tx.shared::cluster.b64 _, [%0], %1;" :: "r"(b), "r"(2u * bytes) : "memory");
  for (int half = 0; half < 2; ++half) {
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(d + half * 8192u + dst_row * 128u), "r"(s + half * 8192u + src_row * 128u), "r"(bytes),
                    "r"(b) : "memory");
  }
}
}  // namespace flashgdn_cluster
"""

#: device helpers of the ``pair_sums`` build: 16 bytes of a staged 2-byte tile added into global memory by one vector
#: reduction (``red.global.add.noftz.v4.{bf16x2,f16x2}``, SM90). With two addends onto a zeroed output the result
#: is RN(RN(0 + a) + b) = RN(a + b) whichever lands first: deterministic, and the value ``group_sum.py`` makes of the
#: same two addends (its float32 sum of two 2-byte values is exact unless their exponents are 16 or more apart).
PAIRS_PRELUDE = r"""
namespace flashgdn_pairs {
__device__ __forceinline__ void add_16_bytes_bf16(void *dst, const void *src) {
  uint4 x = *reinterpret_cast<const uint4 *>(src);
  asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};"
               :: "l"(dst), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w) : "memory");
}
__device__ __forceinline__ void add_16_bytes_f16(void *dst, const void *src) {
  uint4 x = *reinterpret_cast<const uint4 *>(src);
  asm volatile("red.global.add.noftz.v4.f16x2 [%0], {%1, %2, %3, %4};"
               :: "l"(dst), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w) : "memory");
}
}  // namespace flashgdn_pairs
"""


@kernel_cache
def build_fused_backward(Hqk: int, Hv: int, K: int, V: int, io_dtype: str, has_final_grad: bool, trace: bool = False,
                         p_first: bool = False, lean_gates: bool = False, cluster_sum: bool = False,
                         first_apart: bool = False, pair_sums: bool = False, p_given: bool = False,
                         fold_mma: bool = False, longest_first: bool = False, ag_from_a: bool = False):
    """Compile (or load) the kernel (``trace``: with a last argument ``tr [4, TRACE_CHUNKS, TRACE_POINTS]`` int64, after
    ``p_given``'s P where it is given,
    written by the CTA of value head 0 and sequence 0, the per-phase cycle stamps of ``TRACE_POINTS_OF``; a
    diagnostic build, the same gradients). ``p_first`` (``backward.FUSED_P_FIRST``; with ``lean_gates`` the default
    wherever P is not given): the gate side waits for Q K^T alone, makes and releases P, and only then waits for K S,
    instead of waiting for both at once (the same values). ``lean_gates`` (``backward.FUSED_LEAN_GATES``): the gating of P, E and dQK reads g~
    into register fragments of the gate side's rows and columns (before P, and again before E) instead of from shared
    memory twice per element (the same values and operations, so the same bits; ptxas keeps two more values of the
    gate side on the stack, stored and reloaded once a chunk, against ~190 shared loads a thread saved; beta's column
    factors the same way spilled far more and stay as they are). ``cluster_sum`` (``backward.FUSED_CLUSTER_SUM``,
    for groups of 2 to ``CLUSTER_SUM_MAX_GROUP``): the CTAs of a qk head's value heads run as one thread-block
    cluster and sum dq and dk over the group inside the kernel: each CTA owns ``64 / group`` rows of a chunk, every
    CTA sends it those rows of its bf16 dq (then dk) by a bulk shared-memory copy, and the owner adds them in head
    order in float32 and writes the sum: ``group_sum.py``'s arithmetic on the same addends, so the same bits, with
    neither the per-value-head dq and dk buffers nor the group-sum pass. The value side only stages dq and dk in
    Vn's tile; the producer's first warp sends the rows (after issuing the next chunk's loads) and the four producer
    warps sum a quarter each; both land in dVn's tile, free from the state side's chain to the value side's next
    dVn. A memory option, off by default: the same bits at 0.86x-0.88x a training step's peak, but the kernel takes
    1.25x-1.57x its time (notes v0.18). Arguments, in order:

      q, k       [1, T, Hqk, K]   io dtype (normalised as the forward used them)
      v, do      [1, T, Hv, V]    io dtype
      gcum       [Hv, 64 S]       float32, stage 1's per-slot cumsum
      beta       [1, T, Hv]       float32
      Ag, A      [S, Hv, 64, 64]  io dtype, stage 1's gated and ungated inverses
      cu_seqlens [N + 1] int32, first_slot [N] int32 (``forward.chunk_plan``)
      states     [S, Hv, V, K]    io dtype: S^T at every chunk's start (the states pass)
      dht        [n, Hv, K, V]    float32, the final state's gradient (K-major; read only if has_final_grad)
      scale      float32
      dv         [1, T, Hv, V]    io dtype, written
      dq, dk     [1, T, Hv, K]    io dtype, written per value head (the caller sums each qk head's group); with
                 ``cluster_sum`` [1, T, Hqk, K], the sums themselves; with ``pair_sums`` [1, T, Hv / 2, K], zeroed
                 by the caller and added into
      dg, dbeta  [1, T, Hv]       float32, written
      dh0        [N, Hv, K, V]    float32, written: the gradient at every sequence's start (K-major)

    ``pair_sums`` (``backward.FUSED_PAIR_SUMS``, for even groups): the value side adds its staged dq and dk rows into
    head h // 2 of a zeroed output with one 16-byte vector reduction per thread and row piece (``PAIRS_PRELUDE``)
    instead of storing them: value heads 2p and 2p + 1 meet there as RN(a + b), deterministic, and in a group of two
    the group sum's value, with no group-sum pass after the kernel (notes v0.26a).

    ``first_apart`` (``backward.FIRST_STATES_APART``): every sequence's first chunk state is not in ``states`` but
    in rows 0..V-1 of ``first_states [N, Hv, 2 V, K]`` (io dtype), two last arguments with ``shift`` (int32):
    chunk c >= 1 of sequence n is ``states[first_slot[n] + c - shift (n + 1)]`` (``chunk_forward_rs.py``'s option
    of the same name writes them so). ``first_states`` is ``dh0``'s memory seen as 2-byte values: the producer
    loads sequence n's first S^T from it for the CTA's last chunk step, and the state side writes dh0[n, h] over it
    only after that step's ``ydw_ready``, which the value side arrives after its ``full_e`` wait, so after the load
    has landed; no other CTA reads [n, h]. The states tensor is then S - N slots instead of S.

    ``p_given`` (``backward.FUSED_P_GIVEN``; not with ``cluster_sum``): P = scale Gam ⊙ Q K^T (lower),
    what the gate side otherwise makes first in each chunk step, is given as a last argument ``p [S, Hv, 64, 64]`` in
    the io dtype (``gated_scores.py`` makes it with this kernel's product and expression: the same bits) and loaded
    with the second group, so that neither side waits for it: the gate side makes K S alone and the value side's
    P^T dO starts once its K dS' is done (0.89x the kernel's time at 16/32, notes v0.28a-b).

    ``fold_mma`` (``backward.FUSED_FOLD_MMA``): the value side's fold <dS', S> (dg's g~_last term; only its total
    counts) by the tensor cores instead of element-wise: <dS', S> is the trace of dS'^T S, i.e. the sum of the
    diagonals of the two [64, 64] blocks dS'^T[r] (S^T[r])^T of V's halves r, which two wgmma groups (m64n64k16, eight
    K steps each, issued right after K dS') add into one [64, 64] accumulator; the value side scales K dS' by d while
    they run. ~2 MFLOP more on the tensor pipe against ~500 instructions of the value side a step (256 element-wise
    2-byte reads, their unpacks and products, v0.28a's profile). The same products of bf16 values, summed in another
    order: dg moves by float32 rounding, the rest keeps its bits. Beside ``p_given`` the gate side makes it instead,
    into Q K^T's accumulator (P is given, so that accumulator is free), issued after K S and read out while the
    value side makes dVn; its row sums reach dg through a vector of their own (on the value side ptxas serialised
    the kernel's wgmma there for want of registers). On the gate side where P is not given too (issued once P is
    out), it was slower: the gate side's path is the one the value side waits for there (notes v0.30d).

    ``longest_first`` (with ``first_apart``; ``backward.FUSED_LONGEST_FIRST``, an A/B): a last argument ``order
    [sequences]`` int32, a permutation of the sequences (or segments), and the CTAs of row y of the grid work on
    sequence ``order[y]``. The GPU starts a grid's CTAs in order as SMs come free, so with the sequences longest first
    (``torch.argsort`` of their lengths) a long one no longer starts after the short ones have taken the SMs: the
    kernel's time tends to its longest CTA where its CTAs are uneven and more than the SMs (LPT scheduling). Every CTA
    computes what it did, so the same bits.

    ``ag_from_a`` (``backward.FUSED_AG_FROM_A``, an A/B): the kernel reads A alone and makes Ag itself, so that the
    backward can let stage 1's Ag go before this kernel's outputs exist (128 B per token and value head fewer at the
    backward's peak). The ``Ag`` argument is then not read (the host passes A there too). The producer's first warp
    loads A's tile into Ag's by TMA and, once it has landed, the producer's 128 threads gate it in place with stage
    1's expression ``a * beta_j * exp2(min(g~_i - g~_j, 0) log2 e)`` (``kkt_inverse.py``'s ``gated``): the 36 blocks
    of 8 x 8 on or below the diagonal (A is zero above them), 16 bytes a thread in 3 steps (``lower_block_piece``),
    g~ and beta of the chunk from two vectors of the producer's own (1 KB of shared memory, two chunks' worth) that it
    fills before the wait for the tile's release. Warps 13-15 are free for it: the V, Ag, S^T group is released
    well before their groups (notes v0.37b; v0.37a's one gating warp put ~9k cycles between the release and the
    signal). The one difference from stage 1's Ag is that ``a`` is A as stored, rounded to the io dtype, where stage
    1 gates the float32 inverse: at most one rounding of the io dtype apart per element (not the same bits). The V,
    Ag, S^T group is signalled after the gating, later than the load alone would be. Not beside ``cluster_sum``.
    """
    import tilelang
    import tilelang.language as T

    C = CHUNK
    assert K == 128 and V == 128, "the kernel is written for K = V = 128"
    group = Hv // Hqk
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_slots = T.dynamic("num_slots")
    slot_rows = T.dynamic("slot_rows")
    n_dht = T.dynamic("n_dht")
    # the states' own count when the first ones are apart (S - N or S, as ``shift`` says), else the slots'
    num_states = T.dynamic("num_states") if first_apart else num_slots
    if first_apart and trace:
        raise ValueError("the trace build reads every chunk state from the states tensor (first_apart off)")
    if longest_first and not first_apart:
        raise ValueError("longest_first is built beside first_apart (the operator's default) only")
    assert not (cluster_sum and p_given), "p_given is not built beside cluster_sum"
    # (cluster_sum's producer warps sum the chunk before's rows after their loads; beside the gating, untried)
    assert not (cluster_sum and ag_from_a), "ag_from_a is not built beside cluster_sum"
    # beside p_given the gate side folds, into Q K^T's accumulator (free there): on the value side ptxas serialised
    # the kernel's wgmma for want of registers (C7512)
    fold_on_gates = fold_mma and p_given
    acc = "float32"
    if pair_sums:
        assert group % 2 == 0 and not cluster_sum, "pair_sums needs an even group and not cluster_sum"
    if cluster_sum:
        assert 2 <= group <= CLUSTER_SUM_MAX_GROUP and C % (8 * group) == 0, "cluster_sum needs a group of 2 to 8"
    # a plain launch unless cluster_sum (None and None are T.Kernel's defaults: the same kernel as without them)
    cluster_dims = (group, 1, 1) if cluster_sum else None
    prelude = CLUSTER_PRELUDE if cluster_sum else PAIRS_PRELUDE if pair_sums else None
    dq_heads = Hqk if cluster_sum else Hv // 2 if pair_sums else Hv
    add_16_bytes = "flashgdn_pairs::add_16_bytes_" + ("bf16" if io_dtype == "bfloat16" else "f16")
    own_rows = C // group  # cluster_sum: the rows of a chunk each CTA of a group sums and writes

    @T.macro
    def masked_rows(src, dst, t0, n_rows, hh, D):
        # a sequence's last, partial chunk: rows past its end are zeros (they belong to the next sequence)
        for i in T.serial(C):
            for j in T.Parallel(D):
                dst[i, j] = T.if_then_else(i < n_rows, src[0, t0 + i, hh, j], T.cast(0, io_dtype))
        T.fence_proxy_async()

    @T.macro
    def gates_in(ge_s, be_s, gcum, beta, c, slot, t0, n_rows, h, p):
        # ag_from_a: the chunk's g~ (threads 0-63) and beta (64-127; zero past the sequence's end, as stage 1 loads
        # it) into the chunk parity's half of two vectors of the producer's own, before the wait for the V, Ag, S^T
        # group's release: the loads' latency passes during the wait. Two halves, because a thread may fill chunk c's
        # while another still gates chunk c - 1 (none can be two chunks ahead: each chunk's a_in waits for all 128)
        if p < C:
            ge_s[c % 2, p] = gcum[h, slot * C + p]
        else:
            be_s[c % 2, p - C] = T.if_then_else(p - C < n_rows, beta[0, t0 + p - C, h], 0.0)

    @T.macro
    def gate_in_place(ag_s, ge_s, be_s, a_in, full_e, av, blk, c, p):
        # ag_from_a: A's tile (its TMA issued by the first warp on a_in) made Ag in place by the producer's 128
        # threads once it has landed, and their g~ and beta written (a_in counts the 128 arrivals): the 36 blocks of
        # 8 x 8 on or below the diagonal (the rest of A is zero and stays so), 16 bytes a thread per step
        # (``lower_block_piece``); then each thread fences its writes for the tensor cores and arrives on full_e
        # (which counts the 128, so the group is ready once every piece is gated and V and S^T have landed)
        T.barrier_arrive(a_in)
        T.barrier_wait(a_in, c % 2)
        for step in T.serial(LOWER_BLOCK_STEPS):
            if lower_block_taken(step, p):
                # the block's row and column once a step (in registers: the swizzled addresses below use them 4 times)
                blk[0], blk[1] = lower_block_piece(step, p, lambda b: T.cast(b, "int32"))
                for e in T.vectorized(8):
                    av[e] = ag_s[blk[0] * 8 + p % 8, blk[1] * 8 + e]
                for e in T.unroll(8):  # (unrolled: av stays in registers)
                    av[e] = T.cast(T.cast(av[e], acc) * be_s[c % 2, blk[1] * 8 + e]
                                   * T.exp2(T.min(ge_s[c % 2, blk[0] * 8 + p % 8] - ge_s[c % 2, blk[1] * 8 + e], 0.0)
                                            * LOG2E), io_dtype)
                for e in T.vectorized(8):
                    ag_s[blk[0] * 8 + p % 8, blk[1] * 8 + e] = av[e]
        T.fence_proxy_async()
        T.barrier_arrive(full_e)

    @T.macro
    def add_rows(src_s, dst, t0, n_rows, hp, lane):
        # pair_sums: the staged [C, K] tile added to rows t0.. of pair hp, 16 bytes a thread per step: a warp covers
        # two whole rows (512 contiguous bytes of each), the 128 threads eight rows a step
        for step in T.serial(C * K // (8 * 128)):
            r = step * 8 + lane // 16
            col = (lane % 16) * 8
            if r < n_rows:
                T.call_extern("handle", add_16_bytes, T.address_of(dst[0, t0 + r, hp, col]),
                              T.address_of(src_s[r, col]))

    @T.macro
    def edge_stamp(tr, edge, tx, h, n):
        # trace builds only: the state side's edges (``TRACE_EDGES``), in chunk step 0's last points
        if trace:
            if h == 0 and n == 0 and tx == 0:
                tr[0, 0, TRACE_POINTS - len(TRACE_EDGES) + edge] = T.call_extern("int64", "clock64")

    @T.macro
    def stamp(tr, role, point, c, tx, h, n):
        # trace builds only: the SM's cycle counter at ``point`` of chunk step c, by one thread of the role, in the
        # CTA of value head 0 and sequence 0
        if trace:
            if h == 0 and n == 0 and c < TRACE_CHUNKS and tx % (32 if role == 3 else 128) == 0:
                tr[role, c, point] = T.call_extern("int64", "clock64")

    @T.macro
    def gates_to_fragments(gc_s, grow_f, gcol_f):
        # ``lean_gates``: g~ of the chunk into the fragments of a thread's rows and columns of a [C, C] accumulator
        for i in T.Parallel(C):
            grow_f[i] = gc_s[i]
        for j in T.Parallel(C):
            gcol_f[j] = gc_s[j]

    def g_last_terms(x1_s, xf_s, j):
        # token j's g~_last terms: the value side's, and with the fold on the gate side its share too
        return x1_s[j] + xf_s[j] if fold_on_gates else x1_s[j]

    def group_total(in_s, i, j):
        # row i of this CTA's share from every CTA of the group (CTA r's at rows r * own_rows..): group_sum.py's total
        return head_order_total([in_s[r * own_rows + i, j] for r in range(group)], acc, io_dtype)

    @T.macro
    def send_rows(out_s, in_s, landed, rank, lane):
        # one lane sends rows p * own_rows.. of out_s to CTA p of the group (itself included), into the rows of in_s
        # that this CTA's rank owns there, the bytes expected on that CTA's ``landed``
        if lane == 0:
            for p in range(group):
                T.call_extern("handle", "flashgdn_cluster::push_rows", T.address_of(in_s[0, 0]),
                              T.address_of(out_s[0, 0]), p * own_rows, rank * own_rows, own_rows, p,
                              T.address_of(landed[0]))

    @T.macro
    def heard(read, lane):
        # every CTA of the group hears that its rows have landed here (its Vn tile is free of this CTA's copies)
        if lane == 0:
            for p in range(group):
                T.call_extern("handle", "flashgdn_cluster::arrive_on_peer", T.address_of(read[0]), p)

    @T.macro
    def sum_rows(src_s, dst, t0, n_rows, h, quarter):
        # a quarter of this CTA's rows of the chunk, from every CTA of the group (in src_s, rows r * own_rows.. from
        # CTA r), summed in head order and written by one producer warp, two rows at a time (a 16-byte vector a lane:
        # the warp's 40 registers)
        hq = h // group
        rank = h % group
        for r2 in T.serial(own_rows // 8):
            for i, j in T.Parallel(2, K):
                if rank * own_rows + quarter * (own_rows // 4) + r2 * 2 + i < n_rows:
                    dst[0, t0 + rank * own_rows + quarter * (own_rows // 4) + r2 * 2 + i, hq, j] = group_total(
                        src_s, quarter * (own_rows // 4) + r2 * 2 + i, j)

    @T.macro
    def sum_share(dvn_s, dq, dk, q_in, k_in, q_summed, rows_summed, c, t0, n_rows, h, quarter):
        # cluster_sum, producer warps 13-15, each once its next chunk's loads are issued: its quarter of chunk c's dq
        # rows, then of dk's, as they land in dVn's tile
        T.barrier_wait(q_in, c % 2)
        sum_rows(dvn_s, dq, t0, n_rows, h, quarter)
        T.barrier_arrive(q_summed)
        T.barrier_wait(k_in, c % 2)
        sum_rows(dvn_s, dk, t0, n_rows, h, quarter)
        T.barrier_arrive(rows_summed)

    @T.macro
    def exchange_one(vn_s, dvn_s, out, staged, may_land, landed, read, done, c, t0, n_rows, h, rank, lane, tr, n, tx,
                     points):
        # one tensor of the exchange (dq, then dk): once the value side has staged it in Vn's tile (``staged``) and
        # dVn's tile may take the group's rows (``may_land``), its rows sent to their owners; once this CTA's rows
        # from every CTA have landed (``landed``), every sender told (``read``), this warp's quarter summed and
        # ``done`` arrived. ``points``: its trace points (staged, may land, sent or None, landed, summed)
        T.barrier_wait(staged, c % 2)
        stamp(tr, 3, points[0], c, tx, h, n)
        T.barrier_wait(may_land, c % 2)
        stamp(tr, 3, points[1], c, tx, h, n)
        send_rows(vn_s, dvn_s, landed, rank, lane)
        if points[2] is not None:
            stamp(tr, 3, points[2], c, tx, h, n)
        T.barrier_wait(landed, c % 2)
        stamp(tr, 3, points[3], c, tx, h, n)
        heard(read, lane)
        sum_rows(dvn_s, out, t0, n_rows, h, 0)
        stamp(tr, 3, points[4], c, tx, h, n)
        T.barrier_arrive(done)

    @T.macro
    def exchange(vn_s, dvn_s, dq, dk, ready, k_ready, q_staged, k_staged, q_in, k_in, q_read, k_read, q_summed,
                 rows_summed, vn_free, c, t0, n_rows, h, lane, tr, n, tx):
        # cluster_sum, producer warp 12 once it has issued the next chunk's loads: chunk c's dq, then dk, staged by the
        # value side in Vn's tile, sent to their owners; this CTA's rows from every CTA summed in head order and
        # written by the four producer warps (a quarter each: one warp alone took ~6k cycles, latency-bound, v0.18c).
        # Both land in dVn's tile (free from the chain to the value side's next dVn: ``ready``), dk's once every CTA
        # has summed dq's (``k_ready``), so that the value side, the step's longer path, only stages and goes on
        rank = h % group  # the CTA's place in its cluster: the value heads of hq, in order
        exchange_one(vn_s, dvn_s, dq, q_staged, ready, q_in, q_read, q_summed, c, t0, n_rows, h, rank, lane, tr, n,
                     tx, (8, 9, 10, 11, 12))
        T.barrier_wait(q_summed, c % 2)
        stamp(tr, 3, 13, c, tx, h, n)
        heard(k_ready, lane)
        exchange_one(vn_s, dvn_s, dk, k_staged, k_ready, k_in, k_read, rows_summed, c, t0, n_rows, h, rank, lane, tr,
                     n, tx, (14, 15, None, 16, 17))
        # the Vn tile's copies of dk have landed everywhere: the gate side may write the next Vn
        T.barrier_wait(k_read, c % 2)
        stamp(tr, 3, 18, c, tx, h, n)
        T.barrier_arrive(vn_free)

    @T.macro
    def fused_backward_body(q, k, v, do, gcum, beta, Ag, A, cu_seqlens, first_slot, states, dht, scale, dv, dq, dk,
                            dg, dbeta, dh0, tr, first_states=None, shift=None, p_in=None, order=None):
        with T.Kernel(Hv, num_seqs, threads=512, prelude=prelude, cluster_dims=cluster_dims) as (h, n):
            if longest_first:  # this row of the grid works on the sequence the order puts here
                n = order[n]
            hq = h // group
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            n_chunks = T.ceildiv(eos - bos, C)

            # ---- 26 tiles of 8 KB (see the module docstring for what each holds when)
            q_s = T.alloc_shared((C, K), io_dtype)
            k_s = T.alloc_shared((C, K), io_dtype)
            v_s = T.alloc_shared((C, V), io_dtype)  # V, then dv on its way out
            do_s = T.alloc_shared((C, V), io_dtype)  # dO, then d ⊙ Vn
            st_s = T.alloc_shared((V, K), io_dtype)  # S^T
            ag_s = T.alloc_shared((C, C), io_dtype)
            a_s = T.alloc_shared((C, C), io_dtype)
            ds_s = T.alloc_shared((V, K), io_dtype)  # dS'^T
            p_s = T.alloc_shared((C, C), io_dtype)  # P, then dQK
            dvn_s = T.alloc_shared((C, V), io_dtype)  # dVn, then -gamma ⊙ dW
            w_s = T.alloc_shared((C, V), io_dtype)  # W, then scale gamma ⊙ dO
            vn_s = T.alloc_shared((C, V), io_dtype)  # Vn, then dq, then dk
            da_s = T.alloc_shared((C, C), io_dtype)  # dA, then A^T dA, then dKK
            # ---- per-token vectors
            gc_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            gam_s = T.alloc_shared((C,), acc)  # gamma_i and d_i, the state side's own
            dec_s = T.alloc_shared((C,), acc)
            x0_s = T.alloc_shared((C,), acc)  # dg~'s row terms from the value side
            x1_s = T.alloc_shared((C,), acc)  # the g~_last terms per token (their total is what counts)
            if fold_on_gates:
                xf_s = T.alloc_shared((C,), acc)  # the fold's share of them, from the gate side
            else:
                xf_s = None  # (read by g_last_terms only where the gate side folds)
            xr_s = T.alloc_shared((C,), acc)  # row and column sums of X = P ⊙ dP + E ⊙ A ⊙ beta
            xc_s = T.alloc_shared((C,), acc)
            z_s = T.alloc_shared((C,), acc)  # the row terms of dg~ whose reverse cumsum it is
            db1_s = T.alloc_shared((C,), acc)
            db2_s = T.alloc_shared((C,), acc)
            if ag_from_a:  # the producer's own g~ and beta of the chunk, by chunk parity (gates_in)
                ge_s = T.alloc_shared((2, C), acc)
                be_s = T.alloc_shared((2, C), acc)
            else:
                ge_s = be_s = None

            # V, Ag, S^T loaded (and, with ag_from_a, Ag gated by the producer's 128 threads)
            full_e = T.alloc_barrier(arrive_count=128 if ag_from_a else 32)
            full_m = T.alloc_barrier(arrive_count=64)  # Q, dO, A, g~, beta loaded
            full_k = T.alloc_barrier(arrive_count=32)  # K loaded
            if ag_from_a:
                a_in = T.alloc_barrier(arrive_count=128)  # A's tile landed in Ag's, g~ and beta written: to gate
            else:
                a_in = None
            free_e = T.alloc_barrier(arrive_count=256)  # the value and gate sides done with V, Ag, S^T
            free_m = T.alloc_barrier(arrive_count=384)  # every side done with Q, dO, A, g~, beta
            free_k = T.alloc_barrier(arrive_count=384)  # K read for the last time by every side
            ds_ready = T.alloc_barrier(arrive_count=128)
            ds_free = T.alloc_barrier(arrive_count=128)
            p_ready = T.alloc_barrier(arrive_count=128)  # P
            dvn_ready = T.alloc_barrier(arrive_count=128)
            vn_ready = T.alloc_barrier(arrive_count=128)
            dag_done = T.alloc_barrier(arrive_count=128)  # dVn read for the last time (dVn W^T)
            ydw_ready = T.alloc_barrier(arrive_count=128)
            dp_done = T.alloc_barrier(arrive_count=128)  # dQK in P's tile; Vn's and dO's tiles read for the last time
            # the value side's dq and dk out of Vn's tile (cluster_sum: the exchange's warp, once they have landed)
            vn_free = T.alloc_barrier(arrive_count=32 if cluster_sum else 128)
            dos_done = T.alloc_barrier(arrive_count=128)  # the value side's dO S^T done (dO's last raw read)
            dvn_scaled = T.alloc_barrier(arrive_count=128)  # the state side's d ⊙ Vn in dO's tile
            dkk_ready = T.alloc_barrier(arrive_count=128)
            x_rows = T.alloc_barrier(arrive_count=128)
            if cluster_sum:
                # once per chunk each: every CTA of the group (itself included) arrives on ``ready`` when its dVn
                # tile may take rows (chain_done: the state side's chain and the value side's last dVn read), on
                # ``k_ready`` when it has summed dq's rows there, and on ``q_read`` / ``k_read`` of every sender when
                # its rows have landed (the sender's Vn tile is then free); ``q_in`` / ``k_in`` complete when every
                # CTA's rows of dq / dk have landed; q_staged / k_staged: the value side's dq / dk in Vn's tile;
                # rows_summed: dVn's tile free for the next chunk's dVn
                ready = T.alloc_cluster_barrier(arrive_count=group)
                k_ready = T.alloc_cluster_barrier(arrive_count=group)
                q_in = T.alloc_cluster_barrier(arrive_count=group)
                k_in = T.alloc_cluster_barrier(arrive_count=group)
                q_read = T.alloc_cluster_barrier(arrive_count=group)
                k_read = T.alloc_cluster_barrier(arrive_count=group)
                chain_done = T.alloc_barrier(arrive_count=256)
                q_staged = T.alloc_barrier(arrive_count=128)
                k_staged = T.alloc_barrier(arrive_count=128)
                q_summed = T.alloc_barrier(arrive_count=128)  # the four producer warps' dq rows summed
                rows_summed = T.alloc_barrier(arrive_count=128)

            # V is read in the accumulator's layout: unswizzled, its rows 256 B apart fall on the same banks
            T.annotate_layout({v_s: tilelang.layout.make_swizzled_layout(v_s)})

            tx = T.get_thread_binding()

            if tx < 128:
                # ================= state: dS^T [V, K] in registers, last chunk first
                T.set_max_nreg(STATE_REGS, 1)
                st_f = T.alloc_fragment((V, K), acc)
                gl = T.alloc_local((1,), acc)
                edge_stamp(tr, 0, tx, h, n)
                if has_final_grad:
                    for i, j in T.Parallel(V, K):
                        st_f[i, j] = dht[n, h, j, i]
                else:
                    T.clear(st_f)
                edge_stamp(tr, 1, tx, h, n)
                for c in T.serial(n_chunks):
                    stamp(tr, 0, 0, c, tx, h, n)
                    if c > 0:
                        T.barrier_wait(ds_free, (c + 1) % 2)
                    T.copy(st_f, ds_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(ds_ready)
                    stamp(tr, 0, 1, c, tx, h, n)
                    T.barrier_wait(full_m, c % 2)
                    stamp(tr, 0, 2, c, tx, h, n)
                    gl[0] = T.exp2(gc_s[C - 1] * LOG2E)
                    for i, j in T.Parallel(V, K):
                        st_f[i, j] = st_f[i, j] * gl[0]
                    for i in T.Parallel(C):
                        gam_s[i] = T.exp2(gc_s[i] * LOG2E)
                        dec_s[i] = T.exp2((gc_s[C - 1] - gc_s[i]) * LOG2E)
                    T.barrier_wait(full_k, c % 2)
                    T.barrier_wait(ydw_ready, c % 2)
                    stamp(tr, 0, 3, c, tx, h, n)
                    # W's last readers are done (the gate side's dVn W^T before -gamma dW, the value side's row terms):
                    # its tile takes scale gamma ⊙ dO, made here, where the value side would wait for it
                    for i, j in T.Parallel(C, V):
                        w_s[i, j] = T.cast(T.cast(do_s[i, j], acc) * scale * gam_s[i], io_dtype)
                    stamp(tr, 0, 4, c, tx, h, n)
                    # and dO's tile takes d ⊙ Vn for the value side's dk once its dO S^T (dO's last raw read) is done
                    T.barrier_wait(dos_done, c % 2)
                    for i, j in T.Parallel(C, V):
                        do_s[i, j] = T.cast(T.cast(vn_s[i, j], acc) * dec_s[i], io_dtype)
                    T.fence_proxy_async()
                    T.barrier_arrive(dvn_scaled)
                    stamp(tr, 0, 5, c, tx, h, n)
                    T.gemm(dvn_s, k_s, st_f, transpose_A=True)  # - (gamma dW)^T K
                    stamp(tr, 0, 6, c, tx, h, n)
                    T.gemm(w_s, q_s, st_f, transpose_A=True)  # + (scale gamma dO)^T Q
                    stamp(tr, 0, 7, c, tx, h, n)
                    T.barrier_arrive(free_m)
                    T.barrier_arrive(free_k)
                    if cluster_sum:
                        # dVn's tile is read for the last time this chunk (the chain's first product here, the
                        # value side's (gamma dW) S^T by its own arrival): the group may send rows into it
                        T.barrier_arrive(chain_done)
                        if tx == 0:
                            T.barrier_wait(chain_done, c % 2)
                            for p in range(group):
                                T.call_extern("handle", "flashgdn_cluster::arrive_on_peer", T.address_of(ready[0]), p)
                edge_stamp(tr, 2, tx, h, n)
                for i, j in T.Parallel(V, K):
                    dh0[n, h, j, i] = st_f[i, j]
                edge_stamp(tr, 3, tx, h, n)

            elif tx < 256:
                # ================= value side
                T.set_max_nreg(VALUE_REGS, 1)
                # two [C, 128] float32 tiles in turn (three would not fit the register budget): kd_f holds
                # diag(d) K dS', then products for row sums, then dk; dw_f a product, P^T dO, dW, then dq
                kd_f = T.alloc_fragment((C, V), acc)
                dw_f = T.alloc_fragment((C, V), acc)
                if fold_mma and not fold_on_gates:  # the fold's [64, 64] accumulator, live until its row sums
                    fd_f = T.alloc_fragment((C, C), acc)
                red_f = T.alloc_fragment((C,), acc)
                red2_f = T.alloc_fragment((C,), acc)
                # gamma_i and d_i for the thread's rows, once per chunk (not an exp2 per element)
                gam_f = T.alloc_fragment((C,), acc)
                dec_f = T.alloc_fragment((C,), acc)
                for c in T.serial(n_chunks):
                    t0 = bos + (n_chunks - 1 - c) * C
                    n_rows = T.min(eos - t0, C)
                    stamp(tr, 1, 0, c, tx, h, n)
                    T.barrier_wait(full_e, c % 2)
                    T.barrier_wait(full_m, c % 2)
                    T.barrier_wait(full_k, c % 2)
                    T.barrier_wait(ds_ready, c % 2)
                    stamp(tr, 1, 1, c, tx, h, n)
                    if fold_mma and not fold_on_gates:
                        T.wgmma_gemm(k_s, ds_s, kd_f, transpose_B=True, clear_accum=True)  # K dS'
                        # <dS', S>: the diagonals of dS'^T[r] (S^T[r])^T over V's halves r, in one accumulator
                        T.wgmma_gemm(ds_s[0:C, :], st_s[0:C, :], fd_f, transpose_B=True, clear_accum=True)
                        T.wgmma_gemm(ds_s[C:2 * C, :], st_s[C:2 * C, :], fd_f, transpose_B=True)
                        for i in T.Parallel(C):
                            gam_f[i] = T.exp2(gc_s[i] * LOG2E)
                            dec_f[i] = T.exp2((gc_s[C - 1] - gc_s[i]) * LOG2E)
                        T.wait_wgmma(2)
                        stamp(tr, 1, 2, c, tx, h, n)
                        for i, j in T.Parallel(C, V):
                            kd_f[i, j] = kd_f[i, j] * dec_f[i]
                        T.wait_wgmma(0)
                        for i, j in T.Parallel(C, C):
                            fd_f[i, j] = T.if_then_else(i == j, fd_f[i, j], 0.0)
                        T.reduce_sum(fd_f, red2_f, dim=1)
                    else:
                        T.gemm(k_s, ds_s, kd_f, transpose_B=True, clear_accum=True)  # K dS'
                        stamp(tr, 1, 2, c, tx, h, n)
                        for i in T.Parallel(C):
                            gam_f[i] = T.exp2(gc_s[i] * LOG2E)
                            dec_f[i] = T.exp2((gc_s[C - 1] - gc_s[i]) * LOG2E)
                        if not fold_on_gates:  # (else <dS', S> is the gate side's)
                            # <dS', S> folded onto 64 rows (V's halves added); only its total counts
                            for i, j in T.Parallel(C, K):
                                dw_f[i, j] = (T.cast(ds_s[i, j], acc) * T.cast(st_s[i, j], acc)
                                              + T.cast(ds_s[i + C, j], acc) * T.cast(st_s[i + C, j], acc))
                            T.reduce_sum(dw_f, red2_f, dim=1)
                        for i, j in T.Parallel(C, V):
                            kd_f[i, j] = kd_f[i, j] * dec_f[i]
                    if not p_given:
                        T.barrier_wait(p_ready, c % 2)
                    stamp(tr, 1, 3, c, tx, h, n)
                    T.gemm(p_s, do_s, dw_f, transpose_A=True, clear_accum=True)  # P^T dO
                    if cluster_sum:
                        # dVn's tile held the group's dq and dk rows of the chunk before until the exchange summed them
                        if c > 0:
                            T.barrier_wait(rows_summed, (c + 1) % 2)
                    for i, j in T.Parallel(C, V):
                        dvn_s[i, j] = T.cast(kd_f[i, j] + dw_f[i, j], io_dtype)
                    T.fence_proxy_async()
                    T.barrier_arrive(dvn_ready)
                    stamp(tr, 1, 4, c, tx, h, n)
                    T.gemm(ag_s, dvn_s, dw_f, transpose_A=True, clear_accum=True)  # dW = Ag^T dVn
                    stamp(tr, 1, 5, c, tx, h, n)
                    # dg~'s row terms that need kd_f or W: d_i <(K dS')_i, Vn_i> (g~_last too) and
                    # -gamma_i <dW_i, KS_i>, here, so that W's tile is free for the state side's scale gamma ⊙ dO once
                    # -gamma dW is out
                    T.barrier_wait(vn_ready, c % 2)
                    stamp(tr, 1, 6, c, tx, h, n)
                    for i, j in T.Parallel(C, V):
                        kd_f[i, j] = kd_f[i, j] * T.cast(vn_s[i, j], acc)
                    T.reduce_sum(kd_f, red_f, dim=1)
                    for i in T.Parallel(C):
                        if fold_on_gates:
                            x1_s[i] = red_f[i]
                        else:
                            x1_s[i] = red_f[i] + T.exp2(gc_s[C - 1] * LOG2E) * red2_f[i]
                        x0_s[i] = -red_f[i]
                    # gamma ⊙ KS = V - W (W as stored: the rounding W carries into Vn)
                    for i, j in T.Parallel(C, V):
                        kd_f[i, j] = dw_f[i, j] * (T.cast(v_s[i, j], acc) - T.cast(w_s[i, j], acc))
                    T.reduce_sum(kd_f, red_f, dim=1)
                    stamp(tr, 1, 7, c, tx, h, n)
                    # V's last reader was that row term (the gate side's W came before Vn): dv leaves through its
                    # tile in rows of 16 bytes, as dq and dk do through Vn's
                    T.copy(dw_f, v_s)
                    for i, j in T.Parallel(C, V):
                        if i < n_rows:
                            dv[0, t0 + i, h, j] = v_s[i, j]
                    T.barrier_wait(dag_done, c % 2)
                    stamp(tr, 1, 8, c, tx, h, n)
                    for i, j in T.Parallel(C, V):
                        dvn_s[i, j] = T.cast(-dw_f[i, j] * gam_f[i], io_dtype)
                    T.fence_proxy_async()
                    T.barrier_arrive(ydw_ready)
                    stamp(tr, 1, 9, c, tx, h, n)
                    # the S^T products: dq's state term scale diag(gamma) dO S^T (and its row term
                    # scale gamma_i <q_i, (dO S^T)_i>), then dk's -(gamma dW) S^T
                    T.gemm(do_s, st_s, dw_f, clear_accum=True)
                    T.barrier_arrive(dos_done)
                    for i, j in T.Parallel(C, K):
                        dw_f[i, j] = dw_f[i, j] * scale * gam_f[i]
                        kd_f[i, j] = dw_f[i, j] * T.cast(q_s[i, j], acc)
                    T.reduce_sum(kd_f, red2_f, dim=1)
                    for i in T.Parallel(C):
                        x0_s[i] = x0_s[i] - red_f[i] + red2_f[i]
                    T.gemm(dvn_s, st_s, kd_f, clear_accum=True)
                    T.barrier_arrive(free_e)
                    T.barrier_arrive(x_rows)
                    if cluster_sum:
                        T.barrier_arrive(chain_done)
                    stamp(tr, 1, 10, c, tx, h, n)
                    # d ⊙ Vn for dk comes from the state side, in dO's tile (a row scale of the accumulator between
                    # two GEMMs into it, the other way, makes ptxas serialise every wgmma)
                    T.barrier_wait(dvn_scaled, c % 2)
                    T.barrier_wait(dp_done, c % 2)
                    stamp(tr, 1, 11, c, tx, h, n)
                    # three products issued together, waited on once
                    T.wgmma_gemm(p_s, k_s, dw_f)  # dq += dQK K
                    T.wgmma_gemm(p_s, q_s, kd_f, transpose_A=True)  # dk += dQK^T Q
                    T.wgmma_gemm(do_s, ds_s, kd_f)  # dk += (d ⊙ Vn) dS'^T
                    T.wait_wgmma(0)
                    stamp(tr, 1, 12, c, tx, h, n)
                    T.barrier_arrive(ds_free)
                    T.barrier_arrive(free_m)
                    # dq and dk leave through Vn's tile (free until the gate side's next Vn, which waits on vn_free) in
                    # rows of 16 bytes: from the accumulator's layout a warp's store touches 8 rows, 16 bytes each
                    T.copy(dw_f, vn_s)
                    if cluster_sum:
                        T.fence_proxy_async()
                        T.barrier_arrive(q_staged)
                    elif pair_sums:
                        add_rows(vn_s, dq, t0, n_rows, h // 2, tx - 128)
                    else:
                        for i, j in T.Parallel(C, K):
                            if i < n_rows:
                                dq[0, t0 + i, h, j] = vn_s[i, j]
                    stamp(tr, 1, 13, c, tx, h, n)
                    T.barrier_wait(dkk_ready, c % 2)
                    stamp(tr, 1, 14, c, tx, h, n)
                    T.wgmma_gemm(da_s, k_s, kd_f)  # dk += dKK K
                    T.wgmma_gemm(da_s, k_s, kd_f, transpose_A=True)  # dk += dKK^T K
                    T.wait_wgmma(0)
                    T.barrier_arrive(free_k)
                    stamp(tr, 1, 15, c, tx, h, n)
                    if cluster_sum:
                        # the group's copies of this CTA's dq rows are done with Vn's tile
                        T.barrier_wait(q_read, c % 2)
                    T.copy(kd_f, vn_s)
                    if cluster_sum:
                        T.fence_proxy_async()
                        T.barrier_arrive(k_staged)
                    else:
                        if pair_sums:
                            add_rows(vn_s, dk, t0, n_rows, h // 2, tx - 128)
                        else:
                            for i, j in T.Parallel(C, K):
                                if i < n_rows:
                                    dk[0, t0 + i, h, j] = vn_s[i, j]
                        T.barrier_arrive(vn_free)

            elif tx < 384:
                # ================= gate side
                T.set_max_nreg(GATE_REGS, 1)
                cc_f = T.alloc_fragment((C, C), acc)  # Q K^T, then dAg and E
                cv_f = T.alloc_fragment((C, V), acc)  # K S, then Vn
                kk_f = T.alloc_fragment((C, C), acc)
                dp_f = T.alloc_fragment((C, C), acc)
                x_f = T.alloc_fragment((C, C), acc)
                gam_f = T.alloc_fragment((C,), acc)
                red_r = T.alloc_fragment((C,), acc)
                red_c = T.alloc_fragment((C,), acc)
                dg_f = T.alloc_fragment((C,), acc)
                if lean_gates:  # g~ of the thread's rows and columns of P, E and dQK
                    grow_f = T.alloc_fragment((C,), acc)
                    gcol_f = T.alloc_fragment((C,), acc)
                for c in T.serial(n_chunks):
                    t0 = bos + (n_chunks - 1 - c) * C
                    n_rows = T.min(eos - t0, C)
                    stamp(tr, 2, 0, c, tx, h, n)
                    T.barrier_wait(full_e, c % 2)
                    T.barrier_wait(full_m, c % 2)
                    T.barrier_wait(full_k, c % 2)
                    stamp(tr, 2, 1, c, tx, h, n)
                    if not p_given:
                        T.wgmma_gemm(q_s, k_s, cc_f, transpose_B=True, clear_accum=True)  # Q K^T
                    T.wgmma_gemm(k_s, st_s, cv_f, transpose_B=True, clear_accum=True)  # K S
                    if fold_on_gates:
                        # <dS', S> as the diagonals of dS'^T[r] (S^T[r])^T over V's halves r, into Q K^T's accumulator
                        # (P is given); dS'^T is written by the time K has loaded (its chunk's K waited for the value
                        # side's last dS'^T reads, and the state side writes the next one right after)
                        T.barrier_wait(ds_ready, c % 2)
                        T.wgmma_gemm(ds_s[0:C, :], st_s[0:C, :], cc_f, transpose_B=True, clear_accum=True)
                        T.wgmma_gemm(ds_s[C:2 * C, :], st_s[C:2 * C, :], cc_f, transpose_B=True)
                    for i in T.Parallel(C):
                        gam_f[i] = T.exp2(gc_s[i] * LOG2E)
                    # with p_first, Q K^T alone first (the groups complete in order): P goes out while K S, twice
                    # its work, is still on the tensor cores, since the value side waits for P; with the fold on this
                    # side, K S alone (Vn's product below waits for the rest)
                    T.wait_wgmma(2 if fold_on_gates else 1 if p_first and not p_given else 0)
                    stamp(tr, 2, 2, c, tx, h, n)
                    # p_given: P came with the second group of loads; the value side does not wait for it
                    if not p_given:
                        if lean_gates:
                            gates_to_fragments(gc_s, grow_f, gcol_f)
                            for i, j in T.Parallel(C, C):
                                cc_f[i, j] = T.if_then_else(
                                    i >= j, cc_f[i, j] * scale * T.exp2((grow_f[i] - gcol_f[j]) * LOG2E), 0.0)
                        else:
                            for i, j in T.Parallel(C, C):
                                cc_f[i, j] = T.if_then_else(
                                    i >= j, cc_f[i, j] * scale * T.exp2((gc_s[i] - gc_s[j]) * LOG2E), 0.0)
                        T.copy(cc_f, p_s)
                        T.fence_proxy_async()
                        # P out first: the value side's P^T dO needs nothing else (W's other readers wait on later
                        # barriers: vn_ready, ydw_ready)
                        T.barrier_arrive(p_ready)
                        if p_first:
                            T.wait_wgmma(0)
                    # W made in registers and stored whole: a loop over the accumulator that writes shared memory
                    # gets a warpgroup barrier before the store of each unrolled step. gamma ⊙ KS is not kept: the
                    # value side takes it as V - W, from the two tiles
                    for i, j in T.Parallel(C, V):
                        cv_f[i, j] = T.cast(v_s[i, j], acc) - cv_f[i, j] * gam_f[i]
                    T.copy(cv_f, w_s)
                    T.fence_proxy_async()
                    stamp(tr, 2, 3, c, tx, h, n)
                    T.gemm(ag_s, w_s, cv_f, clear_accum=True)  # Vn = Ag W
                    if c > 0:
                        T.barrier_wait(vn_free, (c + 1) % 2)
                    T.copy(cv_f, vn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(vn_ready)
                    stamp(tr, 2, 4, c, tx, h, n)
                    T.barrier_arrive(free_e)
                    if fold_on_gates:
                        # (its groups completed before Vn's, in order) the diagonal's row sums, while dVn is made
                        for i, j in T.Parallel(C, C):
                            cc_f[i, j] = T.if_then_else(i == j, cc_f[i, j], 0.0)
                        T.reduce_sum(cc_f, red_r, dim=1)
                        for i in T.Parallel(C):
                            xf_s[i] = T.exp2(gc_s[C - 1] * LOG2E) * red_r[i]
                    T.barrier_wait(dvn_ready, c % 2)
                    stamp(tr, 2, 5, c, tx, h, n)
                    T.wgmma_gemm(dvn_s, w_s, cc_f, transpose_B=True, clear_accum=True)  # dVn W^T
                    T.wgmma_gemm(do_s, vn_s, dp_f, transpose_B=True, clear_accum=True)  # dO Vn^T
                    T.wait_wgmma(0)
                    T.barrier_arrive(dag_done)
                    stamp(tr, 2, 6, c, tx, h, n)
                    # E = dAg ⊙ Gam (lower): dbeta's first sum, dA = E ⊙ beta_j, X = E ⊙ A ⊙ beta_j
                    if lean_gates:  # g~ read again here rather than kept live across Vn and dVn W^T
                        gates_to_fragments(gc_s, grow_f, gcol_f)
                        for i, j in T.Parallel(C, C):
                            cc_f[i, j] = T.if_then_else(
                                i >= j, cc_f[i, j] * T.exp2((grow_f[i] - gcol_f[j]) * LOG2E), 0.0)
                            x_f[i, j] = cc_f[i, j] * T.cast(a_s[i, j], acc)
                            cc_f[i, j] = cc_f[i, j] * b_s[j]
                    else:
                        for i, j in T.Parallel(C, C):
                            cc_f[i, j] = T.if_then_else(
                                i >= j, cc_f[i, j] * T.exp2((gc_s[i] - gc_s[j]) * LOG2E), 0.0)
                            x_f[i, j] = cc_f[i, j] * T.cast(a_s[i, j], acc)
                            cc_f[i, j] = cc_f[i, j] * b_s[j]
                    T.copy(cc_f, da_s)
                    stamp(tr, 2, 7, c, tx, h, n)
                    # column sums cross the warps through shared memory: batched, two barriers for eight columns
                    # instead of ten for each
                    T.reduce_sum(x_f, red_c, dim=0, batch=COLUMN_SUM_BATCH)
                    T.copy(red_c, db1_s)
                    stamp(tr, 2, 8, c, tx, h, n)
                    # P ⊙ dP joins X; dQK = scale Gam ⊙ dP takes P's tile (the value side's P^T dO is done), in a
                    # loop of its own (P read in full first, as above)
                    if lean_gates:
                        for i, j in T.Parallel(C, C):
                            x_f[i, j] = x_f[i, j] * b_s[j] + T.if_then_else(
                                i >= j, dp_f[i, j] * T.cast(p_s[i, j], acc), 0.0)
                            dp_f[i, j] = T.if_then_else(
                                i >= j, dp_f[i, j] * scale * T.exp2((grow_f[i] - gcol_f[j]) * LOG2E), 0.0)
                    else:
                        for i, j in T.Parallel(C, C):
                            x_f[i, j] = x_f[i, j] * b_s[j] + T.if_then_else(
                                i >= j, dp_f[i, j] * T.cast(p_s[i, j], acc), 0.0)
                            dp_f[i, j] = T.if_then_else(
                                i >= j, dp_f[i, j] * scale * T.exp2((gc_s[i] - gc_s[j]) * LOG2E), 0.0)
                    T.copy(dp_f, p_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(dp_done)
                    stamp(tr, 2, 9, c, tx, h, n)
                    T.reduce_sum(x_f, red_r, dim=1)
                    T.copy(red_r, xr_s)
                    T.reduce_sum(x_f, red_c, dim=0, batch=COLUMN_SUM_BATCH)
                    T.copy(red_c, xc_s)
                    stamp(tr, 2, 10, c, tx, h, n)
                    # dL = -(A^T dA A^T) strictly lower, dKK = diag(beta) dL, dbeta's second sum
                    T.wgmma_gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)  # K K^T
                    T.wgmma_gemm(a_s, da_s, cc_f, transpose_A=True, clear_accum=True)
                    T.wait_wgmma(0)
                    # K's last reader here: the next chunk's K may load once the value side's dk products are done
                    T.barrier_arrive(free_k)
                    stamp(tr, 2, 11, c, tx, h, n)
                    T.copy(cc_f, da_s)
                    T.fence_proxy_async()
                    T.gemm(da_s, a_s, cc_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        cc_f[i, j] = T.if_then_else(i > j, -cc_f[i, j], 0.0)
                        x_f[i, j] = cc_f[i, j] * kk_f[i, j]
                        cc_f[i, j] = cc_f[i, j] * b_s[i]
                    T.copy(cc_f, da_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(dkk_ready)
                    stamp(tr, 2, 12, c, tx, h, n)
                    T.barrier_arrive(free_m)
                    T.reduce_sum(x_f, red_r, dim=1)
                    T.copy(red_r, db2_s)
                    # dg: reverse cumsum of the row terms, plus the total of the g~_last terms, for every token
                    T.barrier_wait(x_rows, c % 2)
                    stamp(tr, 2, 13, c, tx, h, n)
                    # (a serial sum per token over the chunk's 64 row terms, read by all tokens at once: cheaper than
                    # a masked [64, 64] tile and its reduction; by warp shuffles it was no faster: it runs beside K's
                    # reload, off the step's loop, notes v0.31a)
                    for i in T.Parallel(C):
                        z_s[i] = x0_s[i] + xr_s[i] - xc_s[i]
                    for i in T.Parallel(C):
                        dg_f[i] = 0.0
                        for j in T.serial(C):
                            dg_f[i] = dg_f[i] + (T.if_then_else(j >= i, z_s[j], 0.0) + g_last_terms(x1_s, xf_s, j))
                        if i < n_rows:
                            dg[0, t0 + i, h] = dg_f[i]
                            dbeta[0, t0 + i, h] = db1_s[i] + db2_s[i]
                    stamp(tr, 2, 14, c, tx, h, n)

            else:
                # ================= producer: warp 12 the first group (V, Ag, S^T), warps 13-14 the second (Q, dO,
                # A, g~, beta), warp 15 K
                T.set_max_nreg(PRODUCER_REGS, 0)
                if ag_from_a:  # gate_in_place's registers: a row's piece of A, and its block's row and column
                    av = T.alloc_local((8,), io_dtype)
                    blk = T.alloc_local((2,), "int32")
                else:
                    av = blk = None
                for c in T.serial(n_chunks):
                    stamp(tr, 3, 0, c, tx, h, n)
                    t0 = bos + (n_chunks - 1 - c) * C
                    n_rows = T.min(eos - t0, C)
                    slot = first_slot[n] + (n_chunks - 1 - c)
                    if ag_from_a:
                        gates_in(ge_s, be_s, gcum, beta, c, slot, t0, n_rows, h, tx - 384)
                    if tx < 416:
                        if c > 0:
                            T.barrier_wait(free_e, (c + 1) % 2)
                            stamp(tr, 3, 1, c, tx, h, n)
                        if ag_from_a:
                            T.tma_copy(A[slot, h, 0:C, 0:C], ag_s, barrier=a_in)
                        else:
                            T.tma_copy(Ag[slot, h, 0:C, 0:C], ag_s, barrier=full_e)
                        if first_apart:
                            if c == n_chunks - 1:
                                T.tma_copy(first_states[n, h, 0:V, 0:K], st_s, barrier=full_e)
                            else:
                                T.tma_copy(states[slot - shift * (n + 1), h, 0:V, 0:K], st_s, barrier=full_e)
                        else:
                            T.tma_copy(states[slot, h, 0:V, 0:K], st_s, barrier=full_e)
                        if n_rows == C:
                            T.tma_copy(v[0, t0:t0 + C, h, 0:V], v_s, barrier=full_e)
                        else:
                            masked_rows(v, v_s, t0, n_rows, h, V)
                        if not ag_from_a:
                            T.barrier_arrive(full_e)
                            stamp(tr, 3, 2, c, tx, h, n)
                    if ag_from_a:
                        # every producer thread gates its pieces of A's tile: the V, Ag, S^T group's release comes
                        # well before the other groups', so warps 13-15 are idle then (notes v0.37b)
                        gate_in_place(ag_s, ge_s, be_s, a_in, full_e, av, blk, c, tx - 384)
                        if tx < 416:
                            stamp(tr, 3, 2, c, tx, h, n)
                    if tx < 416:
                        if cluster_sum:
                            # the chunk before's exchange, once this chunk's loads are issued (the next wait here is
                            # for the value side's point past this chunk's dVn, so the exchange delays no load)
                            if c > 0:
                                exchange(vn_s, dvn_s, dq, dk, ready, k_ready, q_staged, k_staged, q_in, k_in,
                                         q_read, k_read, q_summed, rows_summed, vn_free, c - 1, t0 + C,
                                         T.min(eos - t0 - C, C), h, tx - 384, tr, n, tx)
                    elif tx < 480:
                        if c > 0:
                            T.barrier_wait(free_m, (c + 1) % 2)
                            stamp(tr, 3, 3, c, tx, h, n)
                        if tx < 448:
                            if n_rows == C:
                                T.tma_copy(q[0, t0:t0 + C, hq, 0:K], q_s, barrier=full_m)
                                T.tma_copy(do[0, t0:t0 + C, h, 0:V], do_s, barrier=full_m)
                            else:
                                masked_rows(q, q_s, t0, n_rows, hq, K)
                                masked_rows(do, do_s, t0, n_rows, h, V)
                        else:
                            T.tma_copy(A[slot, h, 0:C, 0:C], a_s, barrier=full_m)
                            if p_given:
                                T.tma_copy(p_in[slot, h, 0:C, 0:C], p_s, barrier=full_m)
                            T.tma_copy(gcum[h, slot * C:slot * C + C], gc_s, barrier=full_m)
                            for i in T.Parallel(C):
                                b_s[i] = T.if_then_else(i < n_rows, beta[0, t0 + i, h], 0.0)
                        T.barrier_arrive(full_m)
                        # warp 13 issues Q and dO by TMA; warp 14 A and g~ by TMA and beta by loads of its own
                        if tx < 448:
                            stamp(tr, 3, 4, c, tx, h, n)
                            if cluster_sum:
                                if c > 0:  # its quarter of the chunk before's sums
                                    sum_share(dvn_s, dq, dk, q_in, k_in, q_summed, rows_summed, c - 1, t0 + C,
                                              T.min(eos - t0 - C, C), h, 1)
                        else:
                            stamp(tr, 3, 7, c, tx, h, n)
                            if cluster_sum:
                                if c > 0:
                                    sum_share(dvn_s, dq, dk, q_in, k_in, q_summed, rows_summed, c - 1, t0 + C,
                                              T.min(eos - t0 - C, C), h, 2)
                    else:
                        if c > 0:
                            T.barrier_wait(free_k, (c + 1) % 2)
                            stamp(tr, 3, 5, c, tx, h, n)
                        if n_rows == C:
                            T.tma_copy(k[0, t0:t0 + C, hq, 0:K], k_s, barrier=full_k)
                        else:
                            masked_rows(k, k_s, t0, n_rows, hq, K)
                        T.barrier_arrive(full_k)
                        stamp(tr, 3, 6, c, tx, h, n)
                        if cluster_sum:
                            if c > 0:
                                sum_share(dvn_s, dq, dk, q_in, k_in, q_summed, rows_summed, c - 1, t0 + C,
                                          T.min(eos - t0 - C, C), h, 3)
                if cluster_sum:
                    # the last chunk's exchange
                    if tx < 416:
                        if n_chunks > 0:
                            exchange(vn_s, dvn_s, dq, dk, ready, k_ready, q_staged, k_staged, q_in, k_in, q_read,
                                     k_read, q_summed, rows_summed, vn_free, n_chunks - 1, bos, T.min(eos - bos, C), h,
                                     tx - 384, tr, n, tx)
                    elif tx < 448:
                        if n_chunks > 0:
                            sum_share(dvn_s, dq, dk, q_in, k_in, q_summed, rows_summed, n_chunks - 1, bos,
                                      T.min(eos - bos, C), h, 1)
                    elif tx < 480:
                        if n_chunks > 0:
                            sum_share(dvn_s, dq, dk, q_in, k_in, q_summed, rows_summed, n_chunks - 1, bos,
                                      T.min(eos - bos, C), h, 2)
                    else:
                        if n_chunks > 0:
                            sum_share(dvn_s, dq, dk, q_in, k_in, q_summed, rows_summed, n_chunks - 1, bos,
                                      T.min(eos - bos, C), h, 3)

    # a prim_func's parameters are its source's: the trace build's extra argument needs a signature of its own
    if trace and p_given:
        @T.prim_func
        def fused_backward_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
            A: T.Tensor((num_slots, Hv, C, C), io_dtype),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            first_slot: T.Tensor((num_seqs,), "int32"),
            states: T.Tensor((num_states, Hv, V, K), io_dtype),
            dht: T.Tensor((n_dht, Hv, K, V), "float32"),
            scale: T.float32,
            dv: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            dq: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dk: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dg: T.Tensor((1, num_tokens, Hv), "float32"),
            dbeta: T.Tensor((1, num_tokens, Hv), "float32"),
            dh0: T.Tensor((num_seqs, Hv, K, V), "float32"),
            p_in: T.Tensor((num_slots, Hv, C, C), io_dtype),
            tr: T.Tensor((4, TRACE_CHUNKS, TRACE_POINTS), "int64"),
        ):
            fused_backward_body(q, k, v, do, gcum, beta, Ag, A, cu_seqlens, first_slot, states, dht, scale, dv, dq,
                                dk, dg, dbeta, dh0, tr, p_in=p_in)
    elif trace:
        @T.prim_func
        def fused_backward_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
            A: T.Tensor((num_slots, Hv, C, C), io_dtype),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            first_slot: T.Tensor((num_seqs,), "int32"),
            states: T.Tensor((num_states, Hv, V, K), io_dtype),
            dht: T.Tensor((n_dht, Hv, K, V), "float32"),
            scale: T.float32,
            dv: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            dq: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dk: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dg: T.Tensor((1, num_tokens, Hv), "float32"),
            dbeta: T.Tensor((1, num_tokens, Hv), "float32"),
            dh0: T.Tensor((num_seqs, Hv, K, V), "float32"),
            tr: T.Tensor((4, TRACE_CHUNKS, TRACE_POINTS), "int64"),
        ):
            fused_backward_body(q, k, v, do, gcum, beta, Ag, A, cu_seqlens, first_slot, states, dht, scale, dv, dq,
                                dk, dg, dbeta, dh0, tr)
    elif p_given and not first_apart:
        @T.prim_func
        def fused_backward_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
            A: T.Tensor((num_slots, Hv, C, C), io_dtype),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            first_slot: T.Tensor((num_seqs,), "int32"),
            states: T.Tensor((num_states, Hv, V, K), io_dtype),
            dht: T.Tensor((n_dht, Hv, K, V), "float32"),
            scale: T.float32,
            dv: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            dq: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dk: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dg: T.Tensor((1, num_tokens, Hv), "float32"),
            dbeta: T.Tensor((1, num_tokens, Hv), "float32"),
            dh0: T.Tensor((num_seqs, Hv, K, V), "float32"),
            p_in: T.Tensor((num_slots, Hv, C, C), io_dtype),
        ):
            fused_backward_body(q, k, v, do, gcum, beta, Ag, A, cu_seqlens, first_slot, states, dht, scale, dv, dq,
                                dk, dg, dbeta, dh0, None, p_in=p_in)
    elif longest_first and not p_given:
        @T.prim_func
        def fused_backward_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
            A: T.Tensor((num_slots, Hv, C, C), io_dtype),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            first_slot: T.Tensor((num_seqs,), "int32"),
            states: T.Tensor((num_states, Hv, V, K), io_dtype),
            dht: T.Tensor((n_dht, Hv, K, V), "float32"),
            scale: T.float32,
            dv: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            dq: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dk: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dg: T.Tensor((1, num_tokens, Hv), "float32"),
            dbeta: T.Tensor((1, num_tokens, Hv), "float32"),
            dh0: T.Tensor((num_seqs, Hv, K, V), "float32"),
            first_states: T.Tensor((num_seqs, Hv, 2 * V, K), io_dtype),
            shift: T.int32,
            order: T.Tensor((num_seqs,), "int32"),
        ):
            fused_backward_body(q, k, v, do, gcum, beta, Ag, A, cu_seqlens, first_slot, states, dht, scale, dv, dq,
                                dk, dg, dbeta, dh0, None, first_states, shift, order=order)

    elif longest_first:
        @T.prim_func
        def fused_backward_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
            A: T.Tensor((num_slots, Hv, C, C), io_dtype),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            first_slot: T.Tensor((num_seqs,), "int32"),
            states: T.Tensor((num_states, Hv, V, K), io_dtype),
            dht: T.Tensor((n_dht, Hv, K, V), "float32"),
            scale: T.float32,
            dv: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            dq: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dk: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dg: T.Tensor((1, num_tokens, Hv), "float32"),
            dbeta: T.Tensor((1, num_tokens, Hv), "float32"),
            dh0: T.Tensor((num_seqs, Hv, K, V), "float32"),
            first_states: T.Tensor((num_seqs, Hv, 2 * V, K), io_dtype),
            shift: T.int32,
            p_in: T.Tensor((num_slots, Hv, C, C), io_dtype),
            order: T.Tensor((num_seqs,), "int32"),
        ):
            fused_backward_body(q, k, v, do, gcum, beta, Ag, A, cu_seqlens, first_slot, states, dht, scale, dv, dq,
                                dk, dg, dbeta, dh0, None, first_states, shift, p_in, order)

    elif first_apart and not p_given:
        @T.prim_func
        def fused_backward_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
            A: T.Tensor((num_slots, Hv, C, C), io_dtype),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            first_slot: T.Tensor((num_seqs,), "int32"),
            states: T.Tensor((num_states, Hv, V, K), io_dtype),
            dht: T.Tensor((n_dht, Hv, K, V), "float32"),
            scale: T.float32,
            dv: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            dq: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dk: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dg: T.Tensor((1, num_tokens, Hv), "float32"),
            dbeta: T.Tensor((1, num_tokens, Hv), "float32"),
            dh0: T.Tensor((num_seqs, Hv, K, V), "float32"),
            first_states: T.Tensor((num_seqs, Hv, 2 * V, K), io_dtype),
            shift: T.int32,
        ):
            fused_backward_body(q, k, v, do, gcum, beta, Ag, A, cu_seqlens, first_slot, states, dht, scale, dv, dq,
                                dk, dg, dbeta, dh0, None, first_states, shift)

    elif first_apart:
        @T.prim_func
        def fused_backward_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
            A: T.Tensor((num_slots, Hv, C, C), io_dtype),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            first_slot: T.Tensor((num_seqs,), "int32"),
            states: T.Tensor((num_states, Hv, V, K), io_dtype),
            dht: T.Tensor((n_dht, Hv, K, V), "float32"),
            scale: T.float32,
            dv: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            dq: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dk: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dg: T.Tensor((1, num_tokens, Hv), "float32"),
            dbeta: T.Tensor((1, num_tokens, Hv), "float32"),
            dh0: T.Tensor((num_seqs, Hv, K, V), "float32"),
            first_states: T.Tensor((num_seqs, Hv, 2 * V, K), io_dtype),
            shift: T.int32,
            p_in: T.Tensor((num_slots, Hv, C, C), io_dtype),
        ):
            fused_backward_body(q, k, v, do, gcum, beta, Ag, A, cu_seqlens, first_slot, states, dht, scale, dv, dq,
                                dk, dg, dbeta, dh0, None, first_states, shift, p_in)

    else:
        @T.prim_func
        def fused_backward_kernel(
            q: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            k: T.Tensor((1, num_tokens, Hqk, K), io_dtype),
            v: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            do: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            gcum: T.Tensor((Hv, slot_rows), "float32"),
            beta: T.Tensor((1, num_tokens, Hv), "float32"),
            Ag: T.Tensor((num_slots, Hv, C, C), io_dtype),
            A: T.Tensor((num_slots, Hv, C, C), io_dtype),
            cu_seqlens: T.Tensor((num_seqs + 1,), "int32"),
            first_slot: T.Tensor((num_seqs,), "int32"),
            states: T.Tensor((num_states, Hv, V, K), io_dtype),
            dht: T.Tensor((n_dht, Hv, K, V), "float32"),
            scale: T.float32,
            dv: T.Tensor((1, num_tokens, Hv, V), io_dtype),
            dq: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dk: T.Tensor((1, num_tokens, dq_heads, K), io_dtype),
            dg: T.Tensor((1, num_tokens, Hv), "float32"),
            dbeta: T.Tensor((1, num_tokens, Hv), "float32"),
            dh0: T.Tensor((num_seqs, Hv, K, V), "float32"),
        ):
            fused_backward_body(q, k, v, do, gcum, beta, Ag, A, cu_seqlens, first_slot, states, dht, scale, dv, dq,
                                dk, dg, dbeta, dh0, None)

    return tilelang.compile(fused_backward_kernel, out_idx=None, target=TARGET, pass_configs=pass_configs())
