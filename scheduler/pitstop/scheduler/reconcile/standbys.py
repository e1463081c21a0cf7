"""Standby processes: every RUNNING job that asks for them has one on each GPU of the
spares its nodes would be replaced by, and one beside its ranks on each of its own nodes
(a rank that dies, killed or by an application Xid, is taken over in place by it rather
than started afresh). Kept once a second; what this leader started is remembered here,
and a new leader simply starts them again (an agent starts a standby only on a GPU
that has none)."""

from __future__ import annotations

import math

from redis.exceptions import RedisError

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import JobState
from pitstop.scheduler.placement import standby_spares
from pitstop.scheduler.reconcile.context import Leader
from pitstop.scheduler.services import lifecycle
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.topology import Placement, Topology
from pitstop.v1 import agent_pb2, jobs_pb2

STANDBY_CHECK_SECONDS = 1.0
"""How often the leader checks that running jobs have their standby processes."""
BESIDE_IMPORT_SECONDS = 60.0
"""How long the next node waits for a standby beside the job's ranks that is importing
(started, not yet waiting) before its own is started regardless."""
STANDBY_RESEND_SECONDS = 5.0
"""How often a standby's start goes out again (an agent starts one only on a GPU that
has none, so a start that was lost, or a standby that died, is made good)."""


class StandbyKeeper:
    def __init__(self, leader: Leader, standby_nodes: dict[str, set[str]]) -> None:
        self.leader = leader
        # job id -> spare node -> its GPUs running the job's standby processes.
        self.held: dict[str, dict[str, tuple[int, ...]]] = {}
        # Shared with the recovery decisions, which prefer a spare holding a standby.
        self.standby_nodes = standby_nodes
        self.check_at = 0.0
        self.sent_at: dict[tuple[str, str], float] = {}
        # job id -> its nodes told to keep a standby beside its ranks, with when the
        # current import began (-inf: none, the standby waits) and when last told.
        self.beside: dict[str, dict[str, tuple[float, float]]] = {}

    async def keep(self) -> None:
        """Every RUNNING job with standby_processes has a standby process on each GPU of
        the spares its nodes would be replaced by (`standby_spares`, as many spares as it
        asks for); those of jobs that ended, and on spares no longer chosen, stop. Once a
        second at most; a job recovering or paused keeps what it has."""
        leader = self.leader
        now = leader.clock()
        if now < self.check_at:
            return
        self.check_at = now + STANDBY_CHECK_SECONDS
        async with leader.store.read() as session:
            live = {j.id: j for j in await lifecycle.live_jobs(session)}
            specs = {j.id: spec_from_json(j.spec) for j in live.values()}
            wanting = [
                j
                for j in live.values()
                if j.state is JobState.RUNNING and specs[j.id].standby_processes
            ]
            if not wanting and not self.held:
                return
            nodes, booked = await lifecycle.topology_inputs(session)
            maps = {j.id: await self.leader.rank_maps.of(session, j) for j in wanting}
        topology = Topology.build(nodes, booked)
        for job_id in [j for j in self.held if j not in live]:
            await self._stop(job_id, set(self.held.pop(job_id)), "the job ended")
            self.standby_nodes.pop(job_id, None)
            self.sent_at = {k: v for k, v in self.sent_at.items() if k[0] != job_id}
        for job_id in [j for j in self.beside if j not in live]:
            del self.beside[job_id]  # the job's end stopped them with its ranks
        for job in wanting:
            await self._keep_beside(job, specs[job.id], maps[job.id], now)
        for job in wanting:
            spec = specs[job.id]
            # A standby already importing or waiting stays where it is while its spare
            # still qualifies: moving it for a slightly nearer spare costs a fresh import.
            ranked = standby_spares(topology, maps[job.id], len(topology.ready_spares()))
            held = self.held.setdefault(job.id, {})
            preferred = self.standby_nodes.setdefault(job.id, set())
            for node_id in [n for n in held if maps[job.id].hosts(n) or n not in preferred]:
                # Its GPUs run the job's ranks now (or a recovery took it): none is left.
                del held[node_id]
            kept = [n for n in ranked if n in held][: spec.spares]
            kept += [n for n in ranked if n not in held][: spec.spares - len(kept)]
            wanted = {n: ranked[n] for n in kept}
            gone = {n for n in held if n not in wanted}
            await self._stop(job.id, gone, "the spare is no longer held for the job")
            for node_id in gone:
                del held[node_id]
                preferred.discard(node_id)
            for node_id, gpus in wanted.items():
                sent = self.sent_at.get((job.id, node_id), 0.0)
                if held.get(node_id) == gpus and now < sent + STANDBY_RESEND_SECONDS:
                    continue
                if await self._start(job, spec, node_id, gpus):
                    held[node_id] = gpus
                    preferred.add(node_id)
                    self.sent_at[(job.id, node_id)] = now

    async def _keep_beside(
        self, job: models.Job, spec: jobs_pb2.JobSpec, placement: Placement, now: float
    ) -> None:
        """A standby beside the job's ranks on each of its nodes (on the GPU of the
        node's first rank: it touches none before it takes over a rank, and may take one
        on any GPU of the node), started one node at a time; a node that left the job
        has its one stopped."""
        told = self.beside.setdefault(job.id, {})  # node -> (first told, last told)
        held = self.held.get(job.id, {})
        for node_id in [n for n in told if not placement.hosts(n)]:
            del told[node_id]
            if node_id not in held:  # nothing else of the job runs there now
                await self._stop(job.id, {node_id}, "the node left the job")
        try:  # a node whose standby waits needs no reminder: the fleet's steady state
            waiting = await self.leader.hot.ready_standbys(job.id, placement.nodes())
        except RedisError:
            waiting = set()
        for node_id in waiting & told.keys():
            # Imported: the next standby there (after a takeover) is a new import.
            told[node_id] = (-math.inf, told[node_id][1])
        # One at a time: each imports torch beside the job's own ranks, and a job's
        # nodes all starting theirs at once slowed its first steps on a small machine.
        importing = [
            n
            for n, (first, _) in told.items()
            if n not in waiting and now < first + BESIDE_IMPORT_SECONDS
        ]
        for node_id in placement.nodes():
            if node_id in waiting or (importing and node_id not in importing):
                continue
            first, last = told.get(node_id, (-math.inf, -math.inf))
            if now < last + STANDBY_RESEND_SECONDS:
                continue
            if now >= first + BESIDE_IMPORT_SECONDS:
                first = now  # a new import begins
            gpus = (placement.ranks_on(node_id)[0].gpu_index,)
            if await self._start(job, spec, node_id, gpus, beside_ranks=True):
                told[node_id] = (first, now)
                if node_id not in importing:
                    importing.append(node_id)

    async def _start(
        self,
        job: models.Job,
        spec: jobs_pb2.JobSpec,
        node_id: str,
        gpus: tuple[int, ...],
        *,
        beside_ranks: bool = False,
    ) -> bool:
        """Tell `node_id` to keep a standby of the job on each of `gpus`; False when it
        could not be routed (Redis is down too: the next check sends again)."""
        command = agent_pb2.StartRanks(
            job_id=job.id,
            generation=job.generation,
            command=list(spec.command),
            env=dict(spec.env),
            working_dir=spec.working_dir,
            standby_gpus=gpus,
            beside_ranks=beside_ranks,
            preload_modules=list(spec.preload_modules),
        )
        routed = await self.leader.router.send(
            node_id, agent_pb2.SchedulerMessage(start_ranks=command)
        )
        return routed is not None

    async def _stop(self, job_id: str, nodes: set[str], why: str) -> None:
        stop = agent_pb2.StopRanks(job_id=job_id, grace_seconds=5, reason=f"standby: {why}")
        for node_id in sorted(nodes):
            await self.leader.router.send(node_id, agent_pb2.SchedulerMessage(stop_ranks=stop))
