"""What a job leaves in Redis goes some time after it ended: its step streams (up to
100,000 entries each), its straggler windows and its rank statistics. A fleet runs
through thousands of jobs a month; without this, Redis grows with every job it ever ran.

Level-triggered, from the leader's following loop: every sweep reads which jobs have
keys (a SCAN of the job key patterns) and deletes those of jobs that ended
`retention_seconds` ago or more, or that PostgreSQL does not know. What a finished job
shows afterwards (`pitstop job show`, its events, its run record) is in PostgreSQL."""

from __future__ import annotations

import logging

from redis.exceptions import RedisError
from sqlalchemy import func, select

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import TERMINAL_JOB_STATES
from pitstop.scheduler.reconcile.context import Leader

log = logging.getLogger(__name__)

SWEEP_SECONDS_MAX = 60.0
"""The longest between two sweeps (a short retention sweeps more often)."""


class Retention:
    """Deletes the Redis keys of jobs ended `retention_seconds` ago."""

    def __init__(self, leader: Leader, retention_seconds: float) -> None:
        self.leader = leader
        self.retention_seconds = retention_seconds
        self.interval = min(SWEEP_SECONDS_MAX, max(retention_seconds / 10, 1.0))
        self._next = 0.0

    async def sweep(self) -> list[str]:
        """One sweep when one is due; the jobs whose keys were deleted."""
        now = self.leader.clock()
        if now < self._next:
            return []
        self._next = now + self.interval
        hot = self.leader.hot
        try:
            keyed = await hot.jobs_with_keys()
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
                await hot.forget_jobs(gone)
            except RedisError:
                log.warning("retention: Redis refused the delete; the next sweep retries")
                return []
            log.info("retention: deleted the Redis keys of %d ended jobs", len(gone))
        return gone
