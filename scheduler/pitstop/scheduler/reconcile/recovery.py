"""Recovery decisions. Each is one transaction that commits everything the recovery
needs — the generation's rank map, the restore step, every node's command (adopt,
start, reconfigure, leave), the deadline and its fallback — and returns the job's id;
the command fan-out sends what it committed (and re-sends it until acknowledged)."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from redis.exceptions import RedisError
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState, NodeState
from pitstop.scheduler.placement import choose_replacement, replace_node, shrink_by_one_replica
from pitstop.scheduler.reconcile.commands import stop_everywhere
from pitstop.scheduler.reconcile.context import (
    FAILED_NODE_STATES,
    RUNNABLE,
    Leader,
    failed_nodes,
    locked_job,
    set_deadline,
)
from pitstop.scheduler.reconcile.holds import Holds, lost_nodes
from pitstop.scheduler.reconcile.outcomes import fail_job, recovering
from pitstop.scheduler.services import catalog, goodput, lifecycle
from pitstop.scheduler.services import node_commands as plan
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.services.node_commands import IN_FLIGHT, NodeAction
from pitstop.scheduler.services.nodes import swap_roles
from pitstop.scheduler.topology import Placement, Topology

log = logging.getLogger(__name__)

UNSEEN_EXIT_WINDOW = dt.timedelta(seconds=2)
"""How long before a decision an exit may have been recorded and still gone unseen by
it (its transaction began before the decision's and committed after)."""


async def node_actions(
    session: AsyncSession,
    job: models.Job,
    before: Placement,
    after: Placement,
    *,
    fresh: AbstractSet[str] = frozenset(),
    adopting: AbstractSet[str] = frozenset(),
) -> dict[str, NodeAction]:
    """What each node whose command is not a reconfigure does to reach `after` from
    `before` (the others of `after` reconfigure in place: node_commands.change_plan).
    Nodes new to the map start (or adopt, where a standby of the job waits); so do nodes
    in `fresh` (a rank there died: those in `adopting` hand it to the standby beside
    their ranks, the others start their ranks afresh) and nodes whose start of the
    previous generation may still be under way (its ranks may not have opened their
    command streams, so a Reconfigure would miss them). Nodes of `before` left out
    leave (their ranks find themselves absent and leave at the boundary every rank
    agrees on, so the survivors reach it at once instead of stepping on). Set
    arithmetic over the maps' node tuples, no loop over the job's every node."""
    in_flight = job.state in (JobState.STARTING, JobState.RECOVERING)
    starting_before = await plan.starting_nodes(session, job) if in_flight else set()
    was, now = set(before.nodes()), set(after.nodes())
    actions: dict[str, NodeAction] = {}
    for node_id in now - was:
        actions[node_id] = NodeAction.ADOPT if node_id in adopting else NodeAction.START
    for node_id in (fresh | starting_before) & (now & was):
        starting = node_id in starting_before
        if node_id in fresh and node_id in adopting and not starting:
            actions[node_id] = NodeAction.ADOPT  # its standby takes the dead ranks over
        else:
            actions[node_id] = NodeAction.START
    for node_id in was - now:
        actions[node_id] = NodeAction.LEAVE
    return actions


DRAIN_WAIT_SECONDS = 30.0
"""How long a draining node waits for a moment when its job's newest step is committed;
past this its ranks move from the committed step, giving up the steps since."""


def drain_due(job: models.Job, draining_seconds: float, restore_step: int | None = None) -> bool:
    """Whether the job's ranks on a node draining for `draining_seconds` move now: at a
    moment when the job's newest step is committed (moving from it gives up no step),
    or past DRAIN_WAIT_SECONDS from any committed step. A job with nothing committed yet
    trains on where it is (the node's fault is a warning). `restore_step`: the step the
    move would restore, where a decision knows it (under the job's lock, the newest step
    whole in memory); else the committed step. The pass that finds a drain due reads
    the job before the decision locks it, and the job steps on meanwhile: the decision
    asks again with the step it would restore."""
    if job.committed_step <= 0:
        return False
    restore = job.committed_step if restore_step is None else restore_step
    return restore >= job.current_step or draining_seconds >= DRAIN_WAIT_SECONDS


class Recovery:
    """Node failures and rank exits, each turned into a committed decision (a missed
    deadline is deadlines.py's)."""

    def __init__(self, leader: Leader, step_seconds: Callable[[str], float]) -> None:
        self.leader = leader
        # The job's typical step time (what a redone step costs the goodput account).
        self.step_seconds = step_seconds
        # Jobs whose goodput account a decision changed (see refresh_accounts).
        self.accounts_due: set[str] = set()
        # The spares holding a standby process of each job (kept by StandbyKeeper).
        self.standby_nodes: dict[str, set[str]] = {}
        # Nodes a straggler finding asked to swap out (StepFollower fills it).
        self.swap_nodes: dict[str, set[str]] = {}
        self.holds = Holds(leader, self.replace)

    # Node failures ---------------------------------------------------------------------

    async def repair_failed_nodes(self) -> set[str]:
        """Decide a recovery for every job with a rank on a failed (or draining, or
        straggling) node, unless a mass loss holds it (holds.py); the ids of the jobs
        decided."""
        swapping = set().union(*self.swap_nodes.values())
        async with self.leader.store.read() as session:
            jobs = await lifecycle.live_jobs(session, (*RUNNABLE, JobState.PAUSED))
            if not jobs:
                return set()
            # The nodes that could need replacing, not the fleet: a healthy fleet is an
            # empty answer, five times a second.
            node = models.Node
            rows = (
                await session.execute(
                    select(
                        node.id,
                        node.state,
                        func.extract("epoch", func.now() - node.state_since),
                    ).where(
                        node.state.in_((*FAILED_NODE_STATES, NodeState.DRAINING))
                        | node.id.in_(sorted(swapping))
                    )
                )
            ).all()
            states = {node_id: state for node_id, state, _ in rows}
            draining = {
                node_id: float(since or 0)
                for node_id, state, since in rows
                if state is NodeState.DRAINING
            }
            lost = await lost_nodes(self.leader, session)
            held = any(job.held_since is not None for job in jobs)
            if not states and not swapping and not lost.silent and not held:
                return set()
            maps = {job.id: await self.leader.rank_maps.of(session, job) for job in jobs}
        decided = set()
        for job in jobs:
            placement, swap = maps[job.id], self.swap_nodes.get(job.id, set())
            if job.held_since is not None:
                if await self.holds.carry_on(job, placement, lost, states):
                    decided.add(job.id)
                continue
            silent = self.holds.touched(placement, lost)
            if silent:
                await self.holds.hold(job.id, silent, len(lost.silent))
                continue
            failed = sorted(
                (
                    n
                    for n in {*states, *swap}
                    if placement.hosts(n)
                    and n not in lost.settling  # a partition's first? replaced when settled
                    and (
                        states.get(n) in FAILED_NODE_STATES
                        or n in swap
                        or (n in draining and drain_due(job, draining[n]))
                    )
                ),
                key=placement.first_rank,
            )
            # Only drains: moved at a step that gives up none (asked again under the lock).
            drains = {n: draining[n] for n in failed if n in draining and n not in swap}
            only_drains = drains if len(drains) == len(failed) else None
            if failed and await self.replace(
                job.id, failed, {n: states.get(n) for n in failed}, drains=only_drains
            ):
                decided.add(job.id)
                swap.difference_update(failed)
        return decided

    async def replace(
        self,
        job_id: str,
        failed: list[str],
        states: dict[str, NodeState | None],
        drains: dict[str, float] | None = None,
    ) -> bool:
        """Move the job's ranks off the `failed` nodes (their states by node) in one
        committed decision; True when it was. `drains`: every node moves because it
        drains (seconds draining by node): the move waits for a pass where it gives up
        no step, or for the drain's wait to run out (drain_due)."""
        leader = self.leader
        started = time.perf_counter()
        prefer = self.standby_nodes.get(job_id, set())
        try:
            ready = await leader.hot.ready_standbys(job_id, prefer) & prefer
        except RedisError:  # decide without it: any standby still beats a cold start
            ready = set()
        async with leader.store.write() as session:
            job = await locked_job(leader, session, job_id)
            if job is None:
                return False
            before = await self.leader.rank_maps.of(session, job)
            placement = before
            nodes, booked = await lifecycle.topology_inputs(session, spares_and=failed)
            topology = Topology.build(nodes, booked)
            spec = spec_from_json(job.spec)
            moves = []
            for node_id in failed:
                new = _repair_one(
                    topology,
                    placement,
                    node_id,
                    spec.tp,
                    spec.pp,
                    spec.min_dp,
                    must=states.get(node_id) in FAILED_NODE_STATES,
                    prefer=prefer,
                    ready=ready,
                )
                if new is None:
                    continue
                placement, how = new
                moves.append(f"{node_id} ({(states.get(node_id) or NodeState.READY).value}): {how}")
            if not moves:
                if any(s in FAILED_NODE_STATES for s in states.values()) and (
                    job.state is not JobState.RECOVERING
                ):
                    lifecycle.transition(
                        session,
                        job,
                        JobState.RECOVERING,
                        kind="job.recovering",
                        reason="waiting for capacity: no spare and no shrink left",
                    )
                    # Its deadline stands: when it passes with a node of the map still
                    # failed, fall_back re-arms it (the job waits for capacity, and says
                    # so); with every node back, it restarts the ranks in place.
                    if job.deadline is None:
                        set_deadline(job, leader.timeouts.restart_seconds)
                return False
            restore = await catalog.restorable_step(session, job)
            if drains and not all(drain_due(job, s, restore) for s in drains.values()):
                return False  # the job stepped on since the pass: the next one moves it
            incident = await goodput.node_incident(session, leader.hot, job, states, restore)
            added = set(placement.nodes()) - set(before.nodes())
            gone = set(before.nodes()) - set(placement.nodes())
            await swap_roles(session, sorted(added), sorted(gone), job_id=job.id)
            actions = await node_actions(session, job, before, placement, adopting=added & prefer)
            await self.leader.rank_maps.write(session, job, placement)
            job.restore_step = restore
            job.commands_after = None
            set_deadline(job, leader.timeouts.recovery_seconds)
            await plan.change_plan(session, job, actions)
            recovering(
                session,
                job,
                kind="job.recovering",
                again="job.reconfigured",
                reason=f"{'; '.join(moves)}; restoring step {restore}",
                attributes=incident,
            )
            self.accounts_due.add(job.id)
        for node_id in added & prefer:
            prefer.discard(node_id)  # taken: the standby keeper starts another
        leader.metrics.decision_seconds.labels("recovery").observe(time.perf_counter() - started)
        leader.metrics.recoveries.labels("node").inc()
        return True

    async def refresh_accounts(self) -> None:
        """Refresh the goodput account of every job a decision changed, so each decision
        (and a job that failed) shows in it at once. Telemetry: after the commands went
        out, never inside the deciding transaction (it only adds to the recovery)."""
        due, self.accounts_due = self.accounts_due, set()
        for job_id in sorted(due):
            async with self.leader.store.write() as session:
                job = await session.get(models.Job, job_id, with_for_update=models.NO_KEY_UPDATE)
                if job is not None:
                    await goodput.refresh(session, job, step_seconds=self.step_seconds(job_id))

    # Rank exits ------------------------------------------------------------------------

    async def fail_rank(self, job_id: str, exited: models.Event) -> bool:
        """A rank of the current generation failed: a new generation in the same places,
        where every node with a failed rank of this generation starts its ranks anew (or
        hands them to the standby waiting beside them, which resumes in a fraction of a
        fresh start) and the others reconfigure in place — at once, or after a backoff
        for a job that keeps failing without stepping — while restarts remain; else the
        job fails. A rank that ended on a node already failed (a fatal Xid ends the
        ranks on its GPU) is that node's failure: the node is replaced, the way the repair
        pass would, not restarted in place first. True when a decision was committed."""
        leader = self.leader
        async with leader.store.read() as session:
            job = await session.get(models.Job, job_id)
            if job is None:
                return False
            placement = await self.leader.rank_maps.of(session, job)
            failed = await failed_nodes(session, placement)
        if exited.node_id in failed:
            ordered = sorted(failed, key=placement.first_rank)
            return await self.replace(job_id, ordered, dict(failed))
        nodes: list[str] = []
        async with leader.store.write() as session:
            job = await locked_job(leader, session, job_id)
            if job is None or int(exited.attributes.get("generation", -1)) != job.generation:
                return False
            spec = spec_from_json(job.spec)
            placement = await self.leader.rank_maps.of(session, job)
            if job.restarts >= spec.max_restarts:
                nodes = await fail_job(session, job, placement, exited.reason)
            else:
                job.restarts += 1
                # A job that stepped past its restore step since its last restart got
                # going again: this failure is a new one, not a crash loop.
                recent = (
                    0
                    if job.current_step > job.restore_step
                    else await _recent_restarts(session, job.id)
                )
                backoff = restart_backoff(recent)
                incident = goodput.rank_incident(job, exited)
                fresh = await _nodes_with_failed_ranks(session, job) | {exited.node_id or ""}
                fresh -= {""}
                # Where a standby waits beside the ranks, it takes the dead rank over.
                warm = await _ready_standbys(leader, job.id, fresh)
                how = f"taken over by the standby beside it on {', '.join(sorted(warm))}; "
                reason = (
                    f"{exited.reason}; {how if warm else ''}restart {job.restarts} of "
                    f"{spec.max_restarts} in {backoff:.0f}s"
                )
                actions = await node_actions(
                    session, job, placement, placement, fresh=fresh, adopting=warm
                )
                await self.leader.rank_maps.write(session, job, placement)
                job.restore_step = await catalog.restorable_step(session, job)
                job.commands_after = (
                    None if backoff == 0 else func.now() + dt.timedelta(seconds=backoff)
                )
                set_deadline(job, leader.timeouts.recovery_seconds, after=backoff)
                await plan.change_plan(session, job, actions)
                recovering(
                    session,
                    job,
                    kind="job.restarting",
                    again="job.restarting",
                    reason=reason,
                    attributes=incident,
                )
            self.accounts_due.add(job.id)
        if nodes:
            await stop_everywhere(leader, job_id, nodes, "job failed")
            return False
        leader.metrics.recoveries.labels("rank_exit").inc()
        return True

    async def stale_exit(self, job_id: str, exited: models.Event) -> bool:
        """A rank of an older generation ended after the current generation was decided
        with its node reconfiguring in place: nothing is left there to reconfigure, so
        the node starts its ranks afresh. Without this the new generation would wait on a
        rank that is gone (or that finished the run in the old one) until its deadline.
        Recorded as an event; True when a decision was committed."""
        leader = self.leader
        node_id = exited.node_id or ""
        async with leader.store.write() as session:
            job = await locked_job(leader, session, job_id, IN_FLIGHT)
            if job is None or not node_id:
                return False
            row = await plan.command(session, job, node_id)
            # An exit recorded well before the decision was known to it (a new leader
            # reads every exit again); one close to it may have committed unseen by it,
            # and restarting a node that only had to reconfigure costs a fresh start,
            # while waiting on a rank that is gone costs the whole deadline.
            if row is None or exited.time < row.decided_at - UNSEEN_EXIT_WINDOW:
                return False
            if not await plan.restart_node(session, job, node_id):
                return False
            record_event(
                session,
                "job.node_restarted",
                actor="scheduler",
                job_id=job_id,
                node_id=node_id,
                reason=f"{exited.reason} (generation {exited.attributes.get('generation')}) "
                f"after generation {job.generation} was decided: node {node_id} starts its "
                "ranks afresh instead of reconfiguring them",
                attributes={"generation": str(job.generation)},
            )
        return True


RESTART_WINDOW = dt.timedelta(minutes=5)
"""Rank restarts further back than this no longer lengthen the next one's backoff."""


def restart_backoff(recent: int) -> float:
    """Seconds before a rank restart, given how many restarts the job had within
    RESTART_WINDOW: the first at once, then 1, 2, 4 … up to 30 s for a rank that keeps
    failing. A job that fails now and then over weeks restarts at once every time."""
    return 0.0 if recent == 0 else min(2.0 ** (recent - 1), 30.0)


async def _ready_standbys(leader: Leader, job_id: str, nodes: AbstractSet[str]) -> set[str]:
    """Which of `nodes` hold a standby of the job that waits for a rank now; none when
    Redis does not answer (the ranks start afresh, as without standbys)."""
    try:
        return await leader.hot.ready_standbys(job_id, nodes)
    except RedisError:
        return set()


async def _recent_restarts(session: AsyncSession, job_id: str) -> int:
    return int(
        await session.scalar(
            select(func.count())
            .select_from(models.Event)
            .where(models.Event.job_id == job_id)
            .where(models.Event.kind == "job.restarting")
            .where(models.Event.time > func.now() - RESTART_WINDOW)
        )
        or 0
    )


async def _nodes_with_failed_ranks(session: AsyncSession, job: models.Job) -> set[str]:
    """Nodes where a rank of the job's current generation ended other than cleanly."""
    rows = await session.execute(
        select(models.Event.node_id, models.Event.attributes)
        .where(models.Event.job_id == job.id)
        .where(models.Event.kind == "rank.exited")
        .where(models.Event.attributes["generation"].astext == str(job.generation))
    )
    return {
        node_id
        for node_id, attrs in rows.all()
        if node_id and not (attrs.get("exit_code") == "0" and attrs.get("signal") == "0")
    }


def _repair_one(
    topology: Topology,
    placement: Placement,
    node_id: str,
    tp: int,
    pp: int,
    min_dp: int,
    *,
    must: bool,
    prefer: set[str],
    ready: set[str],
) -> tuple[Placement, str] | None:
    if not placement.ranks_on(node_id):
        return None
    spare = choose_replacement(
        topology, topology.node(node_id), len(placement.ranks_on(node_id)), prefer, ready
    )
    if spare is not None:
        moved = replace_node(placement, node_id, spare, topology)
        topology.book(Placement(moved.ranks_on(spare)))
        standby = (
            " (its waiting standby processes take them)"
            if spare in ready
            else " (its standby processes take them)"
            if spare in prefer
            else ""
        )
        return moved, f"ranks moved to spare {spare}{standby}"
    if not must:
        return None  # a draining or slow node waits for a spare
    dp = placement.world_size // (tp * pp)
    if dp > min_dp:
        shrunk = shrink_by_one_replica(placement, node_id, tp, pp)
        if shrunk is not None:
            return shrunk, f"no spare: shrunk to dp={dp - 1}"
    return None
