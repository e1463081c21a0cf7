"""Projects: GPU quotas and what their jobs hold."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models


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
