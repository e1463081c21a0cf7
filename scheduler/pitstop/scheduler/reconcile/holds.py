"""Jobs held through a mass loss (pitstop.health.massloss): when many nodes go silent at
once, the jobs they touch are held instead of recovered — ranks stay, nothing replaced,
no exit restarted — until their nodes are back; nodes still away after the replace
deadline are replaced, a bounded number per window fleet-wide.

The hold lives in PostgreSQL (`jobs.held_since`, and the `job.held` / `job.released`
events), so a new leader carries it on; what is counted toward a mass loss is read each
pass: nodes lost silently within the window (`nodes.loss_cause`, `nodes.state_since`)
and suspects (streams that ended, their hosts still being asked; Redis)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass

from redis.exceptions import RedisError
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.health.massloss import batch_left, due_replacements, settling, touches_job
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import LossCause, NodeState
from pitstop.scheduler.reconcile.context import Leader, locked_job
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.topology import Placement

log = logging.getLogger(__name__)

Replace = Callable[[str, list[str], dict[str, NodeState | None]], Awaitable[bool]]
"""Recovery.replace: replace the job's `failed` nodes (states by node) in one decision."""


@dataclass(frozen=True)
class LostNodes:
    """The fleet's lost nodes as one recovery pass sees them."""

    away: dict[str, float]
    """LOST node -> seconds since it was lost."""
    suspects: set[str]
    """Nodes whose stream ended and whose host is still being asked."""
    silent: set[str]
    """Nodes counted toward a mass loss: lost silently within the window, or suspect."""
    settling: set[str]
    """Nodes lost silently too recently to replace (MassLossPolicy.settle_seconds)."""


async def lost_nodes(leader: Leader, session: AsyncSession) -> LostNodes:
    """The fleet's LOST nodes and how long each has been away, and what counts toward a
    mass loss (one query over the lost nodes, one Redis read of the suspects)."""
    node = models.Node
    window = leader.mass_loss.window_seconds
    rows = await session.execute(
        select(
            node.id, node.loss_cause, func.extract("epoch", func.now() - node.state_since)
        ).where(node.state == NodeState.LOST)
    )
    away: dict[str, float] = {}
    silent_away: dict[str, float] = {}
    for node_id, cause, seconds in rows.all():
        away[node_id] = float(seconds)
        if cause == LossCause.SILENT and float(seconds) <= window:
            silent_away[node_id] = float(seconds)
    silent = set(silent_away)
    try:
        suspects = set(await leader.hot.suspects.since(time.time() - window))
    except RedisError:  # judged without the suspects: the silent losses still count
        log.warning("mass loss: suspects unreadable (Redis); counting silent losses only")
        suspects = set()
    return LostNodes(away, suspects, silent | suspects, settling(leader.mass_loss, silent_away))


class Holds:
    """Holds jobs a mass loss touches, and releases them."""

    def __init__(self, leader: Leader, replace: Replace) -> None:
        self.leader = leader
        self.replace = replace
        # (leader clock, nodes) of each replacement of a held job's nodes, over the
        # window: the batch is fleet-wide, and only this leader decides.
        self._replaced: deque[tuple[float, int]] = deque()

    def touched(self, placement: Placement, lost: LostNodes) -> list[str]:
        """The job's nodes counted toward a mass loss, if the job is held for them."""
        mine = [n for n in lost.silent if placement.hosts(n)]
        if not mine:
            return []
        policy = self.leader.mass_loss
        if touches_job(policy, len(lost.silent), len(mine), len(placement.nodes())):
            return sorted(mine)
        return []

    async def hold(self, job_id: str, silent: Collection[str], fleet_silent: int) -> bool:
        """Hold the job (one transaction, one job.held event); True when it was not held."""
        policy = self.leader.mass_loss
        async with self.leader.store.write() as session:
            job = await locked_job(self.leader, session, job_id)
            if job is None or job.held_since is not None:
                return False
            job.held_since = func.now()
            record_event(
                session,
                "job.held",
                actor="scheduler",
                job_id=job_id,
                reason=(
                    f"{len(silent)} of its nodes went silent ({fleet_silent} in the fleet) "
                    f"within {policy.window_seconds:g} s: a partition or the scheduler's "
                    "own overload, not that many failures; held (its ranks stay, nothing "
                    "is replaced) until they are back, those still away after "
                    f"{policy.replace_after_seconds:g} s replaced"
                ),
                attributes={
                    "lost_nodes": str(len(silent)),
                    "fleet_lost_nodes": str(fleet_silent),
                    "window_seconds": f"{policy.window_seconds:g}",
                    "generation": str(job.generation),
                    "nodes": ",".join(sorted(silent)[:64]),
                },
            )
        self.leader.metrics.mass_losses.inc()
        log.warning("job %s held: %d of its nodes went silent at once", job_id, len(silent))
        return True

    async def carry_on(
        self,
        job: models.Job,
        placement: Placement,
        lost: LostNodes,
        states: Mapping[str, NodeState],
    ) -> bool:
        """A held job: released once none of its nodes is lost or suspect; else its
        nodes away past the replace deadline are replaced, within the window's batch.
        True when a replacement was decided."""
        away = {n: s for n, s in lost.away.items() if placement.hosts(n)}
        if not away:
            if not any(placement.hosts(n) for n in lost.suspects):
                await self.release(job.id)
            return False
        now = self.leader.clock()
        policy = self.leader.mass_loss
        while self._replaced and self._replaced[0][0] < now - policy.window_seconds:
            self._replaced.popleft()
        budget = batch_left(policy, sum(n for _, n in self._replaced))
        due = due_replacements(policy, away, budget)
        if not due:
            return False
        due.sort(key=placement.first_rank)
        if not await self.replace(job.id, due, {n: states.get(n) for n in due}):
            return False
        self._replaced.append((now, len(due)))
        self.leader.metrics.held_replacements.inc(len(due))
        return True

    async def release(self, job_id: str) -> None:
        """End the job's hold: its nodes are back (or replaced)."""
        async with self.leader.store.write() as session:
            job = await locked_job(self.leader, session, job_id)
            if job is None or job.held_since is None:
                return
            held = float(
                await session.scalar(select(func.extract("epoch", func.now() - job.held_since)))
                or 0
            )
            began = await session.scalar(
                select(models.Event.attributes)
                .where(models.Event.job_id == job_id)
                .where(models.Event.kind == "job.held")
                .order_by(models.Event.id.desc())
                .limit(1)
            )
            since = int((began or {}).get("generation", job.generation))
            job.held_since = None
            record_event(
                session,
                "job.released",
                actor="scheduler",
                job_id=job_id,
                reason=(
                    f"held {held:.1f} s: none of its nodes is lost any more "
                    f"({job.generation - since} replacement decisions meanwhile)"
                ),
                attributes={
                    "held_seconds": f"{held:.3f}",
                    "generation": str(job.generation),
                    "replacements": str(job.generation - since),
                },
            )
        log.warning("job %s released: its nodes are back", job_id)
