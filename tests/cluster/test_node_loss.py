"""The fault matrix: a rank, an agent, a whole node (killed or frozen) or a GPU (an Xid)
lost mid-run, two nodes at once, a node during a recovery, the last spare: the job ends
with the fault-free hash (the hash does not depend on the world size)."""

from __future__ import annotations

import random
import signal

import grpc
import pytest
from typer.testing import CliRunner

from kit.faultcluster import (
    SLOW_STEP_SECONDS,
    SPARE,
    STEP_SECONDS,
    STEPS,
    Cluster,
    check_result,
    killpg,
    restored_steps,
    steps_never_run,
)
from pitstop.agent.identity import enroll, identity_for
from pitstop.client.cli import app
from pitstop.common.tls import open_channel
from pitstop.rankside.peers import pull_shard
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc, common_pb2, jobs_pb2, nodes_pb2

# Every scenario is a `cluster` test (the second pass of `make test`); the fixtures are
# in tests/cluster/conftest.py, the harness in tests/kit/faultcluster.py.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(360)]


def check_plaintext_refused(cluster: Cluster) -> None:
    """Every checkpoint daemon answers a plaintext client with a failed handshake only."""
    assert cluster.ca is not None
    for node in cluster.nodes.values():
        with grpc.insecure_channel(node.checkpointd_address) as plain:
            stub = checkpoint_pb2_grpc.CheckpointServiceStub(plain)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListShards(checkpoint_pb2.ListShardsRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no handshake


def check_shards_stay_in_the_job(cluster: Cluster, done: jobs_pb2.Job, lost: str) -> None:
    """An enrolled node that runs no rank of the job reads none of its shards, a member
    node may, and no node acts as another node's ranks on its daemon."""
    assert cluster.ca is not None
    made = cluster.node_api.CreateJoinToken(nodes_pb2.CreateJoinTokenRequest(), timeout=10)
    outsider = identity_for(cluster.root / "outsider", "outsider")
    enroll(outsider, cluster.scheduler.address, made.token, cluster.ca)
    holder = cluster.node_of(done, 0)
    key = checkpoint_pb2.ShardKey(job_id=done.id, rank=0, step=0)
    with pytest.raises(grpc.RpcError) as denied:
        pull_shard(holder.checkpointd_address, key, identity=outsider)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "runs no rank of job" in denied.value.details()
    member = next(n for n in cluster.nodes.values() if n.node_id not in (holder.node_id, lost))
    insider = identity_for(member.root / "agent", member.node_id)
    header, _ = pull_shard(holder.checkpointd_address, key, identity=insider)  # a member may
    assert header.key.rank == 0
    channel = open_channel(holder.checkpointd_address, insider)
    with channel, pytest.raises(grpc.RpcError) as foreign:
        checkpoint_pb2_grpc.CheckpointServiceStub(channel).AcquireSlot(
            checkpoint_pb2.AcquireSlotRequest(key=key, size_bytes=64), timeout=10
        )
    assert foreign.value.code() == grpc.StatusCode.PERMISSION_DENIED


FAULTS = [
    "rank_killed",
    "agent_killed",
    "node_killed",
    "node_frozen",
    "fatal_xid",
    "application_xid",
]
IN_PLACE = ("rank_killed", "application_xid")  # the rank restarts on its own node


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_at_a_random_step_ends_with_the_fault_free_hash(
    cluster: Cluster, standalone_hash: str, fault: str
) -> None:
    """Every node enrolled with a join token; agents, checkpoint daemons and ranks speak
    mutual TLS with the node's certificate. A fault at a random step: the job ends with
    the fault-free hash, every step run, restored from memory (a killed node's rank from
    its buddy's replica, over TLS)."""
    if fault == "node_killed":  # every wire of the cluster is mutual TLS (the default)
        check_plaintext_refused(cluster)
    # Steps slow enough that the run outlasts the wait for a committed step below and
    # the fault's detection after it, on a busy machine too.
    job = cluster.submit("--step-seconds", str(SLOW_STEP_SECONDS), standby=fault not in IN_PLACE)
    victim_rank = random.randrange(4)
    at_step = random.randint(8, STEPS // 2)
    victim = cluster.node_of(job, victim_rank)
    if fault not in IN_PLACE:  # the leader starts the spare's standby once the job runs
        cluster.wait_for_standby(job)
    cluster.wait_for_step(job, victim_rank, at_step)
    # The fault after a committed step: before one, starting over is right (on a busy
    # machine the daemons' reports can trail the ranks' steps by more than 8 steps).
    cluster.wait_for_commit(job)
    if fault == "rank_killed":
        (pid,) = cluster.rank_pids(victim.node_id)
        killpg(pid, signal.SIGKILL)
    elif fault == "agent_killed":
        assert victim.agent is not None
        killpg(victim.agent.pid, signal.SIGKILL)  # its ranks and checkpointd live on
    elif fault == "node_killed":
        cluster.kill_node(victim.node_id)
    elif fault == "node_frozen":  # a silent host: no connection reset, its peers blocked
        cluster.kill_node(victim.node_id, signal.SIGSTOP)
    elif fault == "fatal_xid":
        cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    else:  # Xid 13, graphics engine exception: the agent ends the rank on that GPU
        cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=13))
    try:
        done = cluster.finish(job.id)
    finally:
        if fault == "node_frozen":  # its stopped processes would wait out a SIGTERM
            cluster.kill_node(victim.node_id)
    context = f"{fault} on {victim.node_id} (rank {victim_rank}) at step {at_step}"
    check_result(done, standalone_hash)
    assert done.generation >= 2, context
    moved = {a.node_id for a in done.rank_map.ranks}
    if fault in IN_PLACE:
        assert victim.node_id in moved, context  # restarted in place
    else:
        assert victim.node_id not in moved, context
        assert SPARE in moved, context
        # The spare's standby process took the rank: no fresh Python, no torch import.
        adopted = cluster.nodes[SPARE].rank_log(job.id, victim_rank).read_text()
        assert "--- pitstop: standby on GPU 0" in adopted, (context, adopted[-3000:])
        assert f"rank {victim_rank} joined generation" in adopted, (context, cluster.logs(job.id))
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set(), context
    # Recovered from the in-memory snapshots, not restarted from the beginning.
    restored = restored_steps(cluster, done)
    assert restored, (context, cluster.logs(job.id))
    assert min(restored) > 0, (context, restored)
    # The goodput account names the failure and splits its cost; `job show` prints it.
    goodput = done.goodput
    assert goodput.recoveries >= 1, goodput
    assert 0 < goodput.ratio < 1, goodput
    first, last = goodput.incidents[0], goodput.incidents[-1]
    # Under load a first decision can be superseded by a second (its own incident, not
    # resumed); the last one resumed the job.
    assert last.resumed, goodput
    assert last.resume_seconds > 0, goodput
    if fault not in IN_PLACE:
        assert victim.node_id in first.cause, goodput
    if fault in ("agent_killed", "node_killed", "node_frozen"):  # last sign of life to loss
        assert 0 < first.detect_seconds < 5, goodput
    shown = CliRunner().invoke(
        app, [*cluster.cli_options(), "job", "show", job.id], catch_exceptions=False
    )
    assert shown.exit_code == 0, shown.output
    assert "recoveries" in shown.output
    assert first.cause.split()[0] in shown.output
    if fault == "node_killed":  # the spare restored the rank from its buddy over TLS
        check_shards_stay_in_the_job(cluster, done, victim.node_id)


def test_spares_exhausted_the_job_shrinks_by_one_replica_and_finishes(
    cluster: Cluster, standalone_hash: str
) -> None:
    """The first lost node takes the spare; the second leaves none, so the job goes on
    with three replicas (min_dp 3). The example splits its global batch into the same
    four shards at any world size, so even the shrunk run ends bitwise equal."""
    job = cluster.submit("--step-seconds", str(STEP_SECONDS), min_dp=3)
    first = cluster.node_of(job, 1)
    cluster.wait_for_step(job, 1, 8)
    cluster.kill_node(first.node_id)
    cluster.job_event(job.id, "job.recovered")
    moved = cluster.get(job.id)
    assert SPARE in {a.node_id for a in moved.rank_map.ranks}
    second = cluster.node_of(moved, 2)
    cluster.wait_for_step(moved, 2, STEPS * 2 // 3)
    cluster.kill_node(second.node_id)
    shrunk = cluster.job_event(job.id, "job.recovering", "job.reconfigured")
    assert "shrunk to dp=3" in shrunk.reason, shrunk
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.rank_map.world_size == 3
    assert {a.node_id for a in done.rank_map.ranks}.isdisjoint({first.node_id, second.node_id})
    assert done.goodput.recoveries >= 2


def check_moved(
    cluster: Cluster, done: jobs_pb2.Job, victims: set[str], from_memory: bool = True
) -> None:
    """Every rank ran every step, and each victim's rank now runs on a spare; with
    `from_memory`, the ranks restored an in-memory snapshot rather than starting over."""
    placed = {a.node_id for a in done.rank_map.ranks}
    assert placed.isdisjoint(victims), (placed, victims)
    assert {SPARE, f"{SPARE}1"} <= placed, placed
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set()
    if from_memory:
        restored = restored_steps(cluster, done)
        assert restored, cluster.logs(done.id)
        assert min(restored) > 0, restored


@pytest.mark.parametrize("spares", [2])
@pytest.mark.parametrize("pair", ["apart", "buddies"])
def test_two_nodes_failing_at_once_take_both_spares(
    cluster: Cluster, standalone_hash: str, pair: str
) -> None:
    """Two workers killed together. Apart, each lost rank's replica is on a survivor and
    the job goes on from memory. A node and its buddy hold both copies of one rank's
    newest steps: the job goes back to the newest step still whole (here, with no
    durable flush yet, step 0) and still ends bitwise equal."""
    job = cluster.submit("--step-seconds", str(SLOW_STEP_SECONDS))
    first = cluster.node_of(job, 1).node_id
    second = cluster.buddy_of(first) if pair == "buddies" else cluster.apart_from(job, first)
    assert second in {a.node_id for a in job.rank_map.ranks} - {first}, (first, second)
    cluster.wait_for_step(job, 1, random.randint(8, STEPS // 2))
    if pair == "apart":
        cluster.wait_for_commit(job)
    for node_id in (first, second):
        cluster.kill_node(node_id)
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    check_moved(cluster, done, {first, second}, from_memory=pair == "apart")
    assert done.goodput.recoveries >= 1, done.goodput


@pytest.mark.parametrize("spares", [2])
def test_a_node_lost_during_a_recovery_is_replaced_too(
    cluster: Cluster, standalone_hash: str
) -> None:
    """The second node dies while the job is still recovering from the first: the
    recovery in flight is superseded by a new generation, and nothing is lost. The
    second is not in a buddy pair with the first (that loses both copies of a rank's
    newest steps: test_two_nodes_failing_at_once_take_both_spares[buddies])."""
    job = cluster.submit("--step-seconds", str(SLOW_STEP_SECONDS))
    first = cluster.node_of(job, 0).node_id
    second = cluster.apart_from(job, first)
    cluster.wait_for_step(job, 0, random.randint(8, STEPS // 2))
    cluster.wait_for_commit(job)
    cluster.kill_node(first)
    cluster.job_event(job.id, "job.recovering")
    assert cluster.get(job.id).state == common_pb2.JOB_STATE_RECOVERING
    cluster.kill_node(second)
    again = cluster.job_event(job.id, "job.reconfigured", "job.recovering", "job.recovered")
    assert again.kind != "job.recovered", again  # the second loss landed mid-recovery
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    check_moved(cluster, done, {first, second})
    assert done.goodput.recoveries >= 2, done.goodput
    # In place throughout: the first replacement, still starting, was started anew in
    # the second generation rather than left waiting in the first until the fallback.
    log = cluster.event_api.List(nodes_pb2.ListEventsRequest(job_id=job.id, limit=1000))
    restarts = [e.reason for e in log.events if e.kind == "job.restarting"]
    assert restarts == [], restarts
