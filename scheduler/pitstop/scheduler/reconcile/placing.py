"""Placing pending gangs: one transaction places a job and decides its start (the
generation's rank map, every node's StartRanks, the start's deadline); one transaction
preempts a running job (back to PENDING, its GPUs released, its ranks told to stop at
the next step boundary); the reasons the others wait are written where `job list`
shows them. Admission itself (order, quotas, victims, reasons) is `admission.admit`."""

from __future__ import annotations

import datetime as dt
import logging
import time

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.admission import PREEMPT_GRACE_SECONDS, Admission, Pending, Running, admit
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.placement import GangRequest
from pitstop.scheduler.reconcile.context import Leader, locked_job, set_deadline
from pitstop.scheduler.services import catalog, lifecycle
from pitstop.scheduler.services import node_commands as plan
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.services.node_commands import NodeAction
from pitstop.scheduler.services.projects import quota_usage
from pitstop.scheduler.topology import Placement
from pitstop.v1 import agent_pb2

log = logging.getLogger(__name__)


async def place_pending_jobs(leader: Leader) -> set[str]:
    """Place what fits, preempt what must make room; the ids of the jobs placed (their
    commands are due)."""
    async with leader.store.read() as session:
        pending = await lifecycle.live_jobs(session, (JobState.PENDING,))
        if not pending:
            return set()
        nodes, booked = await lifecycle.topology_inputs(session)
        quotas = await quota_usage(session)
        victims = await _preemptible(session, max(j.priority for j in pending))
    requests = []
    for seq, job in enumerate(sorted(pending, key=lambda j: (j.created_at, j.id))):
        spec = spec_from_json(job.spec)
        request = GangRequest(
            job.id,
            spec.tp,
            spec.pp,
            spec.dp,
            spec.gpus_per_node,
            priority=job.priority,
            sequence=seq,
        )
        requests.append(Pending(request, job.project))
    verdict = admit(nodes, booked, requests, quotas=quotas, preemptible=victims)
    await _write_reasons(leader, {j.id: j.reason for j in pending}, verdict)
    for victim, by in sorted(verdict.preempt.items()):
        await _preempt(leader, victim, by)
    placed = set()
    for job_id, placement in verdict.placed.items():
        started = time.perf_counter()
        async with leader.store.write() as session:
            row = await locked_job(leader, session, job_id, (JobState.PENDING,))
            if row is None:
                continue
            leader.rank_maps.forget(row.id, row.generation + 1)
            await lifecycle.place(session, row, placement)
            lifecycle.transition(
                session, row, JobState.STARTING, kind="job.starting", reason="starting ranks"
            )
            row.restore_step = await catalog.restorable_step(session, row)
            if row.preemptions:
                record_event(
                    session,
                    "job.resuming",
                    actor="scheduler",
                    job_id=row.id,
                    reason=(
                        f"capacity returned after a preemption: resuming from step "
                        f"{row.restore_step}"
                    ),
                    attributes={"step": str(row.restore_step)},
                )
            row.commands_after = None
            set_deadline(row, leader.timeouts.restart_seconds)
            starts = dict.fromkeys(placement.nodes(), NodeAction.START)
            await plan.replace_plan(session, row, starts)
        leader.metrics.decision_seconds.labels("placement").observe(time.perf_counter() - started)
        placed.add(job_id)
    return placed


async def _preemptible(session: AsyncSession, above: int) -> list[Running]:
    """Running preemptible jobs of priority below `above`, past their minimum run time,
    with the GPUs they hold."""
    rows = (
        await session.scalars(
            select(models.Job)
            .where(models.Job.state == JobState.RUNNING)
            .where(models.Job.priority < above)
        )
    ).all()
    now = dt.datetime.now(dt.UTC)
    chosen: dict[str, models.Job] = {}
    for job in rows:
        spec = spec_from_json(job.spec)
        if not spec.preemptible or job.running_since is None:
            continue
        if (now - job.running_since).total_seconds() < spec.min_run_seconds:
            continue
        chosen[job.id] = job
    if not chosen:
        return []
    gpus: dict[str, list[tuple[str, int]]] = {job_id: [] for job_id in chosen}
    b = models.GpuBooking
    for job_id, node_id, index in await session.execute(
        select(b.job_id, b.node_id, b.gpu_index).where(b.job_id.in_(sorted(chosen)))
    ):
        gpus[job_id].append((node_id, index))
    return [
        Running(
            job.id,
            job.priority,
            max(job.current_step - job.durable_step, 0),
            tuple(gpus[job.id]),
        )
        for job in chosen.values()
    ]


async def _write_reasons(leader: Leader, reasons: dict[str, str], verdict: Admission) -> None:
    """Each waiting job's reason, written only where it changed (a pass reads them all,
    and most passes change none)."""
    changed = {job_id: why for job_id, why in verdict.waiting.items() if reasons.get(job_id) != why}
    if not changed:
        return
    async with leader.store.write() as session:
        await leader.election.assert_leader(session)
        for job_id, why in sorted(changed.items()):
            await session.execute(
                update(models.Job)
                .where(models.Job.id == job_id, models.Job.state == JobState.PENDING)
                .values(reason=why)
            )


async def _preempt(leader: Leader, job_id: str, by: str) -> None:
    """Send `job_id` back to the queue for `by`: PENDING, its GPUs and rank map released
    in the transaction, its ranks told to stop at their next step boundary (their last
    snapshot sealed) after the commit. A lost message is made good by the agents' stale
    check, which stops the processes of a job that is not placed."""
    async with leader.store.write() as session:
        row = await locked_job(leader, session, job_id, (JobState.RUNNING,))
        if row is None:
            return
        winner = await session.get(models.Job, by)
        priority = winner.priority if winner is not None else "?"
        nodes = (await leader.rank_maps.of(session, row)).nodes()
        lifecycle.transition(
            session,
            row,
            JobState.PENDING,
            kind="job.preempted",
            reason=(
                f"preempted by job {by} (priority {priority} over {row.priority}): stopping at "
                "its next step boundary with its last snapshot sealed; it resumes from there "
                "when capacity returns"
            ),
            attributes={"by": by, "step": str(row.current_step)},
        )
        row.preemptions += 1
        row.running_since = None
        set_deadline(row, None)
        await leader.rank_maps.write(session, row, Placement(()))
        await plan.replace_plan(session, row, {})
    log.info("job %s preempted for job %s; stopping its ranks on %s", job_id, by, list(nodes))
    stop = agent_pb2.StopRanks(
        job_id=job_id,
        grace_seconds=PREEMPT_GRACE_SECONDS,
        reason=f"preempted by job {by}",
        at_boundary=True,
    )
    await leader.router.send_many(
        [(node_id, agent_pb2.SchedulerMessage(stop_ranks=stop)) for node_id in nodes]
    )
