"""The fault matrix, the network: a node in a network namespace of its own is cut off
mid-run (needs root and iproute2)."""

from __future__ import annotations

import random

import pytest

from kit.faultcluster import (
    SPARE,
    STEP_SECONDS,
    STEPS,
    Cluster,
    check_result,
    node_lost_events,
    restored_steps,
    steps_never_run,
)

# Every scenario is a `cluster` test (the second pass of `make test`); the fixtures are
# in tests/cluster/conftest.py, the harness in tests/kit/faultcluster.py.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(360)]


@pytest.mark.parametrize("netns_node", ["n3"])
def test_a_node_cut_off_by_its_network_namespace_is_replaced(
    cluster: Cluster, standalone_hash: str
) -> None:
    """Node n3 runs in a network namespace of its own. Its link goes down mid-run: its
    processes live on but nothing reaches them. Its heartbeats stop, the scheduler
    declares it lost, its rank moves to the spare and restores the replica its buddy
    holds; the survivors' gradient exchange gives up after the collective timeout and
    they re-form without it. The job ends bitwise equal."""
    network = cluster.network
    assert network is not None
    (cut,) = network.links
    # gloo's peers meet on the bridge's subnet (loopback would not cross namespaces): each
    # node's agent hands its ranks GLOO_SOCKET_IFNAME.
    job = cluster.submit("--step-seconds", str(STEP_SECONDS))
    (rank,) = [a.rank for a in job.rank_map.ranks if a.node_id == cut.node_id]
    assert rank != 0  # rank 0's host is the rendezvous; the test cuts another node
    cluster.wait_for_step(job, rank, random.randint(8, STEPS // 2))
    network.cut(cut.node_id)
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert cut.node_id not in placed, placed
    assert SPARE in placed, placed
    lost = node_lost_events(cluster)
    assert len(lost) == 1, lost
    assert lost[0].startswith(f"{cut.node_id}: "), lost
    for each in range(4):
        assert steps_never_run(cluster, done, each) == set()
    restored = restored_steps(cluster, done)
    assert restored, cluster.logs(job.id)
    assert min(restored) > 0, restored
    # The partitioned host is powered off and its link comes back: the scheduler's end of
    # the dead node's connection is then reset at once, instead of holding the
    # scheduler's stop for its whole grace (10 s of the suite).
    cluster.kill_node(cut.node_id)
    network.heal(cut.node_id)
