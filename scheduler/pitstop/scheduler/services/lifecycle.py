"""Job life-cycle decisions as transactions: place, start, run, finish, recover.

Each function takes the leader's session (the caller has checked the lease in it), makes
one transition with its event, and books GPUs in ``gpu_bookings`` so that a GPU can never
be held twice. Sending commands to agents happens after the commit, in the reconciler.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from pitstop.scheduler import jobstate
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.errors import FailedPrecondition
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.topology import NodeInfo, Placement, RankSlot

LIVE_STATES = (
    JobState.PLACED,
    JobState.STARTING,
    JobState.RUNNING,
    JobState.RECOVERING,
    JobState.PAUSED,
)


def transition(
    session: AsyncSession,
    job: models.Job,
    target: JobState,
    *,
    kind: str,
    reason: str,
    attributes: dict[str, str] | None = None,
) -> None:
    """One legal transition and its event; an illegal one is a bug, refused loudly."""
    if not jobstate.is_legal(job.state, target):
        raise FailedPrecondition(f"job {job.id} cannot go from {job.state.value} to {target.value}")
    previous = job.state
    job.state = target
    job.reason = reason
    record_event(
        session,
        kind,
        actor="scheduler",
        job_id=job.id,
        from_state=previous.value,
        to_state=target.value,
        reason=reason,
        attributes={"generation": str(job.generation), **(attributes or {})},
    )


async def topology_inputs(session: AsyncSession) -> tuple[list[NodeInfo], list[tuple[str, int]]]:
    """Every node as placement sees it, and every booked GPU."""
    nodes = (
        await session.scalars(select(models.Node).options(selectinload(models.Node.gpus)))
    ).all()
    infos = [
        NodeInfo(
            node_id=n.id,
            zone=n.zone,
            block=n.block,
            rack=n.rack,
            role=n.role.value,
            state=n.state.value,
            gpu_indexes=tuple(g.index for g in n.gpus),
            nvlink_domain=n.nvlink_domain,
        )
        for n in nodes
    ]
    booked = await session.execute(select(models.GpuBooking.node_id, models.GpuBooking.gpu_index))
    return infos, [(node, gpu) for node, gpu in booked]


async def rank_map(session: AsyncSession, job: models.Job) -> Placement:
    """The job's current generation as a Placement (empty before placement)."""
    rows = (
        await session.scalars(
            select(models.RankAssignment)
            .where(models.RankAssignment.job_id == job.id)
            .where(models.RankAssignment.generation == job.generation)
            .order_by(models.RankAssignment.rank)
        )
    ).all()
    return Placement(
        tuple(
            RankSlot(r.rank, r.node_id, r.gpu_index, r.local_rank, r.dp, r.pp, r.tp) for r in rows
        )
    )


async def write_generation(session: AsyncSession, job: models.Job, placement: Placement) -> None:
    """Bump the generation, write its rank map and re-book exactly its GPUs."""
    job.generation += 1
    session.add_all(
        models.RankAssignment(
            job_id=job.id,
            generation=job.generation,
            rank=s.rank,
            node_id=s.node_id,
            gpu_index=s.gpu_index,
            local_rank=s.local_rank,
            dp=s.dp,
            pp=s.pp,
            tp=s.tp,
        )
        for s in placement.ranks
    )
    await release_gpus(session, job.id)
    session.add_all(
        models.GpuBooking(node_id=s.node_id, gpu_index=s.gpu_index, job_id=job.id, rank=s.rank)
        for s in placement.ranks
    )
    await session.flush()  # a double booking fails here, inside the transaction


async def release_gpus(session: AsyncSession, job_id: str) -> None:
    await session.execute(delete(models.GpuBooking).where(models.GpuBooking.job_id == job_id))


async def place(session: AsyncSession, job: models.Job, placement: Placement) -> None:
    """PENDING -> PLACED with generation 1's rank map."""
    await write_generation(session, job, placement)
    transition(
        session,
        job,
        JobState.PLACED,
        kind="job.placed",
        reason=f"{placement.world_size} ranks on {len(placement.nodes())} nodes",
    )


async def live_jobs(
    session: AsyncSession, states: Sequence[JobState] = LIVE_STATES
) -> list[models.Job]:
    return list(
        (await session.scalars(select(models.Job).where(models.Job.state.in_(states)))).all()
    )
