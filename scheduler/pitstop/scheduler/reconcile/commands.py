"""The command fan-out: every node command a decision committed goes out, and goes out
again each tick until the node's agent acknowledges it. Whichever process leads sends
what is due, so a decision whose sender died (a refused check, a database error, kill
-9 between commit and send) is carried out by the next tick or the next leader."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.convert import node_rank_map, skipped_steps
from pitstop.scheduler.db import models
from pitstop.scheduler.jobspec import (
    DEFAULT_LOSS_WINDOW,
    DEFAULT_MAX_ROLLBACKS,
    DEFAULT_SPIKE_SIGMA,
)
from pitstop.scheduler.reconcile.context import Leader
from pitstop.scheduler.services import node_commands as plan
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.services.node_commands import DueCommand, NodeAction
from pitstop.scheduler.topology import Placement
from pitstop.v1 import agent_pb2, common_pb2, jobs_pb2

log = logging.getLogger(__name__)


async def send_due(leader: Leader, job_ids: set[str] | None = None) -> int:
    """Send every due command (of `job_ids`, or of every job); returns how many went."""
    async with leader.store.write() as session:
        due = await plan.claim_due(session, job_ids)
        if not due:
            return 0
        jobs = {c.job_id for c in due}
        messages = {job_id: await _job_messages(leader, session, job_id) for job_id in jobs}
    out: list[tuple[str, agent_pb2.SchedulerMessage]] = []
    for command in due:
        build = messages[command.job_id]
        if build is None or build.generation != command.generation:
            continue  # the job moved on since: its new commands are claimed next tick
        if command.sends > 1:
            log.info(
                "job %s generation %d: sending %s to node %s again (attempt %d)",
                command.job_id,
                command.generation,
                command.action.value,
                command.node_id,
                command.sends,
            )
            leader.metrics.command_resends.labels(command.action.value).inc()
        out.append((command.node_id, build.message(command)))
    await leader.router.send_many(out)
    return len(due)


class JobMessages:
    """Builds each node's message for one generation of a job: its own ranks, the job's
    sizes and the whole map's digest (convert.node_rank_map), so a message's size and
    the time to build it do not grow with the job. A node that keeps its ranks from the
    previous generation (`previous`: that map, when at hand) gets, on a first send, the
    one message every such node gets (`reconfigure_kept`, no ranks), built once; a
    re-send is the node's own full Reconfigure (its agent may not know the kept kind)."""

    def __init__(
        self,
        start: agent_pb2.StartRanks,
        placement: Placement,
        skipped: Sequence[int] = (),
        previous: Placement | None = None,
    ) -> None:
        self.start = start  # everything but the rank map
        self.placement = placement
        self.previous = previous
        self.skipped_steps = list(skipped)
        self.generation = start.generation
        self._kept: agent_pb2.SchedulerMessage | None = None

    def message(self, command: DueCommand) -> agent_pb2.SchedulerMessage:
        start, node_id = self.start, command.node_id
        if command.action is NodeAction.RECONFIGURE and command.sends == 1 and self.keeps(node_id):
            return self.kept()
        rank_map = node_rank_map(self.generation, self.placement, node_id)
        if command.action is NodeAction.START:
            mine = agent_pb2.StartRanks()
            mine.CopyFrom(start)
            mine.rank_map.CopyFrom(rank_map)
            return agent_pb2.SchedulerMessage(start_ranks=mine)
        reconfigure = agent_pb2.Reconfigure(
            job_id=start.job_id,
            generation=start.generation,
            rank_map=rank_map,
            rendezvous_address=start.rendezvous_address,
            restore_step=start.restore_step,
            step_windows=start.step_windows,
            skipped_steps=self.skipped_steps,
        )
        if command.action is NodeAction.ADOPT:
            reconfigure.adopted_ranks.extend(a.rank for a in self.placement.ranks_on(node_id))
        return agent_pb2.SchedulerMessage(reconfigure=reconfigure)

    def keeps(self, node_id: str) -> bool:
        """Whether the node runs the same ranks, on the same GPUs, as in the previous
        generation (known only with that map at hand)."""
        previous = self.previous
        return previous is not None and previous.ranks_on(node_id) == self.placement.ranks_on(
            node_id
        )

    def kept(self) -> agent_pb2.SchedulerMessage:
        """The message for every node that keeps its ranks: the same object each time,
        so the fan-out serializes it once."""
        if self._kept is None:
            start = self.start
            dp, pp, tp = self.placement.shape
            rank_map = common_pb2.RankMap(
                generation=self.generation,
                world_size=self.placement.world_size,
                dp_size=dp,
                pp_size=pp,
                tp_size=tp,
                node_local=True,
                digest=self.placement.digest,
            )
            self._kept = agent_pb2.SchedulerMessage(
                reconfigure_kept=agent_pb2.Reconfigure(
                    job_id=start.job_id,
                    generation=start.generation,
                    rank_map=rank_map,
                    rendezvous_address=start.rendezvous_address,
                    restore_step=start.restore_step,
                    step_windows=start.step_windows,
                    skipped_steps=self.skipped_steps,
                )
            )
        return self._kept


async def _job_messages(leader: Leader, session: AsyncSession, job_id: str) -> JobMessages | None:
    job = await session.get(models.Job, job_id)
    if job is None or job.state.terminal:
        return None
    placement = await leader.rank_maps.of(session, job)
    hosts = await node_hosts(session, placement.nodes()[:1])
    start = start_command(job, placement, hosts, job.restore_step)
    previous = leader.rank_maps.cached(job.id, job.generation - 1)
    return JobMessages(start, placement, skipped_steps(job), previous)


async def node_hosts(session: AsyncSession, node_ids: Sequence[str]) -> dict[str, str]:
    """Host names of the nodes, by node id."""
    rows = await session.execute(
        select(models.Node.id, models.Node.hostname).where(models.Node.id.in_(node_ids))
    )
    return {node_id: hostname for node_id, hostname in rows.all()}


RENDEZVOUS_PORT_BASE, RENDEZVOUS_PORTS = 20000, 12000
"""Rendezvous ports: 20000-31999, below Linux's ephemeral range (32768-60999), so an
outgoing connection of the node never holds the port rank 0 must listen on (it did
under load: EADDRINUSE, and a restart)."""


def rendezvous_port(job_id: str, generation: int) -> int:
    """The port rank 0 serves generation `generation`'s store on: the next generation's
    is the next port, so a new group never meets the old one's store."""
    return RENDEZVOUS_PORT_BASE + (zlib.crc32(job_id.encode()) + generation) % RENDEZVOUS_PORTS


def start_command(
    job: models.Job, placement: Placement, hosts: dict[str, str], restore_step: int
) -> agent_pb2.StartRanks:
    """StartRanks for the job's current generation, without its rank map (each node's
    share goes in its own message). The rendezvous is rank 0's host on a port derived
    from the job and generation, so a new generation never meets the old."""
    spec = spec_from_json(job.spec)
    rank0 = placement.ranks[0].node_id
    port = rendezvous_port(job.id, job.generation)
    windows = agent_pb2.StepWindows(window_steps=spec.straggler.window_steps)
    if spec.straggler.HasField("warmup_steps"):
        windows.warmup_steps = spec.straggler.warmup_steps
    return agent_pb2.StartRanks(
        job_id=job.id,
        generation=job.generation,
        command=list(spec.command),
        env={**dict(spec.env), **rank_policy_env(spec, skipped_steps(job))},
        working_dir=spec.working_dir,
        rendezvous_address=f"{hosts.get(rank0) or rank0}:{port}",
        restore_step=restore_step,
        step_windows=windows,
        preload_modules=list(spec.preload_modules),
    )


def rank_policy_env(spec: jobs_pb2.JobSpec, skipped: Sequence[int]) -> dict[str, str]:
    """What pitstop.trainer reads of the job's spec (its snapshot interval, its
    integrity policy, defaults filled in by validation) and of its record (the steps
    whose batch it skips)."""
    policy = spec.integrity
    env = {
        "PITSTOP_SNAPSHOT_EVERY": str(spec.checkpoint.snapshot_every_steps or 1),
        "PITSTOP_SDC_CHECK": "0" if policy.sdc_check_disabled else "1",
        "PITSTOP_SPIKE_WATCH": "0" if policy.spike_watch_disabled else "1",
        "PITSTOP_LOSS_WINDOW": str(policy.loss_window or DEFAULT_LOSS_WINDOW),
        "PITSTOP_SPIKE_SIGMA": repr(policy.spike_sigma or DEFAULT_SPIKE_SIGMA),
        "PITSTOP_MAX_ROLLBACKS": str(policy.max_rollbacks or DEFAULT_MAX_ROLLBACKS),
    }
    if skipped:
        env["PITSTOP_SKIP_STEPS"] = ",".join(str(step) for step in sorted(skipped))
    return env


async def stop_everywhere(leader: Leader, job_id: str, nodes: list[str], reason: str) -> None:
    """StopRanks to each node (a job that ended; best effort: an agent also stops what
    it runs of an ended job when it next reports it)."""
    stop = agent_pb2.SchedulerMessage(
        stop_ranks=agent_pb2.StopRanks(job_id=job_id, grace_seconds=10, reason=reason)
    )
    await leader.router.send_many([(node_id, stop) for node_id in nodes])
