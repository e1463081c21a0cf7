"""Job life-cycle decisions as transactions: place, start, run, finish, recover.

Each function takes the leader's session (the caller has checked the lease in it), makes
one transition with its event, and books GPUs in ``gpu_bookings`` so that a GPU can never
be held twice. Sending commands to agents happens after the commit, in the reconciler.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence

from sqlalchemy import ARRAY, Integer, any_, cast, delete, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler import jobstate
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState, NodeRole, NodeState
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
    if target is JobState.RUNNING and previous is not JobState.RUNNING:
        job.running_since = dt.datetime.now(dt.UTC)  # a preemption's minimum run time
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


async def topology_inputs(
    session: AsyncSession, *, spares_and: Collection[str] | None = None
) -> tuple[list[NodeInfo], list[tuple[str, int]]]:
    """Every node as placement sees it, and every booked GPU. Plain rows, not ORM
    objects: placing a new job reads the whole fleet (12,500 nodes, 100,000 GPUs).
    With `spares_and`, only the READY spares and those nodes: what replacing them
    needs, read in time that follows the spares, not the fleet."""
    node, gpu, booking = models.Node, models.Gpu, models.GpuBooking
    wanted = None
    if spares_and is not None:
        wanted = ((node.role == NodeRole.SPARE) & (node.state == NodeState.READY)) | node.id.in_(
            sorted(spares_and)
        )
    nodes_query = select(
        node.id, node.zone, node.block, node.rack, node.role, node.state, node.nvlink_domain
    ).order_by(node.id)
    gpus_query = select(gpu.node_id, gpu.index).order_by(gpu.node_id, gpu.index)
    booked_query = select(booking.node_id, booking.gpu_index)
    if wanted is not None:
        nodes_query = nodes_query.where(wanted)
        ids = select(node.id).where(wanted)
        gpus_query = gpus_query.where(gpu.node_id.in_(ids))
        booked_query = booked_query.where(booking.node_id.in_(ids))
    gpus: dict[str, list[int]] = {}
    for node_id, index in await session.execute(gpus_query):
        gpus.setdefault(node_id, []).append(index)
    infos = [
        NodeInfo(
            node_id=node_id,
            zone=zone,
            block=block,
            rack=rack,
            role=role.value,
            state=state.value,
            gpu_indexes=tuple(gpus.get(node_id, ())),
            nvlink_domain=nvlink_domain,
        )
        for node_id, zone, block, rack, role, state, nvlink_domain in await session.execute(
            nodes_query
        )
    ]
    booked = await session.execute(booked_query)
    return infos, [(node_id, index) for node_id, index in booked]


async def rank_map(session: AsyncSession, job: models.Job) -> Placement:
    """The job's current generation as a Placement (empty before placement)."""
    a = models.RankAssignment
    rows = await session.execute(
        select(a.rank, a.node_id, a.gpu_index, a.local_rank, a.dp, a.pp, a.tp)
        .where(a.job_id == job.id)
        .where(a.current())
        .order_by(a.rank)
    )
    return Placement(tuple(RankSlot(*row) for row in rows))


async def write_generation(
    session: AsyncSession, job: models.Job, placement: Placement, before: Placement | None = None
) -> None:
    """Bump the generation and make `placement` its rank map, re-booking its GPUs, as a
    delta on `before` (the current map; read when not given): only the ranks that moved,
    appeared or went are written (a recovery: the failed node's 8 ranks and bookings,
    not the job's 100,000)."""
    if before is None:
        before = await rank_map(session, job)
    gone, added = map_delta(before, placement)
    job.generation += 1
    await session.flush()  # the job's row first
    a, booking = models.RankAssignment, models.GpuBooking
    if len(gone) == len(before.ranks):  # everything moves (or goes): no list of ranks to name
        await session.execute(
            update(a).where(a.job_id == job.id, a.current()).values(until_generation=job.generation)
        )
        await release_gpus(session, job.id)
    else:
        # One array parameter, not an IN list of one parameter per rank (a shrink moves
        # most ranks: thousands of parameters for the driver to parse, and a limit).
        ranks = cast(gone, ARRAY(Integer))
        await session.execute(
            update(a)
            .where(a.job_id == job.id, a.current(), a.rank == any_(ranks))
            .values(until_generation=job.generation)
        )
        await session.execute(
            delete(booking).where(booking.job_id == job.id, booking.rank == any_(ranks))
        )
    if not added:
        return
    await session.execute(
        insert(a),
        [
            {
                "job_id": job.id,
                "since_generation": job.generation,
                "rank": s.rank,
                "node_id": s.node_id,
                "gpu_index": s.gpu_index,
                "local_rank": s.local_rank,
                "dp": s.dp,
                "pp": s.pp,
                "tp": s.tp,
            }
            for s in added
        ],
    )
    # A double booking fails here, inside the transaction.
    await session.execute(
        insert(booking),
        [
            {"node_id": s.node_id, "gpu_index": s.gpu_index, "job_id": job.id, "rank": s.rank}
            for s in added
        ],
    )


def map_delta(before: Placement, after: Placement) -> tuple[list[int], list[RankSlot]]:
    """The ranks whose slot changed or went, and the slots that changed or came. A
    repair keeps every other slot object as it was, and both maps are in rank order, so
    one pass side by side with an identity test settles most (a dict of each and a
    field-by-field comparison took about 55 ms of a decision at 100,000 ranks)."""
    if len(before.ranks) == len(after.ranks):
        pairs = zip(before.ranks, after.ranks, strict=True)
        changed = [(a, b) for a, b in pairs if a is not b and a != b]
        if all(a.rank == b.rank for a, b in changed):
            return [a.rank for a, _ in changed], [b for _, b in changed]
    old = {slot.rank: slot for slot in before.ranks}
    new = {slot.rank: slot for slot in after.ranks}
    gone = [rank for rank, slot in old.items() if new.get(rank) != slot]
    added = [slot for rank, slot in new.items() if old.get(rank) != slot]
    return gone, added


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
