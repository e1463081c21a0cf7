"""The leader's loop: place pending gangs, start them, follow their steps, and repair
them when a node fails or a rank exits. Level-triggered: every tick looks at the state
in PostgreSQL (and the step streams in Redis), so a new leader simply carries on.

Decisions commit first (checked against the leader lease), commands go out after.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.health.straggler import StragglerDetector, StragglerFinding, StragglerPolicy
from pitstop.scheduler.convert import rank_map_to_pb
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState, NodeState
from pitstop.scheduler.gateway import CommandRouter
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.leader import LeaderElection
from pitstop.scheduler.metrics import SchedulerMetrics
from pitstop.scheduler.placement import (
    GangRequest,
    choose_replacement,
    place_pending,
    replace_node,
    shrink_by_one_replica,
    standby_spares,
)
from pitstop.scheduler.services import catalog, goodput, lifecycle
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.store import Store
from pitstop.scheduler.topology import Placement, Topology
from pitstop.v1 import agent_pb2

log = logging.getLogger(__name__)

FAILED_NODE_STATES = (NodeState.UNHEALTHY, NodeState.LOST)
RUNNABLE = (JobState.STARTING, JobState.RUNNING, JobState.RECOVERING)
GOODPUT_REFRESH_SECONDS = 1.0
RECONFIGURE_TIMEOUT_SECONDS = 30.0
"""An in-place recovery not stepping by then becomes a full restart of every rank."""
STEP_HOLD_SECONDS = 5.0
"""Longest a step sample waits for the job's other ranks before the detector sees it."""
STANDBY_CHECK_SECONDS = 1.0
"""How often the leader checks that running jobs have their standby processes."""


@dataclass
class JobWatch:
    """What the leader remembers about one live job between ticks (rebuilt if lost)."""

    stream_id: str = "0-0"
    detector: StragglerDetector | None = None
    detector_generation: int = 0
    finished: set[int] = field(default_factory=set)
    restart_at: float | None = None
    swap_nodes: set[str] = field(default_factory=set)
    # Samples held back until every rank has reached their step (see release_in_step_order).
    held: list[tuple[float, agent_pb2.StepSample]] = field(default_factory=list)
    rank_max: dict[int, int] = field(default_factory=dict)
    goodput_at: float = 0.0
    # Nodes whose ranks must start afresh at the next restart (a rank there exited).
    restart_nodes: set[str] = field(default_factory=set)
    # When an in-place recovery (Reconfigure) is given up for a full restart; set while
    # one is in flight.
    recover_deadline: float | None = None
    # The nodes that in-flight recovery started ranks on afresh.
    starting_nodes: set[str] = field(default_factory=set)
    # Straggler findings whose events are not committed yet (the detector reports each
    # once: a transaction that fails must not lose one).
    findings: list[StragglerFinding] = field(default_factory=list)

    def release_in_step_order(
        self, fresh: list[agent_pb2.StepSample], world_size: int, now: float, hold: float
    ) -> list[agent_pb2.StepSample]:
        """Node batches arrive at different times, so one node's ranks can be reported far
        ahead of another's. The detector judges a window once it sees later steps, so it
        gets the samples in step order: those at or below the step every one of the
        job's ranks has reached, and any held for ``hold`` seconds (a dead or silent rank
        must not hold the rest back for longer than it takes to notice it)."""
        for sample in fresh:
            self.rank_max[sample.rank] = max(self.rank_max.get(sample.rank, 0), sample.step)
        self.held.extend((now, sample) for sample in fresh)
        everyone = min(self.rank_max.values()) if len(self.rank_max) >= world_size else 0
        overdue = max((s.step for t, s in self.held if t + hold <= now), default=0)
        frontier = max(everyone, overdue)
        ready = sorted((s for _, s in self.held if s.step <= frontier), key=lambda x: x.step)
        self.held = [(t, s) for t, s in self.held if s.step > frontier]
        return ready

    def step_seconds(self) -> float:
        """The job's typical step time: the median of its ranks' medians (0 if unknown)."""
        if self.detector is None:
            return 0.0
        medians = sorted(s.p50_seconds for s in self.detector.stats())
        return medians[len(medians) // 2] if medians else 0.0


class Reconciler:
    def __init__(
        self,
        store: Store,
        hot: HotState,
        router: CommandRouter,
        election: LeaderElection,
        metrics: SchedulerMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.hot = hot
        self.router = router
        self.election = election
        self.metrics = metrics
        self.clock = clock
        self.watches: dict[str, JobWatch] = {}
        self.exit_cursor = 0
        # The standby processes this leader started: job id -> spare node -> its GPUs.
        self.standbys: dict[str, dict[str, tuple[int, ...]]] = {}
        self.standbys_at = 0.0

    async def run(self, tick_seconds: float) -> None:
        """The deciding loop, for as long as this process leads."""
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile tick failed; retrying")
            await asyncio.sleep(tick_seconds)

    async def tick(self) -> None:
        await self.place_pending()
        await self.repair_failed_nodes()
        await self.follow_steps()
        await self.handle_exits()
        await self.restart_due()
        await self.keep_standbys()

    # Placement and start -------------------------------------------------------------

    async def place_pending(self) -> None:
        async with self.store.read() as session:
            pending = await lifecycle.live_jobs(session, (JobState.PENDING,))
            if not pending:
                return
            nodes, booked = await lifecycle.topology_inputs(session)
        topology = Topology.build(nodes, booked)
        requests = []
        for seq, job in enumerate(sorted(pending, key=lambda j: j.created_at)):
            spec = spec_from_json(job.spec)
            requests.append(
                GangRequest(
                    job.id,
                    spec.tp,
                    spec.pp,
                    spec.dp,
                    spec.gpus_per_node,
                    priority=job.priority,
                    sequence=seq,
                )
            )
        for job_id, placement in place_pending(topology, requests).items():
            started = time.perf_counter()
            async with self.store.write() as session:
                await self.election.assert_leader(session)
                row = await session.get(models.Job, job_id, with_for_update=True)
                if row is None or row.state is not JobState.PENDING:
                    continue
                await lifecycle.place(session, row, placement)
            self.metrics.decision_seconds.labels("placement").observe(time.perf_counter() - started)
            await self.start(job_id, reason="placed")

    async def start(self, job_id: str, *, reason: str) -> None:
        """Send StartRanks for the job's current generation to every node in it."""
        async with self.store.write() as session:
            await self.election.assert_leader(session)
            job = await session.get(models.Job, job_id, with_for_update=True)
            if job is None:
                return
            placement = await lifecycle.rank_map(session, job)
            hosts = await _hosts(session, placement)
            if job.state is JobState.PLACED:
                lifecycle.transition(
                    session,
                    job,
                    JobState.STARTING,
                    kind="job.starting",
                    reason=f"starting ranks ({reason})",
                )
            restore = await catalog.restorable_step(session, job)
            command = start_command(job, placement, hosts, restore)
        watch = self.watches.setdefault(job_id, JobWatch())
        watch.finished.clear()
        watch.recover_deadline = None
        for node_id in placement.nodes():
            await self.router.send(node_id, agent_pb2.SchedulerMessage(start_ranks=command))

    async def recover(
        self,
        job_id: str,
        fresh: set[str],
        removed: set[str],
        restore: int | None = None,
        adopting: set[str] | None = None,
    ) -> None:
        """Move the job to its current generation in place: nodes in `fresh` start their
        ranks anew (StartRanks: a spare, or a node whose rank exited), but a spare in
        `adopting` hands them to the job's standby processes waiting there (a Reconfigure
        naming them in adopted_ranks); every other node of the rank map gets a
        Reconfigure, so its ranks keep their processes and their state in memory, roll
        back to the restore step only if ahead, and re-form the group with the new
        ranks; `removed` nodes get it too, and their ranks leave. A recovery not
        stepping within RECONFIGURE_TIMEOUT_SECONDS becomes a full restart. `restore`:
        the step the deciding transaction chose (else chosen here)."""
        async with self.store.write() as session:
            await self.election.assert_leader(session)
            job = await session.get(models.Job, job_id, with_for_update=True)
            if job is None or job.state.terminal:
                return
            placement = await lifecycle.rank_map(session, job)
            hosts = await _hosts(session, placement)
            if restore is None:
                restore = await catalog.restorable_step(session, job)
            start = start_command(job, placement, hosts, restore)
        watch = self.watches.setdefault(job_id, JobWatch())
        if watch.recover_deadline is not None:
            # This supersedes a recovery still in flight. The ranks it started may not
            # have opened their command streams yet, so a Reconfigure would miss them
            # and they would wait in the old generation: start them anew instead.
            fresh = fresh | watch.starting_nodes
        adopting = (adopting or set()) & (fresh - watch.starting_nodes)
        watch.starting_nodes = set(fresh)
        watch.finished.clear()
        watch.recover_deadline = self.clock() + RECONFIGURE_TIMEOUT_SECONDS
        reconfigure = agent_pb2.Reconfigure(
            job_id=job_id,
            generation=start.generation,
            rank_map=start.rank_map,
            rendezvous_address=start.rendezvous_address,
            restore_step=restore,
        )
        # A node left out still gets the Reconfigure: its ranks find themselves absent
        # from the new map and leave cleanly at the step boundary every rank agrees on,
        # so the survivors reach that boundary at once instead of stepping on until the
        # old rank dies (a dead node's agent simply never reads it).
        for node_id in removed - set(placement.nodes()):
            await self.router.send(node_id, agent_pb2.SchedulerMessage(reconfigure=reconfigure))
        standbys = self.standbys.get(job_id, {})
        for node_id in placement.nodes():
            if node_id in adopting:
                standbys.pop(node_id, None)  # taken: the next check starts another
                handed = agent_pb2.Reconfigure()
                handed.CopyFrom(reconfigure)
                handed.adopted_ranks.extend(a.rank for a in placement.ranks_on(node_id))
                message = agent_pb2.SchedulerMessage(reconfigure=handed)
            elif node_id in fresh:
                message = agent_pb2.SchedulerMessage(start_ranks=start)
            else:
                message = agent_pb2.SchedulerMessage(reconfigure=reconfigure)
            await self.router.send(node_id, message)

    # Failures --------------------------------------------------------------------------

    async def repair_failed_nodes(self) -> None:
        async with self.store.read() as session:
            jobs = await lifecycle.live_jobs(session, (*RUNNABLE, JobState.PAUSED))
            if not jobs:
                return
            states = dict((await session.execute(select(models.Node.id, models.Node.state))).all())
            maps = {job.id: await lifecycle.rank_map(session, job) for job in jobs}
        for job in jobs:
            watch = self.watches.setdefault(job.id, JobWatch())
            failed = [
                n
                for n in maps[job.id].nodes()
                if states.get(n) in FAILED_NODE_STATES
                or n in watch.swap_nodes
                or (states.get(n) is NodeState.DRAINING and job.committed_step > 0)
            ]
            if failed:
                await self.replace(job.id, failed, {n: states.get(n) for n in failed})

    async def replace(
        self, job_id: str, failed: list[str], states: dict[str, NodeState | None]
    ) -> None:
        started = time.perf_counter()
        async with self.store.write() as session:
            await self.election.assert_leader(session)
            job = await session.get(models.Job, job_id, with_for_update=True)
            if job is None or job.state.terminal:
                return
            placement = await lifecycle.rank_map(session, job)
            before = set(placement.nodes())
            nodes, booked = await lifecycle.topology_inputs(session)
            topology = Topology.build(nodes, booked)
            spec = spec_from_json(job.spec)
            moves = []
            for node_id in failed:
                new = self._repair_one(
                    topology,
                    placement,
                    node_id,
                    spec.tp,
                    spec.pp,
                    spec.min_dp,
                    must=states.get(node_id) in FAILED_NODE_STATES,
                    prefer=set(self.standbys.get(job_id, {})),
                )
                if new is None:
                    continue
                placement, how = new
                moves.append(f"{node_id} ({(states.get(node_id) or NodeState.READY).value}): {how}")
            if not moves:
                if (
                    states
                    and any(s in FAILED_NODE_STATES for s in states.values())
                    and (job.state is not JobState.RECOVERING)
                ):
                    lifecycle.transition(
                        session,
                        job,
                        JobState.RECOVERING,
                        kind="job.recovering",
                        reason="waiting for capacity: no spare and no shrink left",
                    )
                return
            restore = await catalog.restorable_step(session, job)
            incident = await goodput.node_incident(session, self.hot, job, states, restore)
            await lifecycle.write_generation(session, job, placement)
            target = JobState.RECOVERING
            if job.state is not target:
                lifecycle.transition(
                    session,
                    job,
                    target,
                    kind="job.recovering",
                    reason="; ".join(moves),
                    attributes=incident,
                )
            else:
                record_event(
                    session,
                    "job.reconfigured",
                    actor="scheduler",
                    job_id=job.id,
                    reason="; ".join(moves),
                    attributes={"generation": str(job.generation), **incident},
                )
        self.metrics.decision_seconds.labels("recovery").observe(time.perf_counter() - started)
        self.metrics.recoveries.labels("node").inc()
        watch = self.watches.setdefault(job_id, JobWatch())
        watch.swap_nodes.difference_update(failed)
        # A restart a rank's exit scheduled is superseded by this generation; that
        # rank's node starts its ranks anew (if it is still in the map).
        watch.restart_at = None
        added = set(placement.nodes()) - before
        fresh = added | watch.restart_nodes
        watch.restart_nodes = set()
        adopting = added & set(self.standbys.get(job_id, {}))
        await self.recover(job_id, fresh, set(failed), restore, adopting)

    @staticmethod
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
    ) -> tuple[Placement, str] | None:
        if not placement.ranks_on(node_id):
            return None
        spare = choose_replacement(
            topology, topology.node(node_id), len(placement.ranks_on(node_id)), prefer
        )
        if spare is not None:
            moved = replace_node(placement, node_id, spare, topology)
            topology.book(Placement(moved.ranks_on(spare)))
            standby = " (its standby processes take them)" if spare in prefer else ""
            return moved, f"ranks moved to spare {spare}{standby}"
        if not must:
            return None  # a draining or slow node waits for a spare
        dp = placement.world_size // (tp * pp)
        if dp > min_dp:
            shrunk = shrink_by_one_replica(placement, node_id, tp, pp)
            if shrunk is not None:
                return shrunk, f"no spare: shrunk to dp={dp - 1}"
        return None

    # Steps, exits, restarts ------------------------------------------------------------

    async def follow_steps(self) -> None:
        async with self.store.read() as session:
            jobs = {
                j.id: j for j in await lifecycle.live_jobs(session, (*RUNNABLE, JobState.PAUSED))
            }
        if not jobs:
            return
        cursors = {j: self.watches.setdefault(j, JobWatch()).stream_id for j in jobs}
        samples: dict[str, list[agent_pb2.StepSample]] = {}
        for job_id, entry_id, batch in await self.hot.read_step_batches(cursors):
            self.watches[job_id].stream_id = entry_id
            if batch.generation == jobs[job_id].generation:
                samples.setdefault(job_id, []).extend(batch.samples)
        for job_id, fresh in samples.items():
            newest = max(s.step for s in fresh)
            await self._observe(jobs[job_id], self.watches[job_id], fresh, newest)

    async def _observe(
        self, job: models.Job, watch: JobWatch, samples: list[agent_pb2.StepSample], newest: int
    ) -> None:
        spec = spec_from_json(job.spec)
        if watch.detector is None or watch.detector_generation != job.generation:
            watch.detector = StragglerDetector(StragglerPolicy.from_proto(spec.straggler))
            watch.detector_generation = job.generation
            watch.held, watch.rank_max, watch.findings = [], {}, []
        detector = watch.detector
        async with self.store.write() as session:
            await self.election.assert_leader(session)
            row = await session.get(models.Job, job.id, with_for_update=True)
            if row is None or row.generation != job.generation or row.state.terminal:
                return
            placement = await lifecycle.rank_map(session, row)
            released = watch.release_in_step_order(
                samples, placement.world_size, self.clock(), STEP_HOLD_SECONDS
            )
            watch.findings += detector.observe(released)
            findings = list(watch.findings)
            row.current_step = max(row.current_step, newest)
            changed = False
            if row.state in (JobState.STARTING, JobState.RECOVERING) and watch.restart_at is None:
                kind = "job.running" if row.state is JobState.STARTING else "job.recovered"
                lifecycle.transition(
                    session,
                    row,
                    JobState.RUNNING,
                    kind=kind,
                    reason=f"ranks are stepping (step {newest})",
                )
                watch.recover_deadline = None
                changed = True
            if changed or self.clock() >= watch.goodput_at:
                await session.flush()  # the transition's event counts
                await goodput.refresh(session, row, step_seconds=watch.step_seconds())
                watch.goodput_at = self.clock() + GOODPUT_REFRESH_SECONDS
            for finding in findings:
                record_event(
                    session,
                    "job.straggler" if finding.straggler else "job.straggler_cleared",
                    actor="scheduler",
                    job_id=job.id,
                    reason=finding.reason,
                    attributes={"rank": str(finding.rank), "slowdown": f"{finding.slowdown:.3f}"},
                )
        watch.findings = []  # committed
        stats = [
            s.to_proto(placement.ranks[s.rank].node_id if s.rank < placement.world_size else "")
            for s in detector.stats()
        ]
        await self.hot.redis.set(
            self.hot.rank_stats_key(job.id),
            json.dumps(
                [
                    {
                        "rank": s.rank,
                        "node_id": s.node_id,
                        "p50_seconds": s.p50_seconds,
                        "p99_seconds": s.p99_seconds,
                        "straggler": s.straggler,
                    }
                    for s in stats
                ]
            ),
        )
        if spec.straggler.action == 2:  # STRAGGLER_ACTION_SWAP
            for finding in findings:
                if finding.straggler and finding.rank < placement.world_size:
                    watch.swap_nodes.add(placement.ranks[finding.rank].node_id)

    async def handle_exits(self) -> None:
        async with self.store.read() as session:
            jobs = {j.id: j for j in await lifecycle.live_jobs(session)}
            if not jobs:
                return
            exits = (
                await session.scalars(
                    select(models.Event)
                    .where(models.Event.kind == "rank.exited")
                    .where(models.Event.id > self.exit_cursor)
                    .where(models.Event.job_id.in_(list(jobs)))
                    .order_by(models.Event.id)
                )
            ).all()
            sizes = {
                j: (await lifecycle.rank_map(session, job)).world_size for j, job in jobs.items()
            }
        for event in exits:
            await self._handle_exit(event, jobs, sizes)
            # Only once it is handled: a decision that failed (a lapsed lease, the store
            # gone) is taken again at the next tick, so no job waits for ever on an exit.
            self.exit_cursor = max(self.exit_cursor, event.id)

    async def _handle_exit(
        self, event: models.Event, jobs: dict[str, models.Job], sizes: dict[str, int]
    ) -> None:
        job = jobs.get(event.job_id or "")
        if job is None or int(event.attributes.get("generation", -1)) != job.generation:
            return  # a rank of an older generation, stopped on purpose
        watch = self.watches.setdefault(job.id, JobWatch())
        rank = int(event.attributes.get("rank", -1))
        clean = event.attributes.get("exit_code") == "0" and event.attributes.get("signal") == "0"
        if clean:
            watch.finished.add(rank)
            if len(watch.finished) >= sizes[job.id] and job.state in RUNNABLE:
                # The ranks' last step times were sent before their exits but are
                # read from another stream: take them in first.
                await self.follow_steps()
                await self.finish(job.id, event)
        elif watch.restart_at is None:
            await self.fail_rank(job.id, event)
        elif event.node_id:
            watch.restart_nodes.add(event.node_id)  # failed too: it restarts as well

    async def finish(self, job_id: str, event: models.Event) -> None:
        async with self.store.write() as session:
            await self.election.assert_leader(session)
            job = await session.get(models.Job, job_id, with_for_update=True)
            # Also from STARTING or RECOVERING: ranks that restored the last step (or
            # had little left) may all finish before reporting a step.
            if job is None or job.state not in RUNNABLE:
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
            await session.flush()
            watch = self.watches.get(job_id)
            step_seconds = watch.step_seconds() if watch is not None else 0.0
            await goodput.refresh(session, job, step_seconds=step_seconds)
            await lifecycle.release_gpus(session, job.id)
        self.watches.pop(job_id, None)

    async def fail_rank(self, job_id: str, event: models.Event) -> None:
        """A rank of the current generation failed: restart in place (after a backoff) while
        restarts remain, else the job fails."""
        async with self.store.write() as session:
            await self.election.assert_leader(session)
            job = await session.get(models.Job, job_id, with_for_update=True)
            if job is None or job.state.terminal:
                return
            spec = spec_from_json(job.spec)
            if job.restarts >= spec.max_restarts:
                lifecycle.transition(
                    session,
                    job,
                    JobState.FAILED,
                    kind="job.failed",
                    reason=f"{event.reason}; restarts exhausted ({job.restarts})",
                )
                await lifecycle.release_gpus(session, job.id)
                placement = await lifecycle.rank_map(session, job)
                failed = True
            else:
                job.restarts += 1
                # The first restart goes at once; a rank that keeps failing backs off.
                backoff = 0.0 if job.restarts == 1 else min(2.0 ** (job.restarts - 2), 30.0)
                reason = (
                    f"{event.reason}; restart {job.restarts} of {spec.max_restarts} "
                    f"in {backoff:.0f}s"
                )
                incident = goodput.rank_incident(job, event)
                if job.state is JobState.RECOVERING:
                    record_event(
                        session,
                        "job.restarting",
                        actor="scheduler",
                        job_id=job.id,
                        reason=reason,
                        attributes=incident,
                    )
                else:
                    lifecycle.transition(
                        session,
                        job,
                        JobState.RECOVERING,
                        kind="job.restarting",
                        reason=reason,
                        attributes=incident,
                    )
                watch = self.watches.setdefault(job_id, JobWatch())
                watch.restart_at = self.clock() + backoff
                if event.node_id:
                    watch.restart_nodes.add(event.node_id)
                self.metrics.recoveries.labels("rank_exit").inc()
                failed = False
        if failed:
            stop = agent_pb2.StopRanks(job_id=job_id, grace_seconds=10, reason="job failed")
            for node_id in placement.nodes():
                await self.router.send(node_id, agent_pb2.SchedulerMessage(stop_ranks=stop))
            self.watches.pop(job_id, None)

    async def restart_due(self) -> None:
        now = self.clock()
        for job_id, watch in list(self.watches.items()):
            if watch.recover_deadline is not None and watch.recover_deadline <= now:
                await self._restart(job_id, watch, full=True)
            elif watch.restart_at is not None and watch.restart_at <= now:
                await self._restart(job_id, watch, full=False)

    async def _restart(self, job_id: str, watch: JobWatch, *, full: bool) -> None:
        """Same places, a new generation. After a rank's exit, its node starts its ranks
        anew and the others reconfigure in place; `full` (an in-place recovery that did
        not get the job stepping in time) restarts every rank from the restore step."""
        async with self.store.write() as session:
            await self.election.assert_leader(session)
            job = await session.get(models.Job, job_id, with_for_update=True)
            if job is None or job.state is not JobState.RECOVERING:
                watch.restart_at = watch.recover_deadline = None
                return
            await lifecycle.write_generation(session, job, await lifecycle.rank_map(session, job))
            if full:
                record_event(
                    session,
                    "job.restarting",
                    actor="scheduler",
                    job_id=job.id,
                    reason=f"the in-place recovery did not resume within "
                    f"{RECONFIGURE_TIMEOUT_SECONDS:.0f}s: restarting every rank",
                    attributes={"generation": str(job.generation)},
                )
        watch.restart_at = watch.recover_deadline = None
        fresh, watch.restart_nodes = watch.restart_nodes, set()
        if full:
            await self.start(job_id, reason="full restart")
        else:
            await self.recover(job_id, fresh, set())

    # Standby processes -------------------------------------------------------------------

    async def keep_standbys(self) -> None:
        """Every RUNNING job with standby_processes has a standby process on each GPU of
        the spares its nodes would be replaced by (`standby_spares`, as many spares as it
        asks for); those of jobs that ended, and on spares no longer chosen, stop. Once a
        second at most; a job recovering or paused keeps what it has."""
        now = self.clock()
        if now < self.standbys_at:
            return
        self.standbys_at = now + STANDBY_CHECK_SECONDS
        async with self.store.read() as session:
            live = {j.id: j for j in await lifecycle.live_jobs(session)}
            specs = {j.id: spec_from_json(j.spec) for j in live.values()}
            wanting = [
                j
                for j in live.values()
                if j.state is JobState.RUNNING
                and specs[j.id].standby_processes
                and specs[j.id].spares > 0
            ]
            if not wanting and not self.standbys:
                return
            nodes, booked = await lifecycle.topology_inputs(session)
            maps = {j.id: await lifecycle.rank_map(session, j) for j in wanting}
        topology = Topology.build(nodes, booked)
        for job_id in [j for j in self.standbys if j not in live]:
            await self._stop_standbys(job_id, set(self.standbys.pop(job_id)), "the job ended")
        for job in wanting:
            spec = specs[job.id]
            # A standby already importing or waiting stays where it is while its spare
            # still qualifies: moving it for a slightly nearer spare costs a fresh import.
            ranked = standby_spares(topology, maps[job.id], len(topology.ready_spares()))
            held = self.standbys.setdefault(job.id, {})
            for node_id in [n for n in held if n in maps[job.id].nodes()]:
                del held[node_id]  # its GPUs run the job's ranks now: no standby is left
            kept = [n for n in ranked if n in held][: spec.spares]
            kept += [n for n in ranked if n not in held][: spec.spares - len(kept)]
            wanted = {n: ranked[n] for n in kept}
            gone = {n for n in held if n not in wanted}
            await self._stop_standbys(job.id, gone, "the spare is no longer held for the job")
            for node_id in gone:
                del held[node_id]
            for node_id, gpus in wanted.items():
                if held.get(node_id) == gpus:
                    continue
                command = agent_pb2.StartRanks(
                    job_id=job.id,
                    generation=job.generation,
                    command=list(spec.command),
                    env=dict(spec.env),
                    working_dir=spec.working_dir,
                    standby_gpus=gpus,
                )
                sent = await self.router.send(
                    node_id, agent_pb2.SchedulerMessage(start_ranks=command)
                )
                if sent is not None:  # else Redis is down too: the next check sends again
                    held[node_id] = gpus

    async def _stop_standbys(self, job_id: str, nodes: set[str], why: str) -> None:
        stop = agent_pb2.StopRanks(job_id=job_id, grace_seconds=5, reason=f"standby: {why}")
        for node_id in sorted(nodes):
            await self.router.send(node_id, agent_pb2.SchedulerMessage(stop_ranks=stop))


async def _hosts(session: AsyncSession, placement: Placement) -> dict[str, str]:
    """Host names of the placement's nodes, by node id."""
    rows = await session.execute(
        select(models.Node.id, models.Node.hostname).where(models.Node.id.in_(placement.nodes()))
    )
    return {node_id: hostname for node_id, hostname in rows.all()}


def start_command(
    job: models.Job, placement: Placement, hosts: dict[str, str], restore_step: int
) -> agent_pb2.StartRanks:
    """StartRanks for the job's current generation. The rendezvous is rank 0's host on a
    port derived from the job and generation, so a new generation never meets the old."""
    spec = spec_from_json(job.spec)
    rank0 = placement.ranks[0].node_id
    port = 20000 + (zlib.crc32(job.id.encode()) + job.generation) % 20000
    return agent_pb2.StartRanks(
        job_id=job.id,
        generation=job.generation,
        command=list(spec.command),
        env=dict(spec.env),
        working_dir=spec.working_dir,
        rank_map=rank_map_to_pb(job.generation, placement.ranks),
        rendezvous_address=f"{hosts.get(rank0) or rank0}:{port}",
        restore_step=restore_step,
    )
