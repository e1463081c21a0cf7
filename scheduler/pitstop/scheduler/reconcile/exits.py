"""Rank exits, read from the event log: a job whose ranks all finished succeeds; a rank
of the current generation that failed restarts in place; a rank of an older generation
that ended after the current one was decided makes its node start afresh. The cursor
moves only past exits that were handled, and a new leader reads them all again (each
decision is idempotent), so no exit is ever dropped."""

from __future__ import annotations

import logging

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.reconcile.context import RUNNABLE, Leader, locked_job, set_deadline
from pitstop.scheduler.reconcile.recovery import Recovery
from pitstop.scheduler.reconcile.steps import StepFollower
from pitstop.scheduler.services import goodput, lifecycle

log = logging.getLogger(__name__)


def clean(event: models.Event) -> bool:
    return event.attributes.get("exit_code") == "0" and event.attributes.get("signal") == "0"


class ExitFollower:
    def __init__(self, leader: Leader, recovery: Recovery, steps: StepFollower) -> None:
        self.leader = leader
        self.recovery = recovery
        self.steps = steps
        self.cursor = 0

    async def handle(self) -> set[str]:
        """Handle every new exit; the ids of jobs with a new decision."""
        async with self.leader.store.read() as session:
            live = [j.id for j in await lifecycle.live_jobs(session)]
            if not live:
                return set()
            exits = (
                await session.scalars(
                    select(models.Event)
                    .where(models.Event.kind == "rank.exited")
                    .where(models.Event.id > self.cursor)
                    .where(models.Event.job_id.in_(live))
                    .order_by(models.Event.id)
                )
            ).all()
        decided = set()
        deferred = False
        for event in exits:
            outcome = await self._handle(event)
            if outcome is None:
                deferred = True  # its job is held: read again at every tick until released
                continue
            if outcome:
                decided.add(event.job_id or "")
            # Only once it is handled: a decision that failed (the store gone, a
            # refused fencing check) is taken again at the next tick.
            if not deferred:
                self.cursor = max(self.cursor, event.id)
        return decided

    async def _handle(self, event: models.Event) -> bool | None:
        """True when a decision was committed; None when the job is held through a mass
        loss (its exits wait: a partition's timeouts are not failures to restart)."""
        job_id = event.job_id or ""
        async with self.leader.store.read() as session:
            job = await session.get(models.Job, job_id)
            if job is None or job.state.terminal:
                return False
            if job.held_since is not None:
                return None
            generation = job.generation
            world = (await self.leader.rank_maps.of(session, job)).world_size
            finished = await _clean_exits(session, job_id, generation)
        exited_in = int(event.attributes.get("generation", -1))
        if exited_in < generation:
            return await self.recovery.stale_exit(job_id, event)
        if exited_in > generation:
            return False  # cannot happen: generations come from the scheduler
        if not clean(event):
            return await self.recovery.fail_rank(job_id, event)
        if finished >= world:
            # The ranks' last step times were sent before their exits but are read from
            # another stream: take them in first.
            await self.steps.follow()
            await self.finish(job_id, event)
        return False

    async def finish(self, job_id: str, event: models.Event) -> None:
        leader = self.leader
        async with leader.store.write() as session:
            # Also from STARTING or RECOVERING: ranks that restored the last step (or
            # had little left) may all finish before reporting a step.
            job = await locked_job(leader, session, job_id, RUNNABLE)
            if job is None:
                return
            job.result = {
                **job.result,
                **{
                    k.removeprefix("result."): v
                    for k, v in event.attributes.items()
                    if k.startswith("result.")
                },
            }
            # Step times are telemetry (an agent drops them when its buffer is full, or
            # across a scheduler restart); a final step the ranks report is the truth.
            steps = job.result.get("steps", "")
            if steps.isdecimal():
                job.current_step = max(job.current_step, int(steps))
            lifecycle.transition(
                session, job, JobState.SUCCEEDED, kind="job.succeeded", reason="every rank exited 0"
            )
            set_deadline(job, None)
            await session.flush()
            watch = self.steps.watches.get(job_id)
            step_seconds = watch.step_seconds() if watch is not None else 0.0
            await goodput.refresh(session, job, step_seconds=step_seconds)
            await lifecycle.release_gpus(session, job.id)
        self.steps.forget(job_id)


async def _clean_exits(session: AsyncSession, job_id: str, generation: int) -> int:
    """How many distinct ranks of `generation` exited 0 (from the event log, so a new
    leader counts those that finished before it took over)."""
    attrs = models.Event.attributes
    return int(
        await session.scalar(
            select(func.count(func.distinct(attrs["rank"].astext)))
            .where(models.Event.job_id == job_id)
            .where(models.Event.kind == "rank.exited")
            .where(attrs["generation"].astext == str(generation))
            .where(attrs["exit_code"].astext == "0")
            .where(attrs["signal"].astext == "0")
        )
        or 0
    )
