"""The fault matrix, the host's faults (drilled with `pitstop node inject-fault` on the
simulated host): a rank killed for memory, a flapping link, a link down and a fatal
PCIe error. The job ends with the fault-free hash, and every incident names its node
and the signal. (A full disk under the checkpoint daemon is in
test_checkpoint_faults.py, on a real full filesystem.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kit.faultcluster import (
    SLOW_STEP_SECONDS,
    SPARE,
    STEPS,
    Cluster,
    check_result,
    reference_hash,
    steps_never_run,
)
from kit.forking import ForkClient
from pitstop.client.cli import app
from pitstop.v1 import jobs_pb2

# Every scenario is a `cluster` test (the second pass of `make test`); the fixtures are
# in tests/cluster/conftest.py, the harness in tests/kit/faultcluster.py.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(360)]

OOM = "the kernel killed it for memory (OOM)"


def drill(cluster: Cluster, node_id: str, *flags: str) -> None:
    """`pitstop node inject-fault NODE FLAGS`, as an operator drills it."""
    said = CliRunner().invoke(
        app,
        [*cluster.cli_options(), "node", "inject-fault", node_id, *flags],
        catch_exceptions=False,
    )
    assert said.exit_code == 0, said.output


def test_an_oom_kill_restarts_its_rank_and_a_flapping_link_drains_its_node(
    cluster: Cluster, rank_forks: ForkClient, tmp_path: Path
) -> None:
    """The kernel kills rank 0 for memory (inject-fault --oom): its exit is reported as
    an OOM kill, not an unexplained signal 9, and the rank restarts in place. Then a
    port of rank 2's node flaps 4 times (--link-flap mlx5_0/1:4): a warning, so the node
    drains, and at the next committed step its rank moves to the spare with no step
    given up. The job ends with the fault-free hash."""
    steps = 80  # at 0.1 s a step: both faults land mid-run
    job = cluster.submit("--steps", str(steps), "--step-seconds", "0.1")
    oomed, flapping = cluster.node_of(job, 0), cluster.node_of(job, 2)
    cluster.wait_for_step(job, 0, 5)
    drill(cluster, oomed.node_id, "--gpu", "0", "--oom")
    exited = cluster.wait(
        lambda e: e.kind == "rank.exited" and e.job_id == job.id and e.attributes["rank"] == "0",
        "rank 0's exit",
    )
    assert exited.reason == f"rank 0 ended with signal 9: {OOM}", exited
    assert exited.attributes["cause"] == OOM, exited
    cluster.job_event(job.id, "job.recovered")
    cluster.wait_for_standby(job)
    cluster.wait_for_commit(job)
    drill(cluster, flapping.node_id, "--link-flap", "mlx5_0/1:4")
    draining = cluster.wait(
        lambda e: e.kind == "node.draining" and e.node_id == flapping.node_id,
        f"{flapping.node_id} draining",
    )
    assert "infiniband link mlx5_0/1 flapped 4 times in 60 s" in draining.reason, draining
    done = cluster.finish(job.id)
    assert done.result["final_weights_sha256"] == reference_hash(rank_forks, tmp_path, steps)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert oomed.node_id in placed, placed  # restarted in place: the node is fine
    assert flapping.node_id not in placed, cluster.logs(job.id)
    assert SPARE in placed, placed
    oom, drain = done.goodput.incidents
    assert oom.kind == jobs_pb2.INCIDENT_KIND_RANK_EXIT, oom
    assert OOM in oom.cause, oom
    assert oom.resumed, oom
    assert flapping.node_id in drain.cause, drain
    assert "mlx5_0/1 flapped" in drain.cause, drain
    assert drain.kind == jobs_pb2.INCIDENT_KIND_NODE, drain
    assert drain.resumed, drain
    assert drain.lost_steps == 0, drain
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set(), (rank, str(cluster.root))


@pytest.mark.parametrize("spares", [2])
def test_a_link_down_and_a_fatal_pcie_error_each_replace_their_node(
    cluster: Cluster, standalone_hash: str
) -> None:
    """Two nodes fail at once, apart (neither holds the other's replicas): one's port
    goes down (--link-down), the other's GPU reports a fatal AER error (--pcie-aer 1).
    Both are fatal: each node is quarantined with the signal as its reason, its rank
    moves to a spare from memory, and the job ends with the fault-free hash."""
    job = cluster.submit("--step-seconds", str(SLOW_STEP_SECONDS))
    down = cluster.node_of(job, 1).node_id
    pcie = cluster.apart_from(job, down)
    cluster.wait_for_standby(job)
    cluster.wait_for_step(job, 1, random.randint(8, STEPS // 2))
    cluster.wait_for_commit(job)
    drill(cluster, down, "--link-down", "mlx5_0/1")
    drill(cluster, pcie, "--pcie-aer", "1")
    reasons = {}
    for node_id in (down, pcie):
        unhealthy = cluster.wait(
            lambda e, n=node_id: e.kind == "node.unhealthy" and e.node_id == n,
            f"{node_id} unhealthy",
        )
        reasons[node_id] = unhealthy.reason
    assert "infiniband link mlx5_0/1 is down" in reasons[down], reasons
    assert "PCIe gpu 0000:17:00.0: 1 new fatal AER errors" in reasons[pcie], reasons
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    placed = {a.node_id for a in done.rank_map.ranks}
    assert not placed & {down, pcie}, placed
    causes = " | ".join(i.cause for i in done.goodput.incidents)
    assert f"{down} unhealthy (infiniband link mlx5_0/1 is down" in causes, causes
    assert f"{pcie} unhealthy (PCIe gpu 0000:17:00.0" in causes, causes
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set()
