"""Hangs: a running job whose ranks are alive but make no step.

Every pass of the following loop, a RUNNING job whose newest step has not moved for its
hang threshold (max(spec.integrity.hang_floor_seconds, hang_step_multiple x its median
step time)) hangs: a job.hang event (its id is the incident's), and every node of the
job is asked for its ranks' Python stacks (DumpStacks; the agents answer with a
RankStacks per rank, stored by whichever process holds their stream). Once every rank's
stacks are in, or STACKS_WAIT_SECONDS after asking, the ranks that are not where the
others wait (pitstop.health.hang) are named (job.hang_located) and killed: their exits
are rank failures, recovered as any other (the standby beside them, or a fresh process,
and every other rank reconfigured from the committed step). Naming nobody, every rank
of the job is killed: the job restarts from its committed step. The kill is confirmed by
the killed ranks' exits; a rank whose node reports none within KILL_EXIT_WAIT_SECONDS
(the process gone with no exit on record, or an agent that never got the stop) is
recorded as killed by the scheduler itself, so the job restarts instead of waiting for
an exit that will not come.

What this remembers is telemetry: a new leader that finds the job still hung declares
it again (a second incident, its own stacks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import select

from pitstop.health.hang import locate
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.hotstate import host_signals
from pitstop.scheduler.jobspec import DEFAULT_HANG_FLOOR_SECONDS, DEFAULT_HANG_STEP_MULTIPLE
from pitstop.scheduler.reconcile.context import Leader, locked_job
from pitstop.scheduler.reconcile.steps import StepFollower
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.services.rank_exits import record_exit
from pitstop.v1 import agent_pb2, jobs_pb2

log = logging.getLogger(__name__)

STACKS_WAIT_SECONDS = 20.0
"""How long the stacks of a hung job's ranks are waited for before the ranks that
answered are judged (py-spy takes well under a second a process)."""

KILL_EXIT_WAIT_SECONDS = 30.0
"""How long the exits of ranks killed as hung are waited for before the scheduler records
them itself: well past an agent's kill (immediate) and its next Register's replay of
the exits a broken stream lost (a reconnect and a heartbeat or two)."""


@dataclass
class Incident:
    """A hang declared and not yet acted on."""

    job_id: str
    generation: int
    world_size: int
    asked_at: float  # the leader's clock
    nodes: dict[int, str]  # rank -> node


@dataclass
class Kill:
    """Ranks killed as hung, their exits not yet seen."""

    job_id: str
    generation: int
    ranks: dict[int, str]  # rank -> node
    sent_at: float  # the leader's clock


def threshold(policy: jobs_pb2.IntegrityPolicy, step_seconds: float) -> float:
    """The job's hang threshold, seconds (a spec stored before the policy had the fields
    takes the defaults)."""
    floor = policy.hang_floor_seconds or DEFAULT_HANG_FLOOR_SECONDS
    multiple = policy.hang_step_multiple or DEFAULT_HANG_STEP_MULTIPLE
    return max(floor, multiple * step_seconds)


class HangWatch:
    def __init__(self, leader: Leader, steps: StepFollower) -> None:
        self.leader = leader
        self.steps = steps
        self.open: dict[int, Incident] = {}  # incident (job.hang event id) -> what is known
        self.killing: dict[int, Kill] = {}  # incident -> the ranks its verdict killed
        self.declared: set[tuple[str, int, int]] = set()  # (job, generation, step)
        # When each live job was last seen not RUNNING (paused, recovering): silence is
        # measured from then at the earliest, so a job resumed after a long pause is not
        # taken for hung before its first step.
        self.held_at: dict[str, float] = {}

    async def check(self) -> None:
        """Declare the hangs found; act on the incidents whose stacks are in."""
        await self._declare()
        for incident_id in sorted(self.open):
            await self._settle(incident_id)
        for incident_id in sorted(self.killing):
            await self._confirm(incident_id)

    async def _declare(self) -> None:
        """Over the live jobs the step follower just read (no read of its own)."""
        now, live = self.leader.clock(), self.steps.jobs
        self.held_at = {job_id: at for job_id, at in self.held_at.items() if job_id in live}
        self.declared = {key for key in self.declared if key[0] in live}
        jobs = []
        for job in live.values():
            # A job held through a mass loss is not hung: its peers are away.
            if job.state is JobState.RUNNING and job.held_since is None:
                jobs.append(job)
            else:
                self.held_at[job.id] = now
        for job in jobs:
            watch = self.steps.watches.get(job.id)
            if watch is None or watch.detector_generation != job.generation:
                continue
            if watch.progressed_at is None:
                continue  # no step seen in this generation yet: starting, not hanging
            spec = spec_from_json(job.spec)
            limit = threshold(spec.integrity, watch.step_seconds())
            silent = now - max(watch.progressed_at, self.held_at.get(job.id, watch.progressed_at))
            key = (job.id, job.generation, watch.newest_seen)
            if silent < limit or key in self.declared:
                continue
            self.declared.add(key)
            await self._ask(job.id, job.generation, watch.newest_seen, silent, limit)

    async def _ask(
        self, job_id: str, generation: int, step: int, silent: float, limit: float
    ) -> None:
        leader = self.leader
        async with leader.store.write() as session:
            job = await locked_job(leader, session, job_id, (JobState.RUNNING,))
            if job is None or job.generation != generation:
                return
            placement = await leader.rank_maps.of(session, job)
            event = record_event(
                session,
                "job.hang",
                actor="scheduler",
                job_id=job_id,
                reason=(
                    f"no step for {silent:.1f} s after step {step} (hang threshold "
                    f"{limit:.1f} s): taking every rank's stacks"
                ),
                attributes={
                    "generation": str(generation),
                    "step": str(step),
                    "threshold_seconds": f"{limit:.3f}",
                    "silent_seconds": f"{silent:.3f}",
                },
            )
            await session.flush()
            incident_id = int(event.id)
        ranks = {slot.rank: slot.node_id for slot in placement.ranks}
        nodes = sorted(set(ranks.values()))
        self.open[incident_id] = Incident(
            job_id, generation, placement.world_size, leader.clock(), ranks
        )
        log.warning(
            "job %s hangs after step %d: asking %d nodes for stacks", job_id, step, len(nodes)
        )
        ask = agent_pb2.SchedulerMessage(
            dump_stacks=agent_pb2.DumpStacks(
                job_id=job_id, generation=generation, incident=incident_id
            )
        )
        for node_id in nodes:
            await leader.router.send(node_id, ask)

    async def _settle(self, incident_id: int) -> None:
        leader, incident = self.leader, self.open[incident_id]
        async with leader.store.read() as session:
            rows = (
                await session.scalars(
                    select(models.RankStack)
                    .where(models.RankStack.job_id == incident.job_id)
                    .where(models.RankStack.incident == incident_id)
                )
            ).all()
            job = await session.get(models.Job, incident.job_id)
        moved_on = (
            job is None
            or job.state is not JobState.RUNNING
            or job.generation != incident.generation
        )
        waited = leader.clock() - incident.asked_at >= STACKS_WAIT_SECONDS
        if not moved_on and len({r.rank for r in rows}) < incident.world_size and not waited:
            return
        del self.open[incident_id]
        if moved_on:
            return  # recovered, paused or ended meanwhile: nothing to kill
        verdict = locate({r.rank: r.text for r in rows})
        named = list(verdict.ranks) or sorted(incident.nodes)
        # What the hung ranks' hosts report (a flapping link, an OOM): the likely cause.
        why = await host_signals(leader.hot, [incident.nodes[rank] for rank in named])
        async with leader.store.write() as session:
            job = await locked_job(leader, session, incident.job_id, (JobState.RUNNING,))
            if job is None or job.generation != incident.generation:
                return
            record_event(
                session,
                "job.hang_located" if verdict.ranks else "job.hang_unlocated",
                actor="scheduler",
                job_id=incident.job_id,
                reason=(
                    f"{verdict.reason}: replacing ranks {named}"
                    if verdict.ranks
                    else f"{verdict.reason}: restarting every rank"
                )
                + (f"; {why}" if why else ""),
                attributes={
                    "incident": str(incident_id),
                    "ranks": ",".join(str(r) for r in named),
                    "stacks": str(len(rows)),
                },
            )
        by_node: dict[str, list[int]] = {}
        for rank in named:
            by_node.setdefault(incident.nodes[rank], []).append(rank)
        for node_id, ranks in sorted(by_node.items()):
            await leader.router.send(
                node_id,
                agent_pb2.SchedulerMessage(
                    stop_ranks=agent_pb2.StopRanks(
                        job_id=incident.job_id,
                        ranks=ranks,
                        kill=True,
                        reason=f"hung (incident {incident_id}): {verdict.reason}",
                    )
                ),
            )
        killed = {rank: incident.nodes[rank] for rank in named}
        self.killing[incident_id] = Kill(
            incident.job_id, incident.generation, killed, leader.clock()
        )

    async def _confirm(self, incident_id: int) -> None:
        """Once KILL_EXIT_WAIT_SECONDS passed: each killed rank with no exit on record in
        the job's generation, still running, is recorded as killed (signal 9, by the
        scheduler); the exit follower restarts it as any failed rank. A late exit from
        its agent is then the same exit, recorded once."""
        leader, kill = self.leader, self.killing[incident_id]
        if leader.clock() - kill.sent_at < KILL_EXIT_WAIT_SECONDS:
            return
        del self.killing[incident_id]
        attrs = models.Event.attributes
        async with leader.store.write() as session:
            job = await locked_job(leader, session, kill.job_id, (JobState.RUNNING,))
            if job is None or job.generation != kill.generation:
                return  # the exits came (or something else) and the job moved on
            if job.held_since is not None:  # a partition's exits wait for its end
                self.killing[incident_id] = kill
                return
            exited = set(
                await session.scalars(
                    select(attrs["rank"].astext)
                    .where(models.Event.job_id == kill.job_id)
                    .where(models.Event.kind == "rank.exited")
                    .where(attrs["generation"].astext == str(kill.generation))
                )
            )
            missing = sorted(rank for rank in kill.ranks if str(rank) not in exited)
            for rank in missing:
                record_exit(
                    session,
                    kill.ranks[rank],
                    agent_pb2.RankExited(
                        job_id=kill.job_id,
                        generation=kill.generation,
                        rank=rank,
                        signal=9,
                        cause=(
                            f"killed as hung (incident {incident_id}); its node reported "
                            f"no exit within {KILL_EXIT_WAIT_SECONDS:g} s"
                        ),
                    ),
                    actor="scheduler",
                )
        if missing:
            log.warning(
                "job %s: no exit from ranks %s killed as hung %g s ago: recorded as killed",
                kill.job_id,
                missing,
                KILL_EXIT_WAIT_SECONDS,
            )
