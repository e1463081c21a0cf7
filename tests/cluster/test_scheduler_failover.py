"""The fault matrix, the control plane's faults: Redis flushed, the scheduler killed and
restarted, the leader killed (mid-run, mid-recovery), PostgreSQL restarted, a decision's
commands lost: the job trains on and ends with the fault-free hash."""

from __future__ import annotations

import random
from typing import Any

import pytest
import redis

from kit.faultcluster import (
    HANDOVER_STEP_SECONDS,
    SPARE,
    STEP_SECONDS,
    STEPS,
    Cluster,
    ProcessCluster,
    check_result,
    node_lost_events,
    steps_logged,
    steps_never_run,
    wait_until,
)
from pitstop.v1 import common_pb2, nodes_pb2

# Every scenario is a `cluster` test (the second pass of `make test`); the fixtures are
# in tests/cluster/conftest.py, the harness in tests/kit/faultcluster.py.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(360)]


def test_a_redis_flush_mid_run_loses_nothing(cluster: Cluster, standalone_hash: str) -> None:
    """Redis holds only hot state (heartbeat deadlines, step streams, live health): with
    all of the scheduler's keys gone mid-run, the job still finishes bitwise equal, and
    no node is declared lost for it."""
    job = cluster.submit("--step-seconds", str(STEP_SECONDS), standby=False)
    cluster.wait_for_step(job, 0, STEPS // 2)
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        keys = list(client.scan_iter(match=f"{cluster.redis_prefix}*"))
        assert keys  # the scheduler's hot state was there
        client.delete(*keys)
    finally:
        client.close()
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.generation == 1
    assert node_lost_events(cluster) == []


def test_the_scheduler_killed_and_restarted_mid_run_loses_nothing(
    process_cluster: ProcessCluster, standalone_hash: str
) -> None:
    """kill -9 of the only scheduler while the job trains, then a new process on the same
    port: the ranks never stop (they do not need the scheduler to step), the agents
    reconnect, and the new process finishes the job from PostgreSQL, with no node
    declared lost and no restart."""
    cluster = process_cluster.cluster
    (scheduler,) = process_cluster.schedulers
    job = cluster.submit("--step-seconds", str(STEP_SECONDS), standby=False)
    cluster.wait_for_step(job, 0, random.randint(8, STEPS // 2))
    scheduler.kill()
    scheduler.start()
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.generation == 1
    for rank in range(4):
        assert steps_logged(cluster, done, rank) == list(range(1, STEPS + 1))
    assert node_lost_events(cluster) == []


@pytest.mark.parametrize("standbys", [1])
def test_leader_failover_mid_run_and_the_new_leader_recovers_a_node(
    process_cluster: ProcessCluster, standalone_hash: str
) -> None:
    """Two schedulers on one PostgreSQL; the nodes talk to the standby. kill -9 of the
    scheduler that leads mid-run: the other takes the lease, the job trains on, and a
    node killed after the handover is recovered by the new leader."""
    cluster = process_cluster.cluster
    first, second = process_cluster.schedulers
    assert first.leading()
    assert not second.leading()
    # Paced so that the run outlasts the handover (a lease period or two) many times
    # over: the node must die mid-run, after it.
    job = cluster.submit("--step-seconds", str(HANDOVER_STEP_SECONDS))
    cluster.wait_for_step(job, 0, random.randint(3, STEPS // 5))
    # The one that leads now is killed: on a busy machine a late renewal may already
    # have handed the lease to the second mid-run, and killing the first would then
    # hand nothing over.
    wait_until(lambda: first.leading() or second.leading(), "a scheduler leads")
    leader, survivor = (first, second) if first.leading() else (second, first)
    log = cluster.event_api.List(nodes_pb2.ListEventsRequest(limit=1000))
    old_holder = [e for e in log.events if e.kind == "scheduler.leader"][-1].actor
    leader.kill()
    # The killed one may have re-taken its own lease just before (a late renewal, its
    # event logged too): the handover is the event of another holder.
    took_over = cluster.wait(
        lambda e: e.kind == "scheduler.leader" and e.actor != old_holder,
        "a scheduler.leader event of the surviving scheduler",
    )
    assert int(took_over.attributes["token"]) > 1, took_over
    # The event is committed before the process acts on it: wait for the act.
    wait_until(survivor.leading, "the surviving scheduler reports that it leads")
    victim = cluster.node_of(job, 2)
    running = cluster.get(job.id)
    assert running.state == common_pb2.JOB_STATE_RUNNING, (running, cluster.logs(job.id))
    cluster.kill_node(victim.node_id)
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert SPARE in {a.node_id for a in done.rank_map.ranks}
    assert victim.node_id not in {a.node_id for a in done.rank_map.ranks}
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set()
    assert [victim.node_id in lost for lost in node_lost_events(cluster)] == [True]


@pytest.mark.parametrize("own_postgres", [True])
def test_a_postgresql_restart_mid_run_loses_nothing(
    process_cluster: ProcessCluster, standalone_hash: str
) -> None:
    """PostgreSQL stops and starts again while the job trains: the scheduler is
    UNAVAILABLE meanwhile, the ranks keep stepping, and the job finishes bitwise equal
    with every step reported."""
    cluster = process_cluster.cluster
    job = cluster.submit("--step-seconds", str(STEP_SECONDS), standby=False)
    cluster.wait_for_step(job, 0, random.randint(8, STEPS // 3))
    process_cluster.restart_postgres()
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert done.generation == 1, cluster.logs(job.id)  # nothing was recovered
    for rank in range(4):
        assert steps_logged(cluster, done, rank) == list(range(1, STEPS + 1))
    assert node_lost_events(cluster) == []


def dropping_first_sends(generation: int) -> tuple[Any, list[str]]:
    """A CommandRouter.send_many (the fan-out of every decision) that loses the first
    StartRanks or Reconfigure (a survivor's is the shared `reconfigure_kept`) of
    `generation` to each node, as if the leader died (or
    its send failed) right after committing the decision; the dropped commands' nodes
    are listed."""
    from pitstop.scheduler.gateway import CommandRouter

    real = CommandRouter.send_many
    dropped: list[str] = []

    def lost(node_id: str, message: Any) -> bool:
        kind = message.WhichOneof("body")
        body = getattr(message, kind)
        if (
            kind in ("start_ranks", "reconfigure", "reconfigure_kept")
            and body.generation == generation
            and not (kind == "start_ranks" and body.standby_gpus)
            and node_id not in dropped
        ):
            dropped.append(node_id)
            return True
        return False

    async def send_many(self: CommandRouter, commands: list[tuple[str, Any]]) -> None:
        await real(self, [(node_id, m) for node_id, m in commands if not lost(node_id, m)])

    return send_many, dropped


@pytest.mark.parametrize("in_process", [True])
def test_a_recovery_whose_commands_were_lost_after_the_decision_still_recovers(
    cluster: Cluster, standalone_hash: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decision commits, and then not one of its commands arrives. Nothing waits for
    the deadline: the next tick re-sends what no agent acknowledged."""
    from pitstop.scheduler.gateway import CommandRouter

    job = cluster.submit("--step-seconds", str(STEP_SECONDS))
    send_many, dropped = dropping_first_sends(job.generation + 1)
    monkeypatch.setattr(CommandRouter, "send_many", send_many)
    wait_until(lambda: cluster.rank_pids(SPARE) != [], "a standby process on the spare")
    victim = cluster.node_of(job, 1)
    cluster.wait_for_step(job, 1, random.randint(8, STEPS // 2))
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    recovering = cluster.job_event(job.id, "job.recovering")
    # Recovered, or (under load the old generation may run to the end meanwhile) the
    # nodes started afresh from the restore step and finished.
    recovered = cluster.job_event(job.id, "job.recovered", "job.succeeded", "job.failed")
    assert recovered.kind != "job.failed", (recovered, cluster.logs(job.id))
    # Every node of the new generation lost its first command, and got it again.
    new_map = {a.node_id for a in cluster.get(job.id).rank_map.ranks}
    assert set(dropped) >= new_map, dropped
    took = recovered.time.ToDatetime() - recovering.time.ToDatetime()
    # No fallback: the recovery was carried out by the re-sends, well within its deadline
    # (ranks that stepped on meanwhile may cost a restart in place, never the deadline).
    log = cluster.event_api.List(nodes_pb2.ListEventsRequest(job_id=job.id, limit=1000))
    assert not [e for e in log.events if e.attributes.get("fallback") == "true"], log
    assert took.total_seconds() < 30, took
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set()


@pytest.mark.parametrize("standbys", [1])
def test_the_leader_killed_in_the_middle_of_a_recovery_the_new_leader_finishes_it(
    process_cluster: ProcessCluster, standalone_hash: str
) -> None:
    """kill -9 of the leader the moment it committed a recovery (its commands may or
    may not have gone out): the standby takes the lease, finds the recovery in
    PostgreSQL and carries it on."""
    cluster = process_cluster.cluster
    leader, standby = process_cluster.schedulers
    job = cluster.submit("--step-seconds", str(STEP_SECONDS))
    wait_until(lambda: cluster.rank_pids(SPARE) != [], "a standby process on the spare")
    victim = cluster.node_of(job, 2)
    cluster.wait_for_step(job, 2, random.randint(8, STEPS // 2))
    cluster.inject(victim.node_id, common_pb2.Fault(gpu_index=0, xid=79))
    cluster.job_event(job.id, "job.recovering")
    leader.kill()
    took_over = cluster.wait(lambda e: e.kind == "scheduler.leader", "a scheduler.leader event")
    assert standby.leading(), took_over
    done = cluster.finish(job.id)
    check_result(done, standalone_hash)
    assert victim.node_id not in {a.node_id for a in done.rank_map.ranks}
    for rank in range(4):
        assert steps_never_run(cluster, done, rank) == set()
