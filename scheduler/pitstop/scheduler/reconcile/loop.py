"""The leader's loop. Level-triggered: every tick reads the state in PostgreSQL (and the
step streams in Redis), decides what changed in one transaction per decision, and sends
every node command that is due — those just decided, and any earlier one that no agent
acknowledged yet. A new leader simply carries on: nothing it needs is in memory."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from pitstop.health.massloss import MassLossPolicy
from pitstop.scheduler.cancelling import reraise_if_cancelling
from pitstop.scheduler.gateway import CommandRouter
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.leader import LeaderElection
from pitstop.scheduler.metrics import SchedulerMetrics
from pitstop.scheduler.reconcile import commands
from pitstop.scheduler.reconcile.context import Leader, Timeouts
from pitstop.scheduler.reconcile.deadlines import deadlines_due
from pitstop.scheduler.reconcile.exits import ExitFollower
from pitstop.scheduler.reconcile.hangs import HangWatch
from pitstop.scheduler.reconcile.placing import place_pending_jobs
from pitstop.scheduler.reconcile.recovery import Recovery
from pitstop.scheduler.reconcile.retention import Retention
from pitstop.scheduler.reconcile.standbys import StandbyKeeper
from pitstop.scheduler.reconcile.steps import WINDOW_HOLD_SECONDS, StepFollower
from pitstop.scheduler.store import Store

log = logging.getLogger(__name__)

MIN_TICK_GAP_SECONDS = 0.02
"""A tick woken by events starts no sooner than this after the previous one ended (a
burst of events is one tick); one woken after a longer quiet starts at once (a node's
failure waits for no timer)."""


class Reconciler:
    def __init__(
        self,
        store: Store,
        hot: HotState,
        router: CommandRouter,
        election: LeaderElection,
        metrics: SchedulerMetrics,
        *,
        timeouts: Timeouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        mass_loss: MassLossPolicy | None = None,
        step_report_seconds: float = 0.0,
        ended_job_retention_seconds: float = 86400.0,
    ) -> None:
        self.leader = Leader(
            store,
            hot,
            router,
            election,
            metrics,
            timeouts or Timeouts(),
            clock=clock,
            mass_loss=mass_loss or MassLossPolicy(),
            # A window's last rank may report a whole report interval after its first.
            window_hold_seconds=max(WINDOW_HOLD_SECONDS, step_report_seconds + 1.0),
        )
        self.steps = StepFollower(self.leader)
        self.recovery = Recovery(self.leader, self.steps.step_seconds)
        self.exits = ExitFollower(self.leader, self.recovery, self.steps)
        self.standbys = StandbyKeeper(self.leader, self.recovery.standby_nodes)
        self.hangs = HangWatch(self.leader, self.steps)
        self.retention = Retention(self.leader, ended_job_retention_seconds)

    async def run(self, tick_seconds: float) -> None:
        """The leader's two loops, for as long as this process leads. Deciding runs every
        `tick_seconds` and at once when the event log grows (a node failed, a rank
        exited: a decision waits for no timer, nor for the telemetry of every job);
        following the steps and keeping standbys runs beside it at its own pace."""
        self.leader.rank_maps.clear()  # what another leader wrote meanwhile is read afresh
        try:
            async with asyncio.TaskGroup() as loops:
                loops.create_task(self._loop("decide", self.decide, tick_seconds, woken=True))
                loops.create_task(self._loop("follow", self.follow, tick_seconds, woken=False))
        finally:
            # Lease lost (or stopping): the per-job series were this leader's view.
            self.leader.metrics.job.forget_all()
            self.leader.rank_maps.clear()

    async def _loop(
        self, name: str, body: Callable[[], Awaitable[None]], tick: float, *, woken: bool
    ) -> None:
        bus = self.leader.store.bus
        while True:
            seen = bus.version
            started = time.perf_counter()
            try:
                await body()
            except asyncio.CancelledError:
                raise
            except Exception:
                reraise_if_cancelling()
                log.exception("reconcile loop %s failed; the next pass retries", name)
            self.leader.metrics.tick_seconds.labels(name).observe(time.perf_counter() - started)
            if woken:
                ended = time.perf_counter()
                await bus.wait(seen, tick)
                quiet = time.perf_counter() - ended
                if quiet < MIN_TICK_GAP_SECONDS:
                    await asyncio.sleep(MIN_TICK_GAP_SECONDS - quiet)
            else:
                await asyncio.sleep(tick)

    async def decide(self) -> None:
        """One pass of the deciding loop. Each step runs even if an earlier one failed,
        the recoveries first (a job standing still waits on them; a pending job's
        placement can wait for one pass), and commands go out last: a decision is sent
        in the pass that made it, or re-sent by a later one."""
        for step in (self._repair, self._exits, self._deadlines, self._place):
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:
                reraise_if_cancelling()
                log.exception("reconcile step %s failed; the next pass retries", step.__name__)
        await commands.send_due(self.leader)
        await self.recovery.refresh_accounts()

    async def follow(self) -> None:
        """One pass of the following loop: step times, stragglers and committed steps a
        skipped report left behind, hangs, then standbys; now and then, what ended jobs
        left in Redis."""
        try:
            await self.steps.follow()
            await self.hangs.check()
        finally:
            await self.standbys.keep()
        await self.retention.sweep()

    async def _place(self) -> None:
        await self._send(await place_pending_jobs(self.leader))

    async def _repair(self) -> None:
        for job_id, nodes in self.steps.swap_requests().items():
            self.recovery.swap_nodes.setdefault(job_id, set()).update(nodes)
        await self._send(await self.recovery.repair_failed_nodes())

    async def _exits(self) -> None:
        await self._send(await self.exits.handle())

    async def _deadlines(self) -> None:
        await self._send(await deadlines_due(self.leader, self.recovery.accounts_due))

    async def _send(self, job_ids: set[str]) -> None:
        """The decisions just committed go out at once (the tick's end re-sends what
        is still due, of every job)."""
        if job_ids:
            await commands.send_due(self.leader, job_ids)
