"""Deadlines: a decision in flight (a start, a recovery) whose ranks did not get going
in time falls back to restarting every rank in place, or fails the job when its
restarts are spent. `accounts_due` collects the jobs whose goodput account a decision
changed (Recovery.refresh_accounts)."""

from __future__ import annotations

import logging
import time

from sqlalchemy import func, select

from pitstop.health.goodput import incident_attributes
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.reconcile.commands import stop_everywhere
from pitstop.scheduler.reconcile.context import Leader, failed_nodes, locked_job, set_deadline
from pitstop.scheduler.reconcile.outcomes import fail_job, recovering
from pitstop.scheduler.services import catalog
from pitstop.scheduler.services import node_commands as plan
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.services.node_commands import IN_FLIGHT, NodeAction

log = logging.getLogger(__name__)


async def deadlines_due(leader: Leader, accounts_due: set[str]) -> set[str]:
    """Fall back for every job whose decision in flight missed its deadline."""
    async with leader.store.read() as session:
        due = (
            await session.scalars(
                select(models.Job.id)
                .where(models.Job.state.in_((JobState.STARTING, JobState.RECOVERING)))
                .where(models.Job.deadline.is_not(None))
                .where(models.Job.deadline < func.now())
                # A held job's deadline waits for its release (holds.py).
                .where(models.Job.held_since.is_(None))
            )
        ).all()
    decided = set()
    for job_id in due:
        if await fall_back(leader, job_id, accounts_due):
            decided.add(job_id)
    return decided


async def fall_back(leader: Leader, job_id: str, accounts_due: set[str]) -> bool:
    """Restart every rank of the job from its restore step, in the same places (a
    restart counted against max_restarts: a job that can never get going ends
    FAILED rather than waiting for ever)."""
    nodes: list[str] = []
    async with leader.store.write() as session:
        job = await locked_job(leader, session, job_id, IN_FLIGHT)
        if job is None or job.deadline is None:
            return False
        passed = select(models.Job.deadline < func.now()).where(models.Job.id == job_id)
        if await session.scalar(passed) is not True:
            return False
        spec = spec_from_json(job.spec)
        placement = await leader.rank_maps.of(session, job)
        if await failed_nodes(session, placement):
            # Waiting for capacity to replace a failed node (repair_failed_nodes acts
            # the moment a spare appears): a restart in place cannot run.
            set_deadline(job, leader.timeouts.restart_seconds)
            return False
        waited = (
            "the recovery did not resume"
            if job.state is JobState.RECOVERING
            else "the ranks did not start stepping"
        )
        if job.restarts >= spec.max_restarts:
            nodes = await fail_job(session, job, placement, f"{waited} before its deadline")
        else:
            job.restarts += 1
            await leader.rank_maps.write(session, job, placement)
            job.restore_step = await catalog.restorable_step(session, job)
            job.commands_after = None
            set_deadline(job, leader.timeouts.restart_seconds)
            await plan.replace_plan(
                session, job, dict.fromkeys(placement.nodes(), NodeAction.START)
            )
            now = time.time()
            attributes = {
                "generation": str(job.generation),
                "fallback": "true",
                **incident_attributes(
                    cause=f"{waited} before its deadline",
                    failed_at=now,
                    detected_at=now,
                    lost_steps=max(job.current_step - job.restore_step, 0),
                ),
            }
            reason = (
                f"{waited} before its deadline: restarting every rank from step "
                f"{job.restore_step} (restart {job.restarts} of {spec.max_restarts})"
            )
            recovering(
                session,
                job,
                kind="job.restarting",
                again="job.restarting",
                reason=reason,
                attributes=attributes,
            )
        accounts_due.add(job.id)
    if nodes:
        await stop_everywhere(leader, job_id, nodes, "job failed")
        return False
    leader.metrics.recoveries.labels("fallback").inc()
    log.warning("job %s: fell back to a full restart", job_id)
    return True
