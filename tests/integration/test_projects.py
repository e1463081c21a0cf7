"""Projects' quotas and use, on a database of their own: what `pitstop quota list` and
placement (quota_usage) read, and the event every quota change leaves."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from kit.stores import unique
from pitstop.scheduler.db import models
from pitstop.scheduler.db.engine import session_factory
from pitstop.scheduler.domain import JobState, NodeState
from pitstop.scheduler.errors import InvalidArgument
from pitstop.scheduler.services import projects

GPUS = 4


async def job(
    session: AsyncSession,
    project: str,
    state: JobState,
    booked: Sequence[int] = (),
) -> models.Job:
    """A job of `project` in `state` holding GPUs `booked` of node n0."""
    row = models.Job(id=unique("job")[:32], name="j", spec={}, state=state, project=project)
    session.add(row)
    await session.flush()
    for rank, gpu in enumerate(booked):
        session.add(models.GpuBooking(node_id="n0", gpu_index=gpu, job_id=row.id, rank=rank))
    await session.flush()
    return row


async def test_use_counts_bookings_and_pending_jobs_by_project(
    migrated_database: tuple[str, session_factory],
) -> None:
    """vision holds 3 GPUs (one running job) and has a job waiting; nlp only waits; speech
    has a quota and no job; a finished job of archive counts as a project with nothing."""
    _, sessions = migrated_database
    async with sessions() as session, session.begin():
        session.add(models.Node(id="n0", state=NodeState.READY))
        for gpu in range(GPUS):
            session.add(models.Gpu(node_id="n0", index=gpu, uuid=f"GPU-n0-{gpu}"))
        await session.flush()
        await job(session, "vision", JobState.RUNNING, [0, 1, 2])
        await job(session, "vision", JobState.PENDING)
        await job(session, "nlp", JobState.PENDING)
        await job(session, "nlp", JobState.PENDING)
        await job(session, "archive", JobState.SUCCEEDED)
        await projects.set_quota(session, "vision", 4, actor="token:ops")
        await projects.set_quota(session, "speech", 8, actor="token:ops")
    async with sessions() as session:
        usage = await projects.quota_usage(session)
        listed = await projects.list_projects(session)
    assert usage == {"vision": (4, 3), "speech": (8, 0)}
    assert [(p.name, p.gpu_quota, p.gpus_in_use, p.pending_jobs) for p in listed] == [
        ("archive", None, 0, 0),
        ("nlp", None, 0, 2),
        ("speech", 8, 0, 0),
        ("vision", 4, 3, 1),
    ]
    vision = listed[-1]
    assert vision.updated_by == "token:ops"
    assert vision.updated_at is not None
    assert listed[1].updated_at is None
    assert listed[1].updated_by == ""


async def test_each_quota_change_is_an_event_with_the_quota_before_and_after(
    migrated_database: tuple[str, session_factory],
) -> None:
    _, sessions = migrated_database
    for gpus in (16, 2, None):
        async with sessions() as session, session.begin():
            row = await projects.set_quota(session, "vision", gpus, actor="token:alice")
            assert row.gpu_quota == gpus
    async with sessions() as session:
        events = (
            await session.scalars(
                select(models.Event)
                .where(models.Event.kind == "project.quota_set")
                .order_by(models.Event.id)
            )
        ).all()
        (row,) = (await session.scalars(select(models.Project))).all()
    assert [(e.attributes["from"], e.attributes["to"]) for e in events] == [
        ("", "16"),
        ("16", "2"),
        ("2", ""),
    ]
    assert {e.attributes["project"] for e in events} == {"vision"}
    assert {e.actor for e in events} == {"token:alice"}
    assert [e.reason for e in events] == [
        "project vision: GPU quota unlimited -> 16 GPUs",
        "project vision: GPU quota 16 GPUs -> 2 GPUs",
        "project vision: GPU quota 2 GPUs -> unlimited",
    ]
    assert (row.name, row.gpu_quota) == ("vision", None)


@pytest.mark.parametrize(
    ("project", "gpus", "field"), [("Vision", 1, "project"), ("ok", -1, "gpus")]
)
async def test_a_bad_quota_is_refused_naming_the_field_and_writes_nothing(
    migrated_database: tuple[str, session_factory], project: str, gpus: int, field: str
) -> None:
    _, sessions = migrated_database
    async with sessions() as session:
        with pytest.raises(InvalidArgument) as refused:
            await projects.set_quota(session, project, gpus, actor="token:ops")
        await session.rollback()
        assert refused.value.field == field
        assert (await session.scalars(select(models.Project))).all() == []
        assert (await session.scalars(select(models.Event))).all() == []
