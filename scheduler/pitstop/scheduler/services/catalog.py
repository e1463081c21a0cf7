"""The checkpoint catalog: which steps of which ranks sit where, and what is committed.

A step is committed when every rank of its generation has it in memory on at least two
nodes; it is durable when every rank has a durable copy. Checkpoint daemons report what
they gain and drop; the restore path asks for the newest committed step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import (
    TERMINAL_JOB_STATES,
    JobState,
    NodeState,
    RestorePoint,
    ShardReport,
)
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.services.nodes import get_node

log = logging.getLogger(__name__)

# Durable copies belong to no node; they are stored under this node id.
DURABLE_NODE = ""


MAX_HELD_JOBS = 1000
"""The most jobs one report may ask about (a node runs a handful)."""


async def ended_jobs(session: AsyncSession, job_ids: Sequence[str]) -> list[str]:
    """Of `job_ids`, the jobs that ended: their snapshots in a daemon's memory restore
    nothing any more. A job this scheduler does not know is not named (a daemon may
    hold a test's or another cluster's shards; it keeps them)."""
    if not job_ids:
        return []
    rows = await session.scalars(
        select(models.Job.id)
        .where(models.Job.id.in_(sorted(set(job_ids))))
        .where(models.Job.state.in_(TERMINAL_JOB_STATES))
    )
    return sorted(rows)


async def world_size(session: AsyncSession, job: models.Job, generation: int) -> int:
    """Ranks of the generation: its rank map, or the spec's shape before placement."""
    placed = await session.scalar(
        select(func.count())
        .select_from(models.RankAssignment)
        .where(models.RankAssignment.job_id == job.id)
        .where(models.RankAssignment.in_generation(generation))
    )
    if placed:
        return int(placed)
    spec = spec_from_json(job.spec)
    return max(spec.tp, 1) * max(spec.pp, 1) * max(spec.dp, 1)


async def report_shards(session: AsyncSession, report: ShardReport) -> dict[str, Settled]:
    """Apply one daemon's report; returns, per job touched, the newest steps it made
    committed or durable (`advance_jobs` moves the jobs' pointers, in a transaction of
    its own).

    A handful of statements whatever the report's size: a daemon whose reports failed
    sends everything since in one, and a report that took a round trip per shard would
    outlast its deadline on a busy machine, fail, and come back bigger. The job's row is
    never locked here: a report is telemetry, and a deciding transaction (which locks the
    row) must not queue behind reports. Concurrent reports of one step are serialised by
    the step's checkpoint row instead (`_settle`)."""
    node_id = report.node_id
    if report.fresh_start:
        await forget_node(session, node_id)  # a new daemon: its memory starts empty
    named = sorted({info.key.job_id for info in report.added})
    jobs = {
        job.id: job
        for job in await session.scalars(select(models.Job).where(models.Job.id.in_(named)))
    }
    for job_id in sorted(set(named) - set(jobs)):
        log.warning("node %s reported a shard of unknown job %s", node_id, job_id)
    steps: dict[tuple[str, int], int] = {}
    shards: dict[tuple[str, int, int, str], dict[str, Any]] = {}
    for info in report.added:
        key = info.key
        if key.job_id not in jobs:
            continue
        steps.setdefault((key.job_id, key.step), key.generation)
        tier = info.tier
        holder = DURABLE_NODE if tier == "durable" else node_id
        shards[(key.job_id, key.step, key.rank, holder)] = {
            "job_id": key.job_id,
            "step": key.step,
            "rank": key.rank,
            "node_id": holder,
            "tier": tier,
            "checksum": info.checksum,
            "size_bytes": info.size_bytes,
        }
    # Rows in one order everywhere: two reports never wait on each other crosswise.
    for chunk in _chunks(sorted(steps.items())):
        await session.execute(
            insert(models.Checkpoint)
            .values([{"job_id": j, "step": st, "generation": g} for (j, st), g in chunk])
            .on_conflict_do_nothing()
        )
    for rows in _chunks([shards[k] for k in sorted(shards)]):
        upsert = insert(models.CheckpointShard).values(rows)
        await session.execute(
            upsert.on_conflict_do_update(
                index_elements=["job_id", "step", "rank", "node_id"],
                set_={
                    "tier": upsert.excluded.tier,
                    "checksum": upsert.excluded.checksum,
                    "size_bytes": upsert.excluded.size_bytes,
                },
            )
        )
    gone = [(k.job_id, k.step, k.rank, node_id) for k in report.removed]
    gone += [(k.job_id, k.step, k.rank, DURABLE_NODE) for k in report.removed_durable]
    shard = models.CheckpointShard
    for chunk in _chunks(sorted(set(gone))):
        await session.execute(
            delete(shard).where(
                tuple_(shard.job_id, shard.step, shard.rank, shard.node_id).in_(chunk)
            )
        )
    for error in report.flush_errors:
        record_event(
            session,
            "checkpoint.flush_failed",
            actor=f"checkpointd:{node_id}",
            node_id=node_id,
            reason=error[:1000],
        )
    touched: dict[str, list[int]] = {}
    for job_id, step in sorted(steps):
        touched.setdefault(job_id, []).append(step)
    return {
        job_id: await _settle(session, jobs[job_id], found) for job_id, found in touched.items()
    }


def _chunks(rows: list[Any], size: int = 1000) -> Iterator[list[Any]]:
    """Rows in statements of at most `size` (PostgreSQL takes 65,535 parameters)."""
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


@dataclass
class Settled:
    """The newest steps of one job that a report made committed and durable (0: none)."""

    committed: int = 0
    durable: int = 0


async def advance_jobs(session: AsyncSession, settled: dict[str, Settled]) -> dict[str, int]:
    """Move each job's committed and durable steps forward to what a report settled,
    never backwards, and the committed step not while the job recovers (daemons keep the
    committed step in memory, and the restore point a recovery chose must outlive the
    steps the survivors take and commit before they reach the Reconfigure). A job whose
    row another transaction holds (a decision, the step telemetry) is skipped, not waited
    for: the next report moves it on, to the newest step its generation has committed,
    not only to what that report settled. Returns the step each job's daemons must keep
    (`retained_step`)."""
    for job_id, found in sorted(settled.items()):
        committed = max(found.committed, await _newest_committed(session, job_id))
        await _advance(session, job_id, models.Job.committed_step, committed)
        await _advance(session, job_id, models.Job.durable_step, found.durable)
    if not settled:
        return {}
    rows = await session.scalars(
        select(models.Job)
        .where(models.Job.id.in_(sorted(settled)))
        .execution_options(populate_existing=True)
    )
    return {job.id: retained_step(job) for job in rows}


async def _newest_committed(session: AsyncSession, job_id: str) -> int:
    """The newest step above the job's committed pointer that its current generation has
    committed (0: none). A step committed by a report whose advance was skipped would
    otherwise wait for a newer one to commit, and the daemons, told to keep only the
    older pointer's step, would drop it: a recovery then finds no whole step in memory."""
    return (await lagging_commits(session, [job_id])).get(job_id, 0)


async def lagging_commits(session: AsyncSession, job_ids: list[str]) -> dict[str, int]:
    """The jobs among `job_ids` whose current generation committed a step above their
    committed pointer, each with the newest such step. An index range over the few steps
    above each pointer, not the jobs' history; normally empty, as a report moves the
    pointer in the transaction that commits the step."""
    if not job_ids:
        return {}
    checkpoint, job = models.Checkpoint, models.Job
    rows = await session.execute(
        select(checkpoint.job_id, func.max(checkpoint.step))
        .join(job, job.id == checkpoint.job_id)
        .where(checkpoint.job_id.in_(job_ids))
        .where(checkpoint.step > job.committed_step)
        .where(checkpoint.generation == job.generation)
        .where(checkpoint.committed.is_(True))
        .group_by(checkpoint.job_id)
    )
    return {job_id: int(step) for job_id, step in rows}


async def catch_up_committed(session: AsyncSession, lagging: dict[str, int]) -> None:
    """Move lagging committed pointers (`lagging_commits`) forward. A report whose advance
    was skipped (another transaction held the job's row) leaves its step to the next
    report, and when the job stands still (a rank stopped, the others waiting on it in a
    collective) no report comes: the leader's loop calls this instead."""
    for job_id, step in sorted(lagging.items()):
        await _advance(session, job_id, models.Job.committed_step, step)


async def _advance(session: AsyncSession, job_id: str, column: Any, step: int) -> None:
    if not step:
        return
    free = (
        select(models.Job.id)
        .where(models.Job.id == job_id)
        .where(column < step)
        .with_for_update(key_share=True, skip_locked=True)
    )
    if column is models.Job.committed_step:
        free = free.where(models.Job.state != JobState.RECOVERING)
    await session.execute(
        update(models.Job).where(models.Job.id == free.scalar_subquery()).values({column: step})
    )


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


async def _settle(session: AsyncSession, job: models.Job, steps: list[int]) -> Settled:
    """Mark the job's `steps` committed/durable where they now are; returns the newest of
    each. The steps' checkpoint rows are locked (in step order): a second report of a
    step waits here, then counts this one's shards too."""
    shard = models.CheckpointShard
    locked = (
        await session.scalars(
            select(models.Checkpoint)
            .where(models.Checkpoint.job_id == job.id)
            .where(models.Checkpoint.step.in_(steps))
            .order_by(models.Checkpoint.step)
            .with_for_update(key_share=True)
        )
    ).all()
    twice_held = (
        select(shard.step, shard.rank)
        .where(shard.job_id == job.id)
        .where(shard.step.in_(steps))
        .where(shard.node_id != DURABLE_NODE)
        .group_by(shard.step, shard.rank)
        .having(func.count(func.distinct(shard.node_id)) >= 2)
        .subquery()
    )
    twice: dict[int, int] = dict(
        (
            await session.execute(
                select(twice_held.c.step, func.count()).group_by(twice_held.c.step)
            )
        ).all()
    )
    durable: dict[int, int] = dict(
        (
            await session.execute(
                select(shard.step, func.count(func.distinct(shard.rank)))
                .where(shard.job_id == job.id)
                .where(shard.step.in_(steps))
                .where(shard.node_id == DURABLE_NODE)
                .group_by(shard.step)
            )
        ).all()
    )
    sizes = await _world_sizes(session, job, {c.generation for c in locked})
    found = Settled()
    for checkpoint in locked:
        ranks = sizes[checkpoint.generation]
        if twice.get(checkpoint.step, 0) >= ranks:
            checkpoint.committed = True
        if durable.get(checkpoint.step, 0) >= ranks:
            checkpoint.durable = True
        if checkpoint.committed:
            found.committed = max(found.committed, checkpoint.step)
        if checkpoint.durable:
            found.durable = max(found.durable, checkpoint.step)
    return found


async def _world_sizes(
    session: AsyncSession, job: models.Job, generations: set[int]
) -> dict[int, int]:
    """Ranks of each generation (`world_size`), in one query."""
    placed = {}
    for generation in sorted(generations):  # a checkpoint's few generations
        placed[generation] = await session.scalar(
            select(func.count())
            .select_from(models.RankAssignment)
            .where(models.RankAssignment.job_id == job.id)
            .where(models.RankAssignment.in_generation(generation))
        )
    shape = spec_from_json(job.spec)
    planned = max(shape.tp, 1) * max(shape.pp, 1) * max(shape.dp, 1)
    return {g: int(placed.get(g) or planned) for g in generations}


async def restore_point(session: AsyncSession, job: models.Job, step: int = 0) -> RestorePoint:
    """The job's committed and durable steps, and where each rank's in-memory shard of
    `step` (0: the committed step) lies: node ids and their checkpoint daemons."""
    members = await session.scalars(
        select(func.distinct(models.RankAssignment.node_id))
        .where(models.RankAssignment.job_id == job.id)
        .where(models.RankAssignment.current())
    )
    point = RestorePoint(job.committed_step, job.durable_step, tuple(sorted(members)))
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
            point.locations.setdefault(rank, []).append((node_id, address or ""))
    return point


HOLDS_NO_COPIES = (NodeState.LOST, NodeState.UNHEALTHY)
"""Nodes whose in-memory copies no restore counts: lost, or about to be replaced. A
buddy is never one of them: a replica pushed there would protect nothing."""


def choose_buddy(node: models.Node, candidates: Sequence[models.Node]) -> models.Node | None:
    """The next node after ``node`` in a ring ordered by failure domain (zone, block,
    rack), preferring one in another rack, else any other node: a buddy should not fail
    with the node it protects. Lost and unhealthy nodes (HOLDS_NO_COPIES) and nodes
    without a checkpointd are skipped."""
    usable = sorted(
        (n for n in candidates if n.state not in HOLDS_NO_COPIES and n.checkpointd_address),
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


async def restorable_step(session: AsyncSession, job: models.Job) -> int:
    """The step a recovery restores: the newest step of which every rank of its
    generation still has a copy on a node that is not lost or unhealthy (its own
    memory, a buddy's, or the durable store).

    After one failure that is the committed step (two copies) or newer: survivors keep
    their unreplicated snapshots, and the failed node's ranks need only their replica.
    When a node and its buddy fail together, both copies of some rank's newest steps
    are gone: the recovery goes back to the newest step still whole (an older one in
    memory, then the durable store), and to step 0 when there is none, rather than
    asking for a shard nobody holds. Going back past the committed step is logged with
    the ranks that lack a copy."""
    alive = select(models.Node.id).where(models.Node.state.not_in(HOLDS_NO_COPIES))
    held = (models.CheckpointShard.node_id == DURABLE_NODE) | models.CheckpointShard.node_id.in_(
        alive
    )
    newest = await _newest_whole(session, job, held)
    if newest < job.committed_step:
        have = await session.scalars(
            select(func.distinct(models.CheckpointShard.rank))
            .where(models.CheckpointShard.job_id == job.id)
            .where(models.CheckpointShard.step == job.committed_step)
            .where(held)
        )
        missing = sorted(set(range(await world_size(session, job, job.generation))) - set(have))
        log.warning(
            "job %s: restoring step %d, older than its committed step %d: ranks %s have no "
            "copy of it left on a live node (a node and its buddy lost together?)",
            job.id,
            newest,
            job.committed_step,
            missing,
        )
    return newest


async def _newest_whole(session: AsyncSession, job: models.Job, where: Any) -> int:
    """The newest step (0: none) of which the job's shards matching `where` hold every
    rank of the step's generation, in one query."""
    shape = spec_from_json(job.spec)
    planned = max(shape.tp, 1) * max(shape.pp, 1) * max(shape.dp, 1)
    shard, checkpoint = models.CheckpointShard, models.Checkpoint
    ranks = (
        select(func.count())
        .select_from(models.RankAssignment)
        .where(models.RankAssignment.job_id == job.id)
        .where(models.RankAssignment.in_generation(checkpoint.generation))
        .scalar_subquery()
    )
    step = await session.scalar(
        select(shard.step)
        .join(checkpoint, (checkpoint.job_id == shard.job_id) & (checkpoint.step == shard.step))
        .where(shard.job_id == job.id)
        .where(where)
        .group_by(shard.step, checkpoint.generation)
        .having(
            func.count(func.distinct(shard.rank)) >= func.coalesce(func.nullif(ranks, 0), planned)
        )
        .order_by(shard.step.desc())
        .limit(1)
    )
    return int(step or 0)


async def forget_node(session: AsyncSession, node_id: str) -> None:
    """The node failed: count none of the shards it held in memory any more. Its
    checkpoint daemon is dead, or about to be restarted empty with the node, or on a
    node that is out; a restore must not be sent there, nor a restore step chosen
    because of it. The buddies' replicas of its ranks stay."""
    await forget_nodes(session, [node_id])


async def forget_nodes(session: AsyncSession, node_ids: Sequence[str]) -> None:
    """``forget_node`` for many nodes, in one statement."""
    if node_ids:
        await session.execute(
            delete(models.CheckpointShard).where(models.CheckpointShard.node_id.in_(node_ids))
        )


async def may_hold_replicas(session: AsyncSession, node_id: str) -> bool:
    """Whether a replica pushed to `node_id` still counts (the node exists, has a
    checkpoint daemon and is neither lost nor unhealthy): one lookup by key, cheap
    enough for every shard report."""
    node = await session.get(models.Node, node_id)
    return node is not None and node.state not in HOLDS_NO_COPIES and bool(node.checkpointd_address)


async def buddy_of(session: AsyncSession, node_id: str) -> models.Node | None:
    """The node whose checkpoint daemon keeps `node_id`'s replicas (None: none fits)."""
    node = await get_node(session, node_id)
    candidates = (await session.scalars(select(models.Node))).all()
    return choose_buddy(node, candidates)
