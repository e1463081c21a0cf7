"""Placing pending gangs: one transaction places a job and decides its start (the
generation's rank map, every node's StartRanks, the start's deadline)."""

from __future__ import annotations

import time

from pitstop.scheduler.domain import JobState
from pitstop.scheduler.placement import GangRequest, place_pending
from pitstop.scheduler.reconcile.context import Leader, locked_job, set_deadline
from pitstop.scheduler.services import catalog, lifecycle
from pitstop.scheduler.services import node_commands as plan
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.services.node_commands import NodeAction
from pitstop.scheduler.topology import Topology


async def place_pending_jobs(leader: Leader) -> set[str]:
    """Place what fits; the ids of the jobs placed (their commands are due)."""
    async with leader.store.read() as session:
        pending = await lifecycle.live_jobs(session, (JobState.PENDING,))
        if not pending:
            return set()
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
    placed = set()
    for job_id, placement in place_pending(topology, requests).items():
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
            row.commands_after = None
            set_deadline(row, leader.timeouts.restart_seconds)
            starts = dict.fromkeys(placement.nodes(), NodeAction.START)
            await plan.replace_plan(session, row, starts)
        leader.metrics.decision_seconds.labels("placement").observe(time.perf_counter() - started)
        placed.add(job_id)
    return placed
