"""What every part of the leader's loop shares, and the preamble of a deciding
transaction, written once."""

from __future__ import annotations

import datetime as dt
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.health.massloss import MassLossPolicy
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState, NodeState
from pitstop.scheduler.gateway import CommandRouter
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.leader import LeaderElection
from pitstop.scheduler.metrics import SchedulerMetrics
from pitstop.scheduler.services import lifecycle
from pitstop.scheduler.store import Store
from pitstop.scheduler.topology import Placement

RUNNABLE = (JobState.STARTING, JobState.RUNNING, JobState.RECOVERING)
FAILED_NODE_STATES = (NodeState.UNHEALTHY, NodeState.LOST)


@dataclass(frozen=True)
class Timeouts:
    """How long a decision in flight may take before its fallback (stored as a deadline
    on the job with the decision)."""

    recovery_seconds: float = 30.0
    """An in-place recovery not stepping by then becomes a full restart of every rank."""
    restart_seconds: float = 120.0
    """A (re)start of every rank not stepping by then is restarted again (a restart counted
    against max_restarts, so a job that can never start ends FAILED, never stuck)."""


class RankMaps:
    """Rank maps as read or written, by (job, generation). A committed generation's map
    never changes, so the leader reads each from PostgreSQL once, not every tick
    (100,000 rows for the 99,968-rank job, five times a second), and keeps the one it
    writes as written (the fan-out that follows a recovery read it back whole: 8,000
    rows at 1,000 nodes, most of the decision's fan-out time). Only a generation written
    and rolled back could be written again differently: every write replaces its key,
    nobody asks for a generation the job's row does not name, and a new term of
    leadership starts empty."""

    KEEP = 64

    def __init__(self) -> None:
        self._maps: OrderedDict[tuple[str, int], Placement] = OrderedDict()

    async def of(self, session: AsyncSession, job: models.Job) -> Placement:
        """The job's current generation (empty before placement)."""
        key = (job.id, job.generation)
        found = self._maps.get(key)
        if found is None:
            found = await lifecycle.rank_map(session, job)
            self._keep(key, found)
        else:
            self._maps.move_to_end(key)
        return found

    async def write(self, session: AsyncSession, job: models.Job, placement: Placement) -> None:
        """`lifecycle.write_generation` as a delta on the map read; the new generation's
        map is then `placement` (ordered by rank, as a read gives it back)."""
        self.forget(job.id, job.generation + 1)
        await lifecycle.write_generation(session, job, placement, await self.of(session, job))
        self._keep((job.id, job.generation), placement)

    def _keep(self, key: tuple[str, int], placement: Placement) -> None:
        self._maps[key] = placement
        self._maps.move_to_end(key)
        while len(self._maps) > self.KEEP:
            self._maps.popitem(last=False)

    def cached(self, job_id: str, generation: int) -> Placement | None:
        """The job's map of `generation` if this leader has it at hand (it read or wrote
        it); None otherwise, never a read."""
        return self._maps.get((job_id, generation))

    def forget(self, job_id: str, generation: int) -> None:
        self._maps.pop((job_id, generation), None)

    def clear(self) -> None:
        self._maps.clear()


@dataclass
class Leader:
    """The deciding process's parts."""

    store: Store
    hot: HotState
    router: CommandRouter
    election: LeaderElection
    metrics: SchedulerMetrics
    timeouts: Timeouts = field(default_factory=Timeouts)
    clock: Callable[[], float] = time.monotonic
    mass_loss: MassLossPolicy = field(default_factory=MassLossPolicy)
    window_hold_seconds: float = 5.0
    """Longest a straggler window waits for the job's other ranks before the detector sees
    it: longer than the agents' step report interval (steps.WindowOrder)."""
    rank_maps: RankMaps = field(default_factory=RankMaps)


async def locked_job(
    leader: Leader, session: AsyncSession, job_id: str, states: Collection[JobState] | None = None
) -> models.Job | None:
    """Inside a deciding transaction: check the fencing token, lock the job's row; None
    when the job is gone, ended, or (with `states`) in none of them."""
    await leader.election.assert_leader(session)
    job = await session.get(models.Job, job_id, with_for_update=models.NO_KEY_UPDATE)
    if job is None or job.state.terminal:
        return None
    if states is not None and job.state not in states:
        return None
    return job


def set_deadline(job: models.Job, seconds: float | None, *, after: float = 0.0) -> None:
    """The decision in flight is given up `seconds` from now (PostgreSQL's clock) plus
    `after` (a backoff); None clears it."""
    if seconds is None:
        job.deadline = None
        return
    job.deadline = func.now() + dt.timedelta(seconds=after + seconds)


async def failed_nodes(session: AsyncSession, placement: Placement) -> dict[str, NodeState]:
    """The nodes of `placement` that are lost or unhealthy, with their states: the
    fleet's failed nodes (a few) looked up in the map, not the map's nodes (thousands) in
    the fleet."""
    rows = await session.execute(
        select(models.Node.id, models.Node.state).where(models.Node.state.in_(FAILED_NODE_STATES))
    )
    return {node_id: state for node_id, state in rows if placement.hosts(node_id)}
