"""benchmarks/dsmem_exchange.py: the probe builds for sm_90a as a cluster of two whose barriers are set up before any
copy, each round a bulk copy to the other CTA, a wait for its bytes and a hand-back (CPU: compile only)."""
import pytest

from helpers import load_benchmark

dx = load_benchmark("dsmem_exchange")


def test_the_probe_builds_for_sm90a_as_one_round_trip_a_round():
    src = dx.build_probe().get_kernel_source()
    body = src[src.index("__launch_bounds__(128, 1) probe_kernel"):]
    # the barriers are set up across the cluster, the fills reach the async proxy and the other CTA before the first
    # copy, and the rounds are timed after that
    assert body.index("landed[0].init(1);") < body.index("tl::cluster_sync();") < body.index("fence_for_copies();")
    fence = body.index("fence_for_copies();")
    assert fence < body.index("tl::cluster_sync();", fence) < body.index("clock64()") < body.index("dsmem_probe::push(")
    loop = body[body.index("for (int r = 0; r < rounds; ++r)"):]
    # copy mode, then store mode, then the hand-back both share
    assert loop.index("dsmem_probe::push(") < loop.index("landed[0].wait((r & 1))") \
        < loop.index("dsmem_probe::store_share(") < loop.index("stored[0].wait((r & 1))") \
        < loop.index("flashgdn_cluster::arrive_on_peer(") < loop.index("freed[0].wait((r & 1))") \
        < loop.index("__syncthreads()")
    # and the inbox read back after what the other CTA released is visible
    assert body.index("dsmem_probe::acquire_cluster();") < body.index("inboxes + ")
    for ptx in ("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes",
                "st.shared::cluster.v4.f32", "mbarrier.arrive.release.cluster.shared::cluster.b64"):
        assert ptx in src, ptx


def test_sizes_are_checked_before_the_gpu():
    with pytest.raises(SystemExit, match="multiple of 16"):
        dx.check_sizes([0, 100])
    with pytest.raises(SystemExit, match="between 0 and 65536"):
        dx.check_sizes([131072])
    assert dx.check_sizes([0, 16, 65536]) == [0, 16, 65536]
