"""Jobs: submit, read, list, and the user-driven transitions (cancel, pause, resume)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from google.protobuf import json_format
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler import jobstate
from pitstop.scheduler.auth import require_project
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.errors import InvalidArgument, NotFound
from pitstop.scheduler.jobspec import check_text, validate_job_spec
from pitstop.scheduler.services.events import record_event
from pitstop.v1 import agent_pb2, jobs_pb2

MAX_PAGE = 1000
DEFAULT_PAGE = 100


def new_job_id() -> str:
    return "j-" + uuid.uuid4().hex[:12]


def spec_to_json(spec: jobs_pb2.JobSpec) -> dict[str, object]:
    return json_format.MessageToDict(spec, preserving_proto_field_name=True)


def spec_from_json(data: dict[str, object]) -> jobs_pb2.JobSpec:
    return json_format.ParseDict(data, jobs_pb2.JobSpec(), ignore_unknown_fields=True)


async def submit_job(
    session: AsyncSession,
    spec: jobs_pb2.JobSpec,
    *,
    request_id: str,
    actor: str,
    code: agent_pb2.CodeVersion | None = None,
) -> models.Job:
    """Validate and store a job in PENDING with its event. A repeated request_id returns
    the job the first request created. `code`: the code the submitting client saw."""
    check_text("request_id", request_id, max_len=128)
    if request_id:
        existing = await session.scalar(
            select(models.Job).where(models.Job.request_id == request_id)
        )
        if existing is not None:
            return existing
    accepted = validate_job_spec(spec)
    require_project(accepted.project, f"submit to project {accepted.project!r}")
    submitted_code = {}
    if code is not None:
        for field in ("git_commit", "dirty_digest", "working_dir"):
            check_text(f"code.{field}", getattr(code, field), max_len=4096)
        submitted_code = json_format.MessageToDict(code, preserving_proto_field_name=True)
    job = models.Job(
        id=new_job_id(),
        name=accepted.name,
        spec=spec_to_json(accepted),
        state=JobState.PENDING,
        reason="waiting for placement",
        priority=accepted.priority,
        project=accepted.project,
        submitted_by=actor[:128],
        submitted_code=submitted_code,
        request_id=request_id or None,
        generation=0,
        restarts=0,
        current_step=0,
        committed_step=0,
        durable_step=0,
        goodput={},
        result={},
    )
    session.add(job)
    record_event(
        session,
        "job.submitted",
        actor=actor,
        job_id=job.id,
        to_state=JobState.PENDING.value,
        reason=f"{accepted.tp}x{accepted.pp}x{accepted.dp} (tp x pp x dp)",
        attributes={"name": accepted.name, "project": accepted.project},
    )
    if accepted.dp == 1 and not accepted.integrity.sdc_check_disabled:
        # Said once, where the submitter looks: what the job is not protected from.
        record_event(
            session,
            "job.sdc_unchecked",
            actor="scheduler",
            job_id=job.id,
            reason=(
                "dp = 1: one replica, so silent data corruption cannot be caught by "
                "comparing replicas; the loss watch and the hang watch still run "
                "(docs/integrity.md)"
            ),
        )
    return job


async def get_job(session: AsyncSession, job_id: str, *, for_update: bool = False) -> models.Job:
    if not job_id:
        raise InvalidArgument("job_id", job_id, "give a job id such as j-4f1c2a9b0d3e")
    query = select(models.Job).where(models.Job.id == job_id)
    if for_update:
        query = query.with_for_update(key_share=True)
    job = await session.scalar(query)
    if job is None:
        raise NotFound("job", job_id, "list jobs with `pitstop job list`")
    return job


async def list_jobs(
    session: AsyncSession, *, states: Sequence[JobState], page_size: int, page_token: str
) -> tuple[Sequence[models.Job], str]:
    """Newest first. The page token is the last id returned plus its creation time."""
    size = DEFAULT_PAGE if page_size == 0 else min(page_size, MAX_PAGE)
    query = select(models.Job)
    if states:
        query = query.where(models.Job.state.in_(states))
    if page_token:
        after = await session.scalar(select(models.Job).where(models.Job.id == page_token))
        if after is None:
            raise InvalidArgument(
                "page_token", page_token, "pass the next_page_token of the previous response"
            )
        query = query.where(
            (models.Job.created_at < after.created_at)
            | ((models.Job.created_at == after.created_at) & (models.Job.id < after.id))
        )
    query = query.order_by(models.Job.created_at.desc(), models.Job.id.desc()).limit(size + 1)
    jobs = (await session.scalars(query)).all()
    if len(jobs) > size:
        return jobs[:size], jobs[size - 1].id
    return jobs, ""


async def queue_positions(session: AsyncSession) -> dict[str, int]:
    """Each pending job's place in the queue (1: considered first), in the order the
    leader's placement pass takes them: priority, then age."""
    rows = await session.execute(
        select(models.Job.id)
        .where(models.Job.state == JobState.PENDING)
        .order_by(models.Job.priority.desc(), models.Job.created_at, models.Job.id)
    )
    return {job_id: place for place, (job_id,) in enumerate(rows, start=1)}


async def change_job_state(
    session: AsyncSession, job_id: str, action: str, *, reason: str, actor: str
) -> models.Job:
    """A user's cancel, pause or resume: one locked row, one transition, one event."""
    check_text("reason", reason, max_len=1024)
    job = await get_job(session, job_id, for_update=True)
    require_project(job.project, f"{action} job {job.id}")
    target = jobstate.check_user_action(job.id, job.state, action)
    previous = job.state
    job.state = target
    job.reason = reason or f"{action} requested by {actor}"
    if target.terminal:
        await session.execute(delete(models.GpuBooking).where(models.GpuBooking.job_id == job.id))
    record_event(
        session,
        f"job.{action}",
        actor=actor,
        job_id=job.id,
        from_state=previous.value,
        to_state=target.value,
        reason=job.reason,
    )
    return job


async def job_nodes(session: AsyncSession, job: models.Job) -> list[str]:
    """Nodes of the job's current generation."""
    rows = await session.scalars(
        select(models.RankAssignment.node_id)
        .where(models.RankAssignment.job_id == job.id)
        .where(models.RankAssignment.current())
        .distinct()
        .order_by(models.RankAssignment.node_id)
    )
    return list(rows.all())


LEFT_BEHIND_IN = (JobState.RUNNING, JobState.PAUSED)
"""The job states in which a rank of an older generation was left behind (one still
starting or recovering is about to reconfigure or stop its ranks itself)."""


async def stale_processes(
    session: AsyncSession, node_id: str, running: Sequence[tuple[str, int, int, bool]]
) -> dict[str, list[int] | None]:
    """Of the processes node `node_id` reports, (job id, generation, rank, standby),
    those to stop, by job: every one of a job that ended (an empty list: all of the
    job's), every one of a job sent back to the queue (None: all of the job's, at their
    next step boundary, so that the last snapshot is sealed), and ranks of an older
    generation of a job that runs on without this node (it was cut off or frozen while
    its job recovered elsewhere). A job still starting or recovering keeps them: they
    are about to reconfigure or leave; and a node in the job's current rank map keeps
    its ranks (they may not have reported their new generation yet)."""
    ids = sorted({job_id for job_id, *_ in running})
    if not ids:
        return {}
    rows = await session.execute(
        select(models.Job.id, models.Job.state, models.Job.generation).where(models.Job.id.in_(ids))
    )
    jobs = {job_id: (state, generation) for job_id, state, generation in rows.all()}
    placed_here = set(
        await session.scalars(
            select(models.RankAssignment.job_id)
            .where(models.RankAssignment.job_id.in_(ids))
            .where(models.RankAssignment.node_id == node_id)
            .where(models.RankAssignment.current())
        )
    )
    stale: dict[str, list[int] | None] = {}
    for job_id, generation, rank, standby in running:
        if job_id not in jobs:
            continue
        state, current = jobs[job_id]
        if state.terminal:
            stale[job_id] = []
        elif state is JobState.PENDING:
            stale[job_id] = None
        elif (
            state in LEFT_BEHIND_IN
            and not standby
            and generation < current
            and job_id not in placed_here
        ):
            ranks = stale.setdefault(job_id, [])
            assert ranks is not None
            ranks.append(rank)
    return stale


async def current_ranks(session: AsyncSession, job: models.Job) -> list[models.RankAssignment]:
    """The rank assignments of the job's current generation, by rank."""
    rows = await session.scalars(
        select(models.RankAssignment)
        .where(models.RankAssignment.job_id == job.id)
        .where(models.RankAssignment.current())
        .order_by(models.RankAssignment.rank)
    )
    return list(rows)
