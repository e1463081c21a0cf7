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
from pitstop.scheduler.placement import GangRequest, shrink_by_one_replica
from pitstop.scheduler.reconcile.context import Leader, locked_job, set_deadline
from pitstop.scheduler.reconcile.recovery import node_actions
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
        victims = await _preemptible(leader, session, max(j.priority for j in pending))
        # A preempted job comes back at the size it ran (a shrink before stays): its
        # snapshots are of that world.
        worlds = {
            j.id: await catalog.world_size(session, j, j.generation - 1)
            for j in pending
            if j.preemptions and j.generation > 1
        }
    requests = []
    for seq, job in enumerate(sorted(pending, key=lambda j: (j.created_at, j.id))):
        spec = spec_from_json(job.spec)
        per_replica = max(spec.tp, 1) * max(spec.pp, 1)
        dp = worlds[job.id] // per_replica if worlds.get(job.id, 0) >= per_replica else spec.dp
        request = GangRequest(
            job.id,
            spec.tp,
            spec.pp,
            dp,
            spec.gpus_per_node,
            priority=job.priority,
            sequence=seq,
        )
        requests.append(Pending(request, job.project))
    verdict = admit(nodes, booked, requests, quotas=quotas, preemptible=victims)
    await _write_reasons(leader, {j.id: j.reason for j in pending}, verdict)
    placed = set()
    for job_id, (drop, by) in sorted(verdict.shrink.items()):
        if await _shrink(leader, job_id, drop, by):
            placed.add(job_id)  # its new generation's commands are due
        else:
            verdict.preempt[job_id] = by  # its replicas share nodes: preempted whole
    for victim, by in sorted(verdict.preempt.items()):
        await _preempt(leader, victim, by)
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


async def _preemptible(leader: Leader, session: AsyncSession, above: int) -> list[Running]:
    """Running preemptible jobs of priority below `above`, past their minimum run time,
    with the GPUs they hold, by replica."""
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
    running = []
    for job in chosen.values():
        placement = await leader.rank_maps.of(session, job)
        replicas: dict[int, list[tuple[str, int]]] = {}
        for slot in placement.ranks:
            replicas.setdefault(slot.dp, []).append((slot.node_id, slot.gpu_index))
        running.append(
            Running(
                job.id,
                job.priority,
                max(job.current_step - job.durable_step, 0),
                tuple(pair for _, pairs in sorted(replicas.items()) for pair in pairs),
                replicas=tuple(tuple(pairs) for _, pairs in sorted(replicas.items())),
                min_dp=spec_from_json(job.spec).min_dp,
            )
        )
    return running


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


async def _shrink(leader: Leader, job_id: str, drop: int, by: str) -> bool:
    """Drop the last `drop` data-parallel replicas of `job_id` to make room for `by`:
    the survivors reconfigure at the next step boundary (restoring the newest step every
    rank holds) and run on; the dropped ranks leave, their GPUs released in the
    transaction. Not a failure: the event is job.shrunk, no incident. False when a
    replica cannot be dropped alone (it shares a node with another): the caller
    preempts the job whole instead."""
    async with leader.store.write() as session:
        row = await locked_job(leader, session, job_id, (JobState.RUNNING,))
        if row is None:
            return True  # it moved on meanwhile: nothing to do, nothing to preempt
        spec = spec_from_json(row.spec)
        before = await leader.rank_maps.of(session, row)
        after = before
        for _ in range(drop):
            last = max(slot.dp for slot in after.ranks)
            node_id = next(s.node_id for s in after.ranks if s.dp == last)
            shrunk = shrink_by_one_replica(after, node_id, spec.tp, spec.pp)
            if shrunk is None or last + 1 <= max(spec.min_dp, 1):
                return False
            after = shrunk
        winner = await session.get(models.Job, by)
        priority = winner.priority if winner is not None else "?"
        dp = after.world_size // (spec.tp * spec.pp)
        restore = await catalog.restorable_step(session, row)
        actions = await node_actions(session, row, before, after)
        await leader.rank_maps.write(session, row, after)
        row.restore_step = restore
        row.commands_after = None
        set_deadline(row, leader.timeouts.recovery_seconds)
        await plan.change_plan(session, row, actions)
        lifecycle.transition(
            session,
            row,
            JobState.RECOVERING,
            kind="job.shrunk",
            reason=(
                f"shrunk to dp={dp} (min_dp {spec.min_dp}) to make room for job {by} "
                f"(priority {priority} over {row.priority}); restoring step {restore}"
            ),
            attributes={"by": by, "dp": str(dp), "step": str(restore)},
        )
    log.info("job %s shrunk by %d replica(s) for job %s", job_id, drop, by)
    return True


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
