"""The Python stacks of a hung job's ranks: stored as the agents send them, read back per
hang incident (the id of its job.hang event) for `pitstop job stacks`."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.health.hang import locate
from pitstop.scheduler.db import models
from pitstop.scheduler.errors import NotFound
from pitstop.scheduler.services.jobs import get_job
from pitstop.v1 import agent_pb2, jobs_pb2


def store(session: AsyncSession, node_id: str, stacks: agent_pb2.RankStacks) -> None:
    """Keep one rank's stacks, in the caller's transaction."""
    session.add(
        models.RankStack(
            job_id=stacks.job_id,
            incident=stacks.incident,
            generation=stacks.generation,
            rank=stacks.rank,
            node_id=node_id,
            method=stacks.method[:16],
            text=stacks.text,
            error=stacks.error[:2000],
        )
    )


async def job_stacks(
    session: AsyncSession, job_id: str, incident: int = 0
) -> jobs_pb2.JobStacksResponse:
    """The stacks of the job's hang `incident` (0: its newest), and which ranks they name.
    NotFound for an unknown job, or an incident that is not the job's."""
    job = await get_job(session, job_id)
    incidents = [
        int(i)
        for i in (
            await session.scalars(
                select(models.Event.id)
                .where(models.Event.job_id == job.id)
                .where(models.Event.kind == "job.hang")
                .order_by(models.Event.id)
            )
        ).all()
    ]
    response = jobs_pb2.JobStacksResponse(incidents=incidents)
    if incident and incident not in incidents:
        raise NotFound(
            "hang incident",
            str(incident),
            f"job {job.id}'s incidents are {incidents or 'none'} (pitstop job stacks {job.id})",
        )
    chosen = incident or (incidents[-1] if incidents else 0)
    if not chosen:
        return response
    rows = (
        await session.scalars(
            select(models.RankStack)
            .where(models.RankStack.job_id == job.id)
            .where(models.RankStack.incident == chosen)
            .order_by(models.RankStack.rank, models.RankStack.id)
        )
    ).all()
    latest = {row.rank: row for row in rows}  # a rank asked twice: its newest answer
    response.incident = chosen
    for rank, row in sorted(latest.items()):
        response.stacks.append(
            agent_pb2.RankStacks(
                job_id=job.id,
                generation=row.generation,
                rank=rank,
                incident=chosen,
                method=row.method,
                text=row.text,
                error=row.error,
            )
        )
    verdict = locate({rank: row.text for rank, row in latest.items()})
    response.hung_ranks.extend(verdict.ranks)
    response.verdict = verdict.reason
    return response
