"""What an ended job leaves behind goes `retention_seconds` after it ended. A fleet runs
through thousands of jobs a month; without this, Redis and PostgreSQL grow with every
job it ever ran.

- Redis: its step stream (up to 100,000 entries), straggler windows and rank statistics
  (and at once the keys of a job PostgreSQL does not know).
- PostgreSQL: its events (but the preemptions and resumes its run record lists), its
  node commands, its hang stacks, and its checkpoint rows: its whole durable
  checkpoints move to `kept_checkpoints` first (step, digest, shards, bytes: what its
  record lists). The catalog's tables take and drop a row a step per rank; an ended
  job's few rows left among them would each pin an index page of its own for good.
- And of a running job, which may run for weeks: its checkpoint rows superseded that
  long ago (below its committed step, held by no node, not durable); and the events of
  no job (the nodes', the leadership's) that old.

What stays is what `pitstop job show` and `pitstop job record` print: the job's row
(state, result, goodput account with its incidents), rank maps, run records, durable
checkpoints with their shards, preemptions.

Level-triggered, from the leader's following loop: every sweep reads which jobs have
Redis keys (a SCAN of the job key patterns) and deletes those due, then deletes the
rows due in one transaction (nothing to delete is a few index probes)."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Collection
from typing import Any

from redis.exceptions import RedisError
from sqlalchemy import delete, exists, func, select, tuple_
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import TERMINAL_JOB_STATES
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.reconcile.context import Leader
from pitstop.scheduler.services.records import PREEMPTED, RESUMING, whole_durable_checkpoints

log = logging.getLogger(__name__)

SWEEP_SECONDS_MAX = 60.0
"""The longest between two sweeps (a short retention sweeps more often)."""
SUPERSEDED_BATCH = 10_000
"""The most superseded checkpoint rows of running jobs one sweep deletes."""
KEEP_BATCH = 100
"""The most ended jobs whose checkpoint rows one sweep moves out of the catalog."""


class Retention:
    """Deletes what jobs ended `retention_seconds` ago left in Redis and PostgreSQL."""

    def __init__(self, leader: Leader, retention_seconds: float) -> None:
        self.leader = leader
        self.retention_seconds = retention_seconds
        self.interval = min(SWEEP_SECONDS_MAX, max(retention_seconds / 10, 1.0))
        self._next = 0.0

    async def sweep(self) -> list[str]:
        """One sweep when one is due; the jobs whose Redis keys were deleted."""
        now = self.leader.clock()
        if now < self._next:
            return []
        self._next = now + self.interval
        await self.prune_rows()
        return await self.forget_keys()

    async def prune_rows(self) -> dict[str, int]:
        """Delete the rows ended jobs no longer need; the rows deleted, by table."""
        job = models.Job
        ended = select(job.id).where(
            job.state.in_(TERMINAL_JOB_STATES),
            job.updated_at < func.now() - dt.timedelta(seconds=self.retention_seconds),
        )
        event, command, stack = models.Event, models.NodeCommand, models.RankStack
        checkpoint, shard = models.Checkpoint, models.CheckpointShard
        statements = {
            "events": delete(event).where(
                event.job_id.in_(ended), event.kind.not_in((PREEMPTED, RESUMING))
            ),
            # Of no job: a node's, the leadership's. As old as an ended job's kept ones.
            "fleet events": delete(event).where(
                event.job_id.is_(None),
                event.time < func.now() - dt.timedelta(seconds=self.retention_seconds),
            ),
            "node_commands": delete(command).where(command.job_id.in_(ended)),
            "rank_stacks": delete(stack).where(stack.job_id.in_(ended)),
        }
        deleted: dict[str, int] = {}
        async with self.leader.store.write() as session:
            if kept := await keep_durable(session, ended):
                statements["checkpoint_shards"] = delete(shard).where(shard.job_id.in_(kept))
                statements["checkpoints"] = delete(checkpoint).where(checkpoint.job_id.in_(kept))
            for table, statement in statements.items():
                result = await session.execute(statement)
                count = int(getattr(result, "rowcount", 0) or 0)
                if count:
                    deleted[table] = count
            superseded = await session.execute(self.superseded_checkpoints())
            if count := int(getattr(superseded, "rowcount", 0) or 0):
                deleted["checkpoints"] = deleted.get("checkpoints", 0) + count
        if deleted:
            log.info("retention: deleted what ended jobs no longer need: %s", deleted)
        return deleted

    def superseded_checkpoints(self) -> Any:
        """A running job commits a checkpoint row a step, for weeks: its rows below the
        committed step that no node holds any more, not durable, and older than the
        retention, go (at most SUPERSEDED_BATCH a sweep). What a restore or a late report
        could still use stays: the committed step and newer, every step with a shard."""
        job, checkpoint, shard = models.Job, models.Checkpoint, models.CheckpointShard
        due = (
            select(checkpoint.job_id, checkpoint.step)
            .join(job, job.id == checkpoint.job_id)
            .where(
                job.state.not_in(TERMINAL_JOB_STATES),
                checkpoint.step < job.committed_step,
                checkpoint.durable.is_(False),
                checkpoint.created_at < func.now() - dt.timedelta(seconds=self.retention_seconds),
                ~exists().where(shard.job_id == checkpoint.job_id, shard.step == checkpoint.step),
            )
            .limit(SUPERSEDED_BATCH)
        )
        return delete(checkpoint).where(tuple_(checkpoint.job_id, checkpoint.step).in_(due))

    async def forget_keys(self) -> list[str]:
        """Delete the Redis keys of jobs ended long enough ago (or unknown); their ids."""
        hot = self.leader.hot
        try:
            keyed = await jobs_with_keys(hot)
        except RedisError:
            log.warning("retention: Redis unreadable; the next sweep retries")
            return []
        if not keyed:
            return []
        job = models.Job
        async with self.leader.store.read() as session:
            rows = (
                await session.execute(
                    select(
                        job.id,
                        job.state,
                        func.extract("epoch", func.now() - job.updated_at),
                    ).where(job.id.in_(sorted(keyed)))
                )
            ).all()
        known = {job_id for job_id, _, _ in rows}
        gone = sorted(
            {job_id for job_id in keyed if job_id not in known}
            | {
                job_id
                for job_id, state, since in rows
                if state in TERMINAL_JOB_STATES and float(since) >= self.retention_seconds
            }
        )
        if gone:
            try:
                await forget_jobs(hot, gone)
            except RedisError:
                log.warning("retention: Redis refused the delete; the next sweep retries")
                return []
            log.info("retention: deleted the Redis keys of %d ended jobs", len(gone))
        return gone


async def keep_durable(session: AsyncSession, ended: Any) -> list[str]:
    """Of the jobs `ended` selects, up to KEEP_BATCH still in the checkpoint catalog:
    record each one's whole durable checkpoints in `kept_checkpoints`; their ids, whose
    catalog rows may now go. (A late report that adds rows for one brings it back to
    the next sweep.)"""
    checkpoint = models.Checkpoint
    job_ids = list(
        await session.scalars(
            select(checkpoint.job_id)
            .where(checkpoint.job_id.in_(ended))
            .distinct()
            .order_by(checkpoint.job_id)
            .limit(KEEP_BATCH)
        )
    )
    for job in await session.scalars(select(models.Job).where(models.Job.id.in_(job_ids))):
        rows = [
            {
                "job_id": job.id,
                "step": found.step,
                "digest": found.digest,
                "shards": found.shards,
                "size_bytes": found.bytes,
            }
            for found in await whole_durable_checkpoints(session, job)
        ]
        if rows:
            await session.execute(
                insert(models.KeptCheckpoint).values(rows).on_conflict_do_nothing()
            )
    return job_ids


def _job_key_patterns(hot: HotState) -> list[tuple[str, str, str]]:
    """(pattern, head, tail) of each per-job key: the job id lies between."""
    return [
        (hot.rank_stats_key("*"), f"{hot.prefix}job:", ":rank-stats"),
        (hot.steps_key("*"), f"{hot.prefix}steps:", ""),
        (hot.windows_key("*"), f"{hot.prefix}step-windows:", ""),
    ]


async def jobs_with_keys(hot: HotState) -> set[str]:
    """The ids of the jobs with any key in Redis (a SCAN per key pattern)."""
    jobs: set[str] = set()
    for pattern, head, tail in _job_key_patterns(hot):
        async for raw in hot.redis.scan_iter(match=pattern, count=1000):
            key = raw.decode() if isinstance(raw, bytes) else raw
            if key.startswith(head) and key.endswith(tail):
                job_id = key[len(head) : len(key) - len(tail)]
                if job_id and ":" not in job_id:
                    jobs.add(job_id)
    return jobs


async def forget_jobs(hot: HotState, job_ids: Collection[str]) -> None:
    """Delete every Redis key of these jobs."""
    keys = [
        key
        for job_id in job_ids
        for key in (hot.steps_key(job_id), hot.windows_key(job_id), hot.rank_stats_key(job_id))
    ]
    for start in range(0, len(keys), 512):
        await hot.redis.delete(*keys[start : start + 512])
