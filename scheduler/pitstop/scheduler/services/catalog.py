"""The checkpoint catalog: which steps of which ranks sit where, and what is committed.

A step is committed when every rank of its generation has it in memory on at least two
nodes; it is durable when every rank has a durable copy. Checkpoint daemons report what
they gain and drop; the restore path asks for the newest committed step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState, NodeState
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.services.nodes import get_node
from pitstop.v1 import checkpoint_pb2

log = logging.getLogger(__name__)

_TIERS = {
    checkpoint_pb2.SHARD_TIER_LOCAL: "local",
    checkpoint_pb2.SHARD_TIER_REPLICA: "replica",
    checkpoint_pb2.SHARD_TIER_DURABLE: "durable",
}
# Durable copies belong to no node; they are stored under this node id.
DURABLE_NODE = ""


async def world_size(session: AsyncSession, job: models.Job, generation: int) -> int:
    """Ranks of the generation: its rank map, or the spec's shape before placement."""
    placed = await session.scalar(
        select(func.count())
        .select_from(models.RankAssignment)
        .where(models.RankAssignment.job_id == job.id)
        .where(models.RankAssignment.generation == generation)
    )
    if placed:
        return int(placed)
    spec = spec_from_json(job.spec)
    return max(spec.tp, 1) * max(spec.pp, 1) * max(spec.dp, 1)


async def report_shards(
    session: AsyncSession, request: checkpoint_pb2.ReportShardsRequest
) -> dict[str, int]:
    """Apply one daemon's report; returns the newest committed step of each job touched."""
    node_id = request.node_id
    touched: dict[str, set[int]] = {}
    jobs: dict[str, models.Job | None] = {}
    if request.fresh_start:
        await forget_node(session, node_id)  # a new daemon: its memory starts empty
    for info in request.added:
        key = info.header.key
        if key.job_id not in jobs:
            # The job row first: concurrent reports of one job then queue here instead
            # of deadlocking over its checkpoint rows in _settle_step.
            jobs[key.job_id] = await session.get(models.Job, key.job_id, with_for_update=True)
        if jobs[key.job_id] is None:
            log.warning("node %s reported a shard of unknown job %s", node_id, key.job_id)
            continue
        tier = _TIERS.get(info.tier, "local")
        await session.execute(
            insert(models.Checkpoint)
            .values(job_id=key.job_id, step=key.step, generation=key.generation)
            .on_conflict_do_nothing()
        )
        holder = DURABLE_NODE if tier == "durable" else node_id
        values = {
            "job_id": key.job_id,
            "step": key.step,
            "rank": key.rank,
            "node_id": holder,
            "tier": tier,
            "checksum": info.header.checksum,
            "size_bytes": info.header.size_bytes,
        }
        await session.execute(
            insert(models.CheckpointShard)
            .values(**values)
            .on_conflict_do_update(
                index_elements=["job_id", "step", "rank", "node_id"],
                set_={
                    "tier": tier,
                    "checksum": values["checksum"],
                    "size_bytes": values["size_bytes"],
                },
            )
        )
        touched.setdefault(key.job_id, set()).add(key.step)
    removals = [(key, node_id) for key in request.removed]
    removals += [(key, DURABLE_NODE) for key in request.removed_durable]
    for key, holder in removals:
        await session.execute(
            delete(models.CheckpointShard)
            .where(models.CheckpointShard.job_id == key.job_id)
            .where(models.CheckpointShard.step == key.step)
            .where(models.CheckpointShard.rank == key.rank)
            .where(models.CheckpointShard.node_id == holder)
        )
    for error in request.flush_errors:
        record_event(
            session,
            "checkpoint.flush_failed",
            actor=f"checkpointd:{node_id}",
            node_id=node_id,
            reason=error[:1000],
        )
    committed: dict[str, int] = {}
    for job_id, steps in touched.items():
        job = jobs[job_id]
        assert job is not None
        for step in sorted(steps):
            await _settle_step(session, job, step)
        committed[job_id] = retained_step(job)
    return committed


def retained_step(job: models.Job) -> int:
    """The step a daemon must keep in memory for the job (it keeps the newest snapshot at
    or below the step it is told, besides the newest few above it): the committed step,
    but the restore step while a start or recovery is in flight. The old generation's
    ranks step on until their Reconfigure arrives; a restore step newer than the
    committed one (survivors' own snapshots) would otherwise fall out of the newest few
    before the ranks act on it."""
    if job.state in (JobState.STARTING, JobState.RECOVERING) and job.restore_step > 0:
        return job.restore_step
    return job.committed_step


async def _settle_step(session: AsyncSession, job: models.Job, step: int) -> None:
    """Mark the step committed/durable if it now is, and move the job's pointers."""
    checkpoint = await session.get(models.Checkpoint, (job.id, step), with_for_update=True)
    if checkpoint is None:
        return
    ranks = await world_size(session, job, checkpoint.generation)
    in_memory = (
        select(models.CheckpointShard.rank)
        .where(models.CheckpointShard.job_id == job.id)
        .where(models.CheckpointShard.step == step)
        .where(models.CheckpointShard.node_id != DURABLE_NODE)
        .group_by(models.CheckpointShard.rank)
        .having(func.count(func.distinct(models.CheckpointShard.node_id)) >= 2)
    )
    twice = len((await session.scalars(in_memory)).all())
    durable = await session.scalar(
        select(func.count(func.distinct(models.CheckpointShard.rank)))
        .where(models.CheckpointShard.job_id == job.id)
        .where(models.CheckpointShard.step == step)
        .where(models.CheckpointShard.node_id == DURABLE_NODE)
    )
    if twice >= ranks and not checkpoint.committed:
        checkpoint.committed = True
        # Not while recovering: checkpoint daemons keep the committed step in memory,
        # and the restore point a recovery chose must outlive the steps the survivors
        # take (and commit) before they reach the Reconfigure.
        if step > job.committed_step and job.state is not JobState.RECOVERING:
            job.committed_step = step
    if (durable or 0) >= ranks and not checkpoint.durable:
        checkpoint.durable = True
        if step > job.durable_step:
            job.durable_step = step


async def restore_point(
    session: AsyncSession, job: models.Job, step: int = 0
) -> checkpoint_pb2.GetRestorePointResponse:
    """The job's committed and durable steps, and where each rank's in-memory shard of
    `step` (0: the committed step) lies: node ids and their checkpoint daemons."""
    response = checkpoint_pb2.GetRestorePointResponse(
        committed_step=job.committed_step, durable_step=job.durable_step
    )
    step = step or job.committed_step
    if step:
        rows = await session.execute(
            select(
                models.CheckpointShard.rank,
                models.CheckpointShard.node_id,
                models.Node.checkpointd_address,
            )
            .outerjoin(models.Node, models.Node.id == models.CheckpointShard.node_id)
            .where(models.CheckpointShard.job_id == job.id)
            .where(models.CheckpointShard.step == step)
            .where(models.CheckpointShard.node_id != DURABLE_NODE)
            .order_by(models.CheckpointShard.rank, models.CheckpointShard.node_id)
        )
        for rank, node_id, address in rows:
            response.locations[rank].node_ids.append(node_id)
            response.locations[rank].addresses.append(address or "")
    return response


def choose_buddy(node: models.Node, candidates: Sequence[models.Node]) -> models.Node | None:
    """The next node after ``node`` in a ring ordered by failure domain (zone, block,
    rack), preferring one in another rack, else any other node: a buddy should not fail
    with the node it protects. Lost nodes and nodes without a checkpointd are skipped."""
    usable = sorted(
        (n for n in candidates if n.state is not NodeState.LOST and n.checkpointd_address),
        key=lambda n: (n.zone, n.block, n.rack, n.id),
    )
    others = [n for n in usable if n.id != node.id]
    if not others:
        return None
    ring_key = (node.zone, node.block, node.rack, node.id)
    # Walk the ring from just after the node, wrapping around (a stable sort keeps order).
    ordered = sorted(others, key=lambda n: (n.zone, n.block, n.rack, n.id) <= ring_key)
    here = (node.zone, node.block, node.rack)
    for candidate in ordered:
        if (candidate.zone, candidate.block, candidate.rack) != here:
            return candidate
    return ordered[0]


RESTORE_CANDIDATES = 64
"""How many of the newest held steps a recovery considers (a daemon keeps about 20)."""


async def restorable_step(session: AsyncSession, job: models.Job) -> int:
    """The step a recovery restores: the newest step of which every rank of its
    generation still has a copy on a node that is not lost or unhealthy (its own
    memory, a buddy's, or the durable store).

    After one failure that is the committed step (two copies) or newer: survivors keep
    their unreplicated snapshots, and the failed node's ranks need only their replica.
    When a node and its buddy fail together, both copies of some rank's newest steps
    are gone: the recovery goes back to the newest step still whole (an older one in
    memory, then the durable store), and to step 0 when there is none, rather than
    asking for a shard nobody holds."""
    alive = select(models.Node.id).where(
        models.Node.state.not_in((NodeState.LOST, NodeState.UNHEALTHY))
    )
    durable = models.CheckpointShard.node_id == DURABLE_NODE
    held = durable | models.CheckpointShard.node_id.in_(alive)
    newest = await _newest_whole(session, job, held, RESTORE_CANDIDATES)
    if newest is None:
        # Older than every candidate: the newest step whose durable copies are all
        # still on record (a daemon prunes its old durable copies and reports it, so
        # the job's durable step may no longer be whole). 0 when none: start over.
        newest = await _newest_whole(session, job, durable, None)
    return newest or 0


async def _newest_whole(
    session: AsyncSession, job: models.Job, where: Any, limit: int | None
) -> int | None:
    """The newest step (of the `limit` newest, None: all) of which the job's shards
    matching `where` hold every rank of the step's generation."""
    rows = await session.execute(
        select(models.CheckpointShard.step, func.count(func.distinct(models.CheckpointShard.rank)))
        .where(models.CheckpointShard.job_id == job.id)
        .where(where)
        .group_by(models.CheckpointShard.step)
        .order_by(models.CheckpointShard.step.desc())
        .limit(limit)
    )
    for step, ranks in rows.all():
        checkpoint = await session.get(models.Checkpoint, (job.id, step))
        if checkpoint is not None and ranks >= await world_size(
            session, job, checkpoint.generation
        ):
            return int(step)
    return None


async def forget_node(session: AsyncSession, node_id: str) -> None:
    """The node failed: count none of the shards it held in memory any more. Its
    checkpoint daemon is dead, or about to be restarted empty with the node, or on a
    node that is out; a restore must not be sent there, nor a restore step chosen
    because of it. The buddies' replicas of its ranks stay."""
    await session.execute(
        delete(models.CheckpointShard).where(models.CheckpointShard.node_id == node_id)
    )


async def buddy_of(session: AsyncSession, node_id: str) -> models.Node | None:
    """The node whose checkpoint daemon keeps `node_id`'s replicas (None: none fits)."""
    node = await get_node(session, node_id)
    candidates = (await session.scalars(select(models.Node))).all()
    return choose_buddy(node, candidates)
