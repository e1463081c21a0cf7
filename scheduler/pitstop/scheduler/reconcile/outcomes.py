"""How a deciding transaction ends a recovery: the job goes (or stays) RECOVERING, or it
fails with its restarts exhausted."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.reconcile.context import set_deadline
from pitstop.scheduler.services import lifecycle
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.topology import Placement


def recovering(
    session: AsyncSession,
    job: models.Job,
    *,
    kind: str,
    again: str,
    reason: str,
    attributes: dict[str, str],
) -> None:
    """The job goes RECOVERING with event `kind`; one already recovering stays so, and
    the decision is recorded as `again` (a further decision within the same incident
    or a new one of its own; the goodput account tells them apart)."""
    if job.state is not JobState.RECOVERING:
        lifecycle.transition(
            session, job, JobState.RECOVERING, kind=kind, reason=reason, attributes=attributes
        )
        return
    record_event(
        session,
        again,
        actor="scheduler",
        job_id=job.id,
        reason=reason,
        attributes={"generation": str(job.generation), **attributes},
    )


async def fail_job(
    session: AsyncSession, job: models.Job, placement: Placement, why: str
) -> list[str]:
    """The job FAILED, its restarts exhausted: no deadline, its GPUs free; the nodes
    whose ranks are to be stopped."""
    lifecycle.transition(
        session,
        job,
        JobState.FAILED,
        kind="job.failed",
        reason=f"{why}; restarts exhausted ({job.restarts})",
    )
    set_deadline(job, None)
    await lifecycle.release_gpus(session, job.id)
    return list(placement.nodes())
