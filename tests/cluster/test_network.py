"""The fault matrix, the network: nodes in network namespaces of their own are cut off
mid-run (needs root and iproute2)."""

from __future__ import annotations

import random

import pytest

from kit.faultcluster import (
    HANDOVER_STEP_SECONDS,
    SPARE,
    STEP_SECONDS,
    STEPS,
    Cluster,
    check_result,
    node_lost_events,
    restored_steps,
    steps_never_run,
    wait_until,
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


@pytest.mark.parametrize("netns_node", ["n2,n3"])
# Two of four nodes silent at once is more than this share of the job's: a mass loss
# (the fleet-wide count, 16 nodes by default, is beyond a five-node cluster).
@pytest.mark.parametrize("scheduler_env", [{"PITSTOP_MASS_LOSS_JOB_SHARE": "0.4"}])
def test_half_the_nodes_cut_off_at_once_hold_the_job_until_they_are_back(
    cluster: Cluster, standalone_hash: str
) -> None:
    """Nodes n2 and n3 lose their links at once, mid-run: a partition, not two
    failures. The scheduler finds both silent (no heartbeat, no answer from their hosts)
    and holds the job instead of moving half of it to spares it does not have: its ranks
    stay where they are, waiting in their gradient exchange. The links come back, the
    agents register again, the job is released and runs on, no rank moved and no step
    lost; it ends bitwise equal to the fault-free run."""
    network = cluster.network
    assert network is not None
    cut = sorted(link.node_id for link in network.links)
    assert cut == ["n2", "n3"], cut
    # Steps long enough that the job is still mid-run once the silence is judged.
    job = cluster.submit("--step-seconds", str(HANDOVER_STEP_SECONDS))
    ranks = {a.node_id: a.rank for a in job.rank_map.ranks}
    assert 0 not in {ranks[n] for n in cut}  # rank 0's host is the rendezvous
    cluster.wait_for_step(job, ranks[cut[0]], random.randint(3, 8))
    for node_id in cut:
        network.cut(node_id)
    held = cluster.job_event(job.id, "job.held", "job.recovering")
    assert held.kind == "job.held", f"{held.kind}: {held.reason}\n{cluster.logs(job.id)}"
    assert held.attributes["nodes"] == ",".join(cut), dict(held.attributes)
    # The hold comes once both streams have ended; each node is lost once its host does
    # not answer either. A link healed before that judgement is no loss at all (its
    # Register comes first), so the links come back once both are lost.
    wait_until(
        lambda: sorted(each.split(":", 1)[0] for each in node_lost_events(cluster)) == cut,
        "both cut nodes judged lost",
    )
    for node_id in cut:
        network.heal(node_id)
    released = cluster.job_event(job.id, "job.released", "job.recovering")
    assert released.kind == "job.released", (
        f"{released.kind}: {released.reason}\n{cluster.logs(job.id)}"
    )
    assert released.attributes["replacements"] == "0", dict(released.attributes)
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    placed = {a.node_id: a.rank for a in done.rank_map.ranks}
    assert placed == ranks, placed  # nothing moved: the spare never took a rank
    lost = node_lost_events(cluster)
    assert sorted(each.split(":", 1)[0] for each in lost) == cut, lost
    for each in range(4):
        assert steps_never_run(cluster, done, each) == set()
