"""What a chunk's exchange between the two CTAs of a cluster costs: cycles a round trip of N bytes each way through
distributed shared memory (a question of the V split's plan, docs/hopper-notes.md "The split of V over a cluster of
two, counted").

    python benchmarks/dsmem_exchange.py --bytes 0,8192,16384,32768,65536 --rounds 200 --out dsmem.json
    python benchmarks/dsmem_exchange.py --compile-only        # build for sm_90a here, no GPU

One kernel, clusters of two CTAs of 128 threads, as many clusters as the SMs hold (one CTA an SM: ~129 KB of shared
memory each). Each round, in both CTAs at once:
1. one thread sends ``nbytes`` of its outbox to the other CTA's inbox by bulk shared-to-shared copies
   (``cp.async.bulk.shared::cluster``, 16 KB each), with one arrival on the other CTA's ``landed`` barrier that
   expects the bytes;
2. all threads wait for the other CTA's bytes to land here, then one thread tells the other CTA that its inbox is
   free again (``freed``, a remote arrival), and all wait for the same word from it.
In ``store`` mode (``--modes``) step 1 is every thread storing its share of the bytes from registers straight into the
other CTA's inbox (``st.shared::cluster``) and arriving there with a cluster-scope release, which is how the plan's
partials would go out of the accumulators without a staging tile. That is the exchange as the plan would run it once
a chunk: a send, a landing, a hand-back. The round's cycles are
its latency, not a throughput: nothing else runs beside it. ``nbytes = 0`` sends nothing and leaves the hand-back
alone, so the difference is what the bytes cost. Each CTA's first thread records ``clock64`` around the rounds; the
report gives the median over CTAs of cycles a round, and what that is in bytes a cycle per direction.

After the rounds each CTA's inbox must hold the other CTA's pattern in the bytes sent and its own fill after them,
or the run stops.
"""
import argparse
import functools
import json
import sys

from flashgdn.kernels.hopper.fused_backward import CLUSTER_PRELUDE

#: the largest tile: 64 KB each way, the plan's exchange a CTA and chunk
MAX_BYTES = 65536
#: one bulk copy's size (a multiple of 16 bytes); larger exchanges are several copies on one barrier
COPY_BYTES = 16384

# the fused backward's cluster helpers (mapa addresses, remote arrivals), which the plan's kernel would use too, and
# the probe's own sends beside them
PRELUDE = CLUSTER_PRELUDE + r"""
namespace dsmem_probe {
using flashgdn_cluster::peer_address;
// nbytes (a multiple of 16) of this CTA's ``src`` to the same place in CTA ``peer``'s ``dst``, completing there on
// ``bar``, which one arrival here tells to expect them (with nbytes = 0 the arrival alone)
template <typename Bar> __device__ __forceinline__ void push(void *dst, void *src, int nbytes, int chunk, int peer,
                                                             Bar *bar) {
  unsigned b = peer_address(bar, peer), d = peer_address(dst, peer);
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(src));
  asm volatile("mbarrier.arrive.expect_tx.shared::cluster.b64 _, [%0], %1;" :: "r"(b), "r"(nbytes) : "memory");
  for (int off = 0; off < nbytes; off += chunk) {
    int n = nbytes - off < chunk ? nbytes - off : chunk;
    asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(d + off), "r"(s + off), "r"(n), "r"(b) : "memory");
  }
}
// ``store`` mode: this thread's share of the nbytes (16 bytes every 2 KB, from its own offset) stored from registers
// straight into CTA ``peer``'s ``dst``, the values the sender's outbox holds, then one arrival there that releases
// them at cluster scope
template <typename Bar> __device__ __forceinline__ void store_share(void *dst, int nbytes, int rank, int peer,
                                                                   int tx, Bar *bar) {
  unsigned d = peer_address(dst, peer);
  for (int w = 4 * tx; w < nbytes / 4; w += 512) {
    float base = static_cast<float>(rank * 100000 + w);
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};"
                 :: "r"(d + 4u * w), "f"(base), "f"(base + 1.0f), "f"(base + 2.0f), "f"(base + 3.0f) : "memory");
  }
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(peer_address(bar, peer))
               : "memory");
}
// what other CTAs of the cluster wrote and released, visible to this thread's reads
__device__ __forceinline__ void acquire_cluster() { asm volatile("fence.acq_rel.cluster;" ::: "memory"); }
// this thread's generic-proxy writes to shared memory made visible to the bulk copies (the async proxy)
__device__ __forceinline__ void fence_for_copies() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
}  // namespace dsmem_probe
"""


@functools.lru_cache(maxsize=None)
def build_probe(target=None):
    """The probe kernel: ``probe(times [CTAs] int64, inboxes [CTAs, MAX_BYTES / 4] float32, nbytes, rounds, mode)``
    (mode 0 copy, 1 store); CTAs is dynamic (even). ``times[i]``: CTA i's cycles over all rounds; ``inboxes[i]``:
    what landed in its inbox."""
    import tilelang
    import tilelang.language as T

    from flashgdn.kernels.hopper.common import TARGET, pass_configs

    words = MAX_BYTES // 4
    ctas = T.dynamic("ctas")

    @T.prim_func
    def probe(times: T.Tensor([ctas], "int64"), inboxes: T.Tensor([ctas, words], "float32"), nbytes: T.int32,
              rounds: T.int32, mode: T.int32):
        # 2 x 64 KB of shared memory: one CTA an SM, as the fused backward runs
        with T.Kernel(ctas, threads=128, prelude=PRELUDE, cluster_dims=(2, 1, 1)) as bx:
            outbox = T.alloc_shared([words], "float32")
            inbox = T.alloc_shared([words], "float32")
            landed = T.alloc_cluster_barrier(arrive_count=1)  # the other CTA's bytes here (copy mode)
            stored = T.alloc_cluster_barrier(arrive_count=128)  # the same, in store mode: each thread's share
            freed = T.alloc_cluster_barrier(arrive_count=1)  # the other CTA has read what this one sent
            start = T.alloc_local([1], "int64")
            tx = T.get_thread_binding()
            rank = bx % 2
            for i in T.Parallel(words):
                outbox[i] = T.Cast("float32", rank * 100000 + i)
                inbox[i] = T.Cast("float32", -1)
            # the fills before any copy reads an outbox or lands in an inbox, in either CTA
            T.call_extern("handle", "dsmem_probe::fence_for_copies")
            T.call_extern("handle", "tl::cluster_sync")
            start[0] = T.call_extern("int64", "clock64")
            for r in T.serial(rounds):
                if mode == 0:
                    if tx == 0:
                        T.call_extern("handle", "dsmem_probe::push", T.address_of(inbox[0]),
                                      T.address_of(outbox[0]), nbytes, COPY_BYTES, 1 - rank, T.address_of(landed[0]))
                    T.barrier_wait(landed, r % 2)
                else:
                    T.call_extern("handle", "dsmem_probe::store_share", T.address_of(inbox[0]), nbytes, rank,
                                  1 - rank, tx, T.address_of(stored[0]))
                    T.barrier_wait(stored, r % 2)
                if tx == 0:
                    T.call_extern("handle", "flashgdn_cluster::arrive_on_peer", T.address_of(freed[0]), 1 - rank)
                T.barrier_wait(freed, r % 2)
                # no thread a whole round behind: a barrier's parity names its phase only to one round either way
                T.sync_threads()
            if tx == 0:
                times[bx] = T.call_extern("int64", "clock64") - start[0]
            T.call_extern("handle", "dsmem_probe::acquire_cluster")
            for i in T.Parallel(words):
                inboxes[bx, i] = inbox[i]

    return tilelang.compile(probe, target=target or TARGET, pass_configs=pass_configs())


def check_sizes(sizes):
    """``sizes`` if each is a multiple of 16 bytes from 0 to ``MAX_BYTES``, else a clear exit."""
    for nbytes in sizes:
        if nbytes % 16 or not 0 <= nbytes <= MAX_BYTES:
            raise SystemExit(f"--bytes: {nbytes} is not a multiple of 16 between 0 and {MAX_BYTES}")
    return sizes


MODES = {"copy": 0, "store": 1}


def run(sizes, rounds, clusters=None, mode="copy"):
    """One record a size: median cycles a round over the CTAs, and bytes a cycle each way."""
    import torch

    kernel = build_probe()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = 2 * (clusters or sms // 2)
    words = MAX_BYTES // 4
    records = []
    for nbytes in check_sizes(sizes):
        times = torch.zeros(ctas, dtype=torch.int64, device="cuda")
        inboxes = torch.empty(ctas, words, dtype=torch.float32, device="cuda")
        kernel(times, inboxes, nbytes, 2, MODES[mode])  # warm-up
        kernel(times, inboxes, nbytes, rounds, MODES[mode])
        torch.cuda.synchronize()
        # what landed: the other CTA's pattern in the bytes sent, the -1 fill after them
        n = nbytes // 4
        idx = torch.arange(words, device="cuda", dtype=torch.float32)
        other = (1 - torch.arange(ctas, device="cuda") % 2).to(torch.float32)[:, None] * 100000
        want = torch.where(idx[None, :] < n, other + idx[None, :], torch.full_like(idx[None, :], -1))
        if not torch.equal(inboxes, want):
            raise SystemExit(f"{nbytes} bytes: the inboxes do not hold the other CTA's bytes")
        per_round = (times.double() / rounds).median().item()
        records.append(dict(mode=mode, nbytes=nbytes, rounds=rounds, ctas=ctas, cycles_per_round=per_round,
                            bytes_per_cycle_each_way=nbytes / per_round if per_round else None))
        print(f"{mode}: {nbytes:6d} B each way: {per_round:8.0f} cycles a round (median of {ctas} CTAs)"
              + (f", {nbytes / per_round:5.1f} B a cycle each way" if nbytes else ""))
    base = next((r["cycles_per_round"] for r in records if r["nbytes"] == 0), None)
    if base is not None:
        for r in records:
            if r["nbytes"]:
                r["cycles_over_handback"] = r["cycles_per_round"] - base
                print(f"{r['nbytes']:6d} B: {r['cycles_over_handback']:8.0f} cycles over the hand-back alone")
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", default="0,8192,16384,32768,65536", help="comma-separated sizes, each way")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--clusters", type=int, default=None, help="default: half the SM count")
    ap.add_argument("--modes", default="copy,store", help="copy (bulk copies by one thread), store (every thread "
                    "stores its share from registers)")
    ap.add_argument("--compile-only", action="store_true", help="build for sm_90a and print the source's size")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.compile_only:
        kernel = build_probe()
        print(f"built: {len(kernel.get_kernel_source())} characters of CUDA")
        return 0
    sizes = [int(x) for x in args.bytes.split(",")]
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: {m!r} is not one of {', '.join(MODES)}")
    records = [r for m in modes for r in run(sizes, args.rounds, args.clusters, m)]
    if args.out:
        import torch

        doc = dict(command="python benchmarks/dsmem_exchange.py " + " ".join(argv or sys.argv[1:]),
                   gpu=torch.cuda.get_device_name(0), records=records)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
