"""The checkpoint catalog: a step is committed once every rank is in memory on two nodes;
durable once every rank has a durable copy; buddies sit in another rack."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest

from kit.agents import AgentSpec, run_agents
from kit.events import follow_events, wait_for
from kit.schedulers import SchedulerThread, scheduler_settings
from kit.stores import StoreUrls, unique
from pitstop.scheduler.db import models
from pitstop.scheduler.db.engine import session_factory
from pitstop.scheduler.domain import NodeState
from pitstop.scheduler.services.catalog import choose_buddy, restorable_step
from pitstop.scheduler.store import Store
from pitstop.v1 import (
    checkpoint_pb2,
    checkpoint_pb2_grpc,
    common_pb2,
    jobs_pb2,
    jobs_pb2_grpc,
    nodes_pb2,
    nodes_pb2_grpc,
)

L, R, D = (
    checkpoint_pb2.SHARD_TIER_LOCAL,
    checkpoint_pb2.SHARD_TIER_REPLICA,
    checkpoint_pb2.SHARD_TIER_DURABLE,
)


def shard(job_id: str, rank: int, step: int, tier: int) -> checkpoint_pb2.ShardInfo:
    key = checkpoint_pb2.ShardKey(job_id=job_id, rank=rank, step=step, generation=1)
    header = checkpoint_pb2.ShardHeader(key=key, size_bytes=10, checksum=f"c{rank}{step}")
    return checkpoint_pb2.ShardInfo(header=header, tier=tier)


@pytest.fixture
def catalog(scheduler: SchedulerThread) -> Any:
    return checkpoint_pb2_grpc.CheckpointCatalogServiceStub(scheduler.channel())


@pytest.fixture
def job_id(scheduler: SchedulerThread, db: Any) -> str:
    """A job of 2 ranks in its first generation, as once placed (the shards say 1)."""
    jobs = jobs_pb2_grpc.JobServiceStub(scheduler.channel())
    spec = jobs_pb2.JobSpec(name=unique("ckpt"), command=["x"], dp=2)
    job_id = str(jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job.id)
    db.execute("UPDATE jobs SET generation = 1 WHERE id = %s", (job_id,))
    return job_id


def report(catalog: Any, node: str, *shards: checkpoint_pb2.ShardInfo) -> dict[str, int]:
    reply = catalog.ReportShards(checkpoint_pb2.ReportShardsRequest(node_id=node, added=shards))
    return dict(reply.committed_steps)


def test_a_step_commits_when_every_rank_is_on_two_nodes(
    scheduler: SchedulerThread, catalog: Any, job_id: str
) -> None:
    assert report(catalog, "a", shard(job_id, 0, 5, L), shard(job_id, 1, 5, L)) == {job_id: 0}
    assert report(catalog, "b", shard(job_id, 0, 5, R)) == {job_id: 0}  # rank 1 once only
    assert report(catalog, "b", shard(job_id, 1, 5, R)) == {job_id: 5}
    point = catalog.GetRestorePoint(checkpoint_pb2.GetRestorePointRequest(job_id=job_id))
    assert point.committed_step == 5
    assert point.durable_step == 0
    assert {r: list(v.node_ids) for r, v in point.locations.items()} == {
        0: ["a", "b"],
        1: ["a", "b"],
    }
    jobs = jobs_pb2_grpc.JobServiceStub(scheduler.channel())
    assert jobs.Get(jobs_pb2.GetJobRequest(job_id=job_id)).committed_step == 5


def test_a_report_never_waits_for_a_job_row_a_decision_holds(
    scheduler: SchedulerThread, catalog: Any, job_id: str, stores: StoreUrls
) -> None:
    """Reports are telemetry: a deciding transaction holding the job's row must not make
    them queue (nor queue behind them). The step is committed on record at once; the
    job's pointer moves to it with the next report after the row is free, even one that
    commits nothing (the daemons keep the pointer's step: a step committed under a held
    row and never pointed to would be dropped from memory as the job steps on)."""
    jobs = jobs_pb2_grpc.JobServiceStub(scheduler.channel())
    with psycopg.connect(stores.database_url) as decision:
        decision.execute("SELECT id FROM jobs WHERE id = %s FOR NO KEY UPDATE", (job_id,))
        both = (shard(job_id, 0, 5, L), shard(job_id, 1, 5, L))
        request = checkpoint_pb2.ReportShardsRequest(node_id="a", added=both)
        catalog.ReportShards(request, timeout=10)
        replicas = (shard(job_id, 0, 5, R), shard(job_id, 1, 5, R))
        request = checkpoint_pb2.ReportShardsRequest(node_id="b", added=replicas)
        assert dict(catalog.ReportShards(request, timeout=10).committed_steps) == {job_id: 0}
        asked = checkpoint_pb2.GetRestorePointRequest(job_id=job_id, step=5)
        point = catalog.GetRestorePoint(asked)
        assert {r: sorted(v.node_ids) for r, v in point.locations.items()} == {
            0: ["a", "b"],
            1: ["a", "b"],
        }
        decision.rollback()
    assert jobs.Get(jobs_pb2.GetJobRequest(job_id=job_id)).committed_step == 0
    assert report(catalog, "a", shard(job_id, 0, 6, L), shard(job_id, 1, 6, L)) == {job_id: 5}
    assert jobs.Get(jobs_pb2.GetJobRequest(job_id=job_id)).committed_step == 5
    assert report(catalog, "b", shard(job_id, 0, 6, R), shard(job_id, 1, 6, R)) == {job_id: 6}
    assert jobs.Get(jobs_pb2.GetJobRequest(job_id=job_id)).committed_step == 6


def test_a_step_whose_advance_a_held_row_skipped_is_pointed_to_with_no_later_report(
    stores: StoreUrls, tmp_path: Path
) -> None:
    """A running job that stands still (one rank stopped, the others waiting on it in a
    collective) sends no more reports: the step committed under a held row is pointed to
    by the leader, not left for a report that never comes."""
    database = stores.fresh_database()
    leader = SchedulerThread(
        scheduler_settings(
            stores,
            tmp_path / "leader",
            database_url=database,
            redis_prefix=f"{stores.redis_prefix}{unique('lag')}:",
            leader_loops=True,
        )
    )
    try:
        reports = checkpoint_pb2_grpc.CheckpointCatalogServiceStub(leader.channel())
        jobs = jobs_pb2_grpc.JobServiceStub(leader.channel())
        spec = jobs_pb2.JobSpec(name=unique("lag"), command=["x"], dp=2)
        job_id = str(jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job.id)
        with psycopg.connect(database, autocommit=True) as db:
            db.execute("UPDATE jobs SET generation = 1, state = 'running' WHERE id = %s", (job_id,))
            with db.transaction():
                db.execute("SELECT id FROM jobs WHERE id = %s FOR NO KEY UPDATE", (job_id,))
                assert report(reports, "a", shard(job_id, 0, 5, L), shard(job_id, 1, 5, L)) == {
                    job_id: 0
                }
                assert report(reports, "b", shard(job_id, 0, 5, R), shard(job_id, 1, 5, R)) == {
                    job_id: 0
                }
        deadline = time.monotonic() + 30
        while jobs.Get(jobs_pb2.GetJobRequest(job_id=job_id)).committed_step != 5:
            assert time.monotonic() < deadline, "the committed pointer stayed behind step 5"
            time.sleep(0.05)  # a poll's interval: the condition ends the wait
    finally:
        leader.stop()


def test_reports_of_one_step_from_every_holder_at_once_commit_it(catalog: Any, job_id: str) -> None:
    """Concurrent reports are serialised by the step's checkpoint row: whichever lands
    last counts the others' shards, so every step commits."""
    holders = {"a": L, "b": R, "c": R}

    def one(step: int, node: str) -> None:
        report(
            catalog,
            node,
            shard(job_id, 0, step, holders[node]),
            shard(job_id, 1, step, holders[node]),
        )

    with ThreadPoolExecutor(len(holders)) as pool:
        for step in range(1, 21):
            list(pool.map(lambda node: one(step, node), holders))  # noqa: B023 (waited for here)
    assert report(catalog, "a") == {}
    point = catalog.GetRestorePoint(checkpoint_pb2.GetRestorePointRequest(job_id=job_id))
    assert point.committed_step == 20
    assert sorted(point.locations[0].node_ids) == ["a", "b", "c"]


def test_a_daemons_backlog_lands_in_one_report(catalog: Any, job_id: str) -> None:
    """A daemon whose reports failed for a while sends everything since in one report
    (here 1,200 shards from each of two nodes): it lands whole, within the daemon's
    deadline, and commits every step it completes."""
    steps = range(1, 601)
    for node, tier in (("a", L), ("b", R)):
        backlog = [shard(job_id, rank, step, tier) for step in steps for rank in (0, 1)]
        request = checkpoint_pb2.ReportShardsRequest(node_id=node, added=backlog)
        reply = catalog.ReportShards(request, timeout=10)
    assert dict(reply.committed_steps) == {job_id: 600}
    for step in (1, 300, 600):
        asked = checkpoint_pb2.GetRestorePointRequest(job_id=job_id, step=step)
        point = catalog.GetRestorePoint(asked)
        assert {r: sorted(v.node_ids) for r, v in point.locations.items()} == {
            0: ["a", "b"],
            1: ["a", "b"],
        }


def test_while_a_recovery_is_in_flight_daemons_are_told_to_keep_its_restore_step(
    catalog: Any, job_id: str, db: Any
) -> None:
    """The old generation's ranks step on until their Reconfigure arrives and commit newer
    steps; a daemon keeps the newest snapshot at or below the step it is told, so it is
    told the restore step until the recovery is over."""
    both = (shard(job_id, 0, 5, L), shard(job_id, 1, 5, L))
    assert report(catalog, "a", *both) == {job_id: 0}
    assert report(catalog, "b", shard(job_id, 0, 5, R), shard(job_id, 1, 5, R)) == {job_id: 5}
    # The recovery restores step 7: newer than the committed step, whole on live nodes.
    # Its new generation is 2; the old one's ranks step on and commit step 30.
    db.execute(
        "UPDATE jobs SET state = 'recovering', restore_step = 7, generation = 2 WHERE id = %s",
        (job_id,),
    )
    newer = (shard(job_id, 0, 30, L), shard(job_id, 1, 30, L))
    assert report(catalog, "a", *newer) == {job_id: 7}
    assert report(catalog, "b", shard(job_id, 0, 30, R), shard(job_id, 1, 30, R)) == {job_id: 7}
    db.execute("UPDATE jobs SET state = 'running' WHERE id = %s", (job_id,))
    later = (shard(job_id, 0, 31, L), shard(job_id, 1, 31, L))
    assert report(catalog, "a", *later) == {job_id: 5}
    assert report(catalog, "b", shard(job_id, 0, 31, R), shard(job_id, 1, 31, R)) == {job_id: 31}


def test_durable_needs_every_rank_and_removed_shards_uncommit_nothing_retroactively(
    catalog: Any, job_id: str
) -> None:
    report(catalog, "a", shard(job_id, 0, 9, D))
    point = catalog.GetRestorePoint(checkpoint_pb2.GetRestorePointRequest(job_id=job_id))
    assert point.durable_step == 0
    report(catalog, "a", shard(job_id, 1, 9, D))
    point = catalog.GetRestorePoint(checkpoint_pb2.GetRestorePointRequest(job_id=job_id))
    assert point.durable_step == 9


def test_an_unhealthy_nodes_shards_are_forgotten(
    scheduler: SchedulerThread, catalog: Any, job_id: str, short_dir: Path
) -> None:
    """A node out with a fatal Xid no longer counts as a holder: no restore is sent
    there and no restore step is chosen because of it (its daemon may come back empty)."""
    events = follow_events(scheduler.address)
    root = short_dir  # short: the agent socket
    try:
        with run_agents(scheduler.address, root, [AgentSpec("fa", gpus=1)]):
            wait_for(events, lambda e: e.kind == "node.registered" and e.node_id == "fa")
            report(catalog, "fa", shard(job_id, 0, 5, L), shard(job_id, 1, 5, L))
            report(catalog, "fb", shard(job_id, 0, 5, R), shard(job_id, 1, 5, R))
            nodes = nodes_pb2_grpc.NodeServiceStub(scheduler.channel())
            nodes.InjectFault(
                nodes_pb2.InjectFaultRequest(
                    node_id="fa", fault=common_pb2.Fault(gpu_index=0, xid=79)
                )
            )
            wait_for(events, lambda e: e.kind == "node.unhealthy" and e.node_id == "fa")
            request = checkpoint_pb2.GetRestorePointRequest(job_id=job_id, step=5)
            point = catalog.GetRestorePoint(request)
            assert {r: list(v.node_ids) for r, v in point.locations.items()} == {
                0: ["fb"],
                1: ["fb"],
            }
    finally:
        events.close()


def test_a_restarted_daemon_starts_with_nothing_on_record(catalog: Any, job_id: str) -> None:
    report(catalog, "ra", shard(job_id, 0, 7, L), shard(job_id, 1, 7, L))
    report(catalog, "rb", shard(job_id, 0, 7, R), shard(job_id, 1, 7, R))
    fresh = checkpoint_pb2.ReportShardsRequest(node_id="ra", fresh_start=True)
    catalog.ReportShards(fresh)
    request = checkpoint_pb2.GetRestorePointRequest(job_id=job_id, step=7)
    point = catalog.GetRestorePoint(request)
    assert {r: list(v.node_ids) for r, v in point.locations.items()} == {0: ["rb"], 1: ["rb"]}


def restore_step_of(scheduler: SchedulerThread, job_id: str) -> int:
    """The step a recovery of the job would restore now, read in the scheduler's loop."""
    store = Store(session_factory(scheduler.scheduler.engine), scheduler.scheduler.bus)

    async def read() -> int:
        async with store.read() as session:
            job = await session.get(models.Job, job_id)
            assert job is not None
            return await restorable_step(session, job)

    return int(scheduler._call(read()))


def test_a_node_and_its_buddy_lost_together_restore_the_newest_whole_step(
    scheduler: SchedulerThread, catalog: Any, job_id: str
) -> None:
    """Both copies of the newest steps gone (a node and its buddy): the restore goes
    back to an older step still whole in memory, then the durable store, then step 0;
    never to a step no live node or store holds."""
    for node_id in ("wa", "wb", "wc"):
        scheduler.register_node(node_id, gpus=1)

    def restorable() -> int:
        return restore_step_of(scheduler, job_id)

    both = [(0, L), (1, L)]
    report(catalog, "wc", *(shard(job_id, r, 4, t) for r, t in both))
    report(catalog, "wa", *(shard(job_id, r, 3, D) for r, _ in both))  # flushed: durable
    for step in (5, 6):
        report(catalog, "wa", *(shard(job_id, r, step, L) for r, _ in both))
        assert report(catalog, "wb", *(shard(job_id, r, step, R) for r, _ in both)) == {
            job_id: step
        }
    assert restorable() == 6
    for node_id in ("wa", "wb"):  # both come back empty: their memory is gone
        catalog.ReportShards(checkpoint_pb2.ReportShardsRequest(node_id=node_id, fresh_start=True))
    assert restorable() == 4  # wc still holds step 4 of both ranks
    catalog.ReportShards(checkpoint_pb2.ReportShardsRequest(node_id="wc", fresh_start=True))
    assert restorable() == 3  # the durable store
    # A daemon prunes its old durable copy of rank 0: step 3 is no longer whole, though
    # it stays the job's durable step on record. Nothing is left: start over.
    pruned = checkpoint_pb2.ReportShardsRequest(
        node_id="wa", removed_durable=[shard(job_id, 0, 3, D).header.key]
    )
    catalog.ReportShards(pruned)
    assert restorable() == 0


def test_with_no_whole_step_anywhere_the_restore_starts_over(
    scheduler: SchedulerThread, catalog: Any, job_id: str
) -> None:
    scheduler.register_node("wd", gpus=1)
    report(catalog, "wd", shard(job_id, 0, 8, L))  # rank 1 never snapshotted
    assert restore_step_of(scheduler, job_id) == 0


def test_shards_of_unknown_jobs_are_ignored(catalog: Any) -> None:
    assert report(catalog, "a", shard("j-doesnotexist", 0, 1, L)) == {}


def node(node_id: str, rack: str, state: NodeState = NodeState.READY) -> models.Node:
    return models.Node(
        id=node_id, zone="z", block="b", rack=rack, state=state, checkpointd_address=f"{node_id}:1"
    )


def test_buddy_is_the_next_node_in_another_rack() -> None:
    fleet = [node("n1", "r1"), node("n2", "r1"), node("n3", "r2"), node("n4", "r2")]
    assert choose_buddy(fleet[0], fleet).id == "n3"  # n2 shares n1's rack
    assert choose_buddy(fleet[2], fleet).id == "n1"  # wraps around
    assert choose_buddy(fleet[3], fleet).id == "n1"


def test_buddy_falls_back_to_the_same_rack_and_skips_lost_nodes() -> None:
    fleet = [node("n1", "r1"), node("n2", "r1"), node("n3", "r2", NodeState.LOST)]
    assert choose_buddy(fleet[0], fleet).id == "n2"
    assert choose_buddy(fleet[0], fleet[:1]) is None


def test_buddy_skips_nodes_being_replaced() -> None:
    """An unhealthy node is being replaced and no restore counts its memory: a replica
    pushed there would protect nothing, so it is no node's buddy."""
    fleet = [node("n1", "r1"), node("n2", "r1"), node("n3", "r2", NodeState.UNHEALTHY)]
    assert choose_buddy(fleet[0], fleet).id == "n2"


def set_node(scheduler: SchedulerThread, node_id: str, state: NodeState, address: str) -> None:
    """Put a registered node in `state` with a checkpoint daemon at `address`, directly."""
    store = Store(session_factory(scheduler.scheduler.engine), scheduler.scheduler.bus)

    async def write() -> None:
        async with store.write() as session:
            row = await session.get(models.Node, node_id)
            assert row is not None
            row.state, row.checkpointd_address = state, address

    scheduler._call(write())


def test_a_report_naming_a_buddy_being_replaced_is_told_to_ask_again(
    scheduler: SchedulerThread, catalog: Any, job_id: str
) -> None:
    """A daemon keeps its buddy for a while; when that node turns unhealthy (a fatal Xid)
    its next shard report hears so, and GetBuddy names another node: the replicas of the
    steps after go where a restore counts them."""
    for node_id, rack in (("ua", "r1"), ("ub", "r2"), ("uc", "r3")):
        scheduler.register_node(node_id, gpus=1, rack=rack)
        set_node(scheduler, node_id, NodeState.READY, f"{node_id}:7000")

    def buddy(node_id: str) -> str:
        request = checkpoint_pb2.GetBuddyRequest(node_id=node_id)
        return str(catalog.GetBuddy(request).buddy_node_id)

    def unfit(named: str) -> bool:
        request = checkpoint_pb2.ReportShardsRequest(
            node_id="ua", added=[shard(job_id, 0, 1, L)], buddy_node_id=named
        )
        return bool(catalog.ReportShards(request).buddy_unfit)

    assert buddy("ua") == "ub"
    assert not unfit("ub")
    assert not unfit("")  # no buddy named: nothing to say
    set_node(scheduler, "ub", NodeState.UNHEALTHY, "ub:7000")
    assert unfit("ub")
    assert buddy("ua") == "uc"
    assert not unfit("uc")
    assert unfit("nobody")  # a node the scheduler does not know holds nothing that counts


def test_a_report_is_told_which_of_the_jobs_it_holds_ended(
    scheduler: SchedulerThread, catalog: Any, job_id: str
) -> None:
    """Their snapshots restore nothing any more: the daemon frees that memory. A job
    running, or one the scheduler does not know, is not named."""
    jobs = jobs_pb2_grpc.JobServiceStub(scheduler.channel())
    spec = jobs_pb2.JobSpec(name=unique("done"), command=["x"], dp=1)
    done = str(jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job.id)
    jobs.Cancel(jobs_pb2.JobControlRequest(job_id=done))
    asked = checkpoint_pb2.ReportShardsRequest(
        node_id="a", held_jobs=[job_id, done, "j-nobodyknows"]
    )
    assert list(catalog.ReportShards(asked).ended_jobs) == [done]
    with_shards = checkpoint_pb2.ReportShardsRequest(
        node_id="a", added=[shard(job_id, 0, 5, L)], held_jobs=[job_id, done]
    )
    reply = catalog.ReportShards(with_shards)
    assert list(reply.ended_jobs) == [done]
    assert dict(reply.committed_steps) == {job_id: 0}

    too_many = checkpoint_pb2.ReportShardsRequest(
        node_id="a", held_jobs=[f"j-{i}" for i in range(1001)]
    )
    with pytest.raises(grpc.RpcError) as refused:
        catalog.ReportShards(too_many)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "held_jobs" in refused.value.details()
