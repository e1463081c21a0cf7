"""Projects: GPU quotas and what their jobs hold. A job names its project in its spec
(`default` when unset); a project without a row has no quota. Placement reads
`quota_usage` (admission.admit); admins set quotas (`pitstop quota set`)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.errors import InvalidArgument
from pitstop.scheduler.jobspec import check_project
from pitstop.scheduler.services.events import record_event


async def quota_usage(session: AsyncSession) -> dict[str, tuple[int | None, int]]:
    """Project -> (its GPU quota, None when unlimited; GPUs its jobs hold now), for every
    project with a quota row or a booked GPU."""
    usage: dict[str, tuple[int | None, int]] = {
        name: (quota, 0)
        for name, quota in await session.execute(
            select(models.Project.name, models.Project.gpu_quota)
        )
    }
    rows = await session.execute(
        select(models.Job.project, func.count())
        .select_from(models.GpuBooking)
        .join(models.Job, models.Job.id == models.GpuBooking.job_id)
        .group_by(models.Job.project)
    )
    for project, booked in rows:
        quota = usage.get(project, (None, 0))[0]
        usage[project] = (quota, int(booked))
    return usage


async def set_quota(
    session: AsyncSession, project: str, gpus: int | None, *, actor: str
) -> models.Project:
    """Set `project`'s GPU quota (None: unlimited), creating its row; records a
    project.quota_set event with the old and the new quota."""
    check_project("project", project)
    if gpus is not None and gpus < 0:
        raise InvalidArgument("gpus", gpus, "give 0 or more GPUs, or no quota (unlimited)")
    row = await session.get(models.Project, project, with_for_update=True)
    before = None if row is None else row.gpu_quota
    if row is None:
        row = models.Project(name=project)
        session.add(row)
    row.gpu_quota = gpus
    row.updated_by = actor[:128]
    row.updated_at = dt.datetime.now(dt.UTC)
    old, new = (("unlimited" if q is None else f"{q} GPUs") for q in (before, gpus))
    record_event(
        session,
        "project.quota_set",
        actor=actor,
        reason=f"project {project}: GPU quota {old} -> {new}",
        attributes={
            "project": project,
            "from": "" if before is None else str(before),
            "to": "" if gpus is None else str(gpus),
        },
    )
    await session.flush()
    return row


@dataclass(frozen=True)
class ProjectUse:
    """A project as `pitstop quota list` shows it."""

    name: str
    gpu_quota: int | None
    gpus_in_use: int
    pending_jobs: int
    updated_at: dt.datetime | None
    updated_by: str


async def list_projects(session: AsyncSession) -> list[ProjectUse]:
    """Every project with a quota row or a job, by name."""
    rows = {p.name: p for p in (await session.scalars(select(models.Project))).all()}
    usage = await quota_usage(session)
    pending: dict[str, int] = {
        project: int(count)
        for project, count in await session.execute(
            select(models.Job.project, func.count())
            .where(models.Job.state == JobState.PENDING)
            .group_by(models.Job.project)
        )
    }
    with_jobs = set(await session.scalars(select(func.distinct(models.Job.project))))
    names = sorted({*rows, *usage, *with_jobs})
    return [
        ProjectUse(
            name,
            rows[name].gpu_quota if name in rows else None,
            usage.get(name, (None, 0))[1],
            int(pending.get(name, 0)),
            rows[name].updated_at if name in rows else None,
            rows[name].updated_by if name in rows else "",
        )
        for name in names
    ]
