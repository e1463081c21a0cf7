"""A synthetic fleet (N nodes, one job of M ranks with step times, stragglers,
incidents) written straight into a scheduler's database and Redis, for the dashboard's
benchmark and tests.

`seed_fleet` writes, by default, what a large production fleet shows the dashboard:

* 1,000 nodes of 8 GPUs in zones of 250, blocks of 50 and racks of 10; of every 100,
  node 7 is unhealthy, node 8 lost and node 9 cordoned (10 unhealthy in 1,000), and
  the last 2% are spares;
* one running job of 4,000 ranks (tp 8, pp 5, dp 100) on the first 500 nodes, with
  40 steps of every rank's step time in Redis;
* rank 1234 a straggler (0.6 s slower on every step, and named by the rank stats);
* three resumed node incidents in the job's goodput.

Nothing runs: no agent, no trainer, no deciding loop. Start the scheduler with
``leader_loops=False`` or the liveness monitor finds every node silent and lost.
Node ids start with the job id, so several fleets can share a database.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

from google.protobuf import json_format
from sqlalchemy.ext.asyncio import AsyncEngine

from pitstop.health.straggler import StragglerPolicy, WindowFold
from pitstop.scheduler.db import models
from pitstop.scheduler.db.engine import session_factory
from pitstop.scheduler.domain import JobState, NodeRole, NodeState
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.services.jobs import spec_to_json
from pitstop.v1 import agent_pb2, jobs_pb2


class Scheduler(Protocol):
    """What seeding needs of a running scheduler (pitstop.scheduler.server.Scheduler):
    its database and its Redis."""

    @property
    def engine(self) -> AsyncEngine: ...

    @property
    def hot(self) -> HotState: ...


NODES, RANKS = 1000, 4000
"""The default fleet: 1,000 nodes and a 4,000-rank job."""
GPUS = 8
"""GPUs per node; also the job's tensor-parallel size."""
PP = 5
"""The job's pipeline-parallel size; its data-parallel size is ranks / (GPUS * PP)."""
STEPS = 40
"""Steps of step times recorded for every rank."""
IN_FLIGHT = 32
"""Step summaries written to Redis at once while seeding."""


INCIDENTS = 3
STRAGGLER_RANK = 1234
"""The straggling rank (taken modulo the rank count in a smaller job)."""
SPARE_SHARE = 50
"""One node in this many, the last ones, is a spare."""
_STATES = {7: NodeState.UNHEALTHY, 8: NodeState.LOST, 9: NodeState.CORDONED}


class StepSampleOf(NamedTuple):
    """What the window fold reads of a step sample."""

    rank: int
    step: int
    step_seconds: float
    checkpoint_step: bool = False


"""Of every 100 nodes, these are not ready."""


def node_id(job_id: str, index: int) -> str:
    """The id of the synthetic fleet's node ``index``."""
    return f"{job_id}-n{index:04d}"


def straggler(ranks: int = RANKS) -> int:
    """The rank that straggles in a job of ``ranks`` ranks (1234 in the default one)."""
    return STRAGGLER_RANK % ranks


def check_size(nodes: int, ranks: int) -> None:
    """Raise ValueError unless ``nodes`` and ``ranks`` make a fleet `seed_fleet` can write."""
    group = GPUS * PP
    if ranks < group or ranks % group:
        raise ValueError(f"ranks must be a positive multiple of {group} (tp {GPUS} x pp {PP})")
    if nodes < INCIDENTS or nodes * GPUS < ranks:
        raise ValueError(
            f"{nodes} nodes of {GPUS} GPUs cannot hold {ranks} ranks "
            f"(and at least {INCIDENTS} nodes are needed)"
        )


async def seed_fleet(
    scheduler: Scheduler, job_id: str, nodes: int = NODES, ranks: int = RANKS
) -> None:
    """Write the synthetic fleet and its job ``job_id`` into ``scheduler``'s database
    (nodes, job, rank map) and Redis (step times, rank stats). ``ranks`` must be a
    multiple of 40 and fit on ``nodes`` 8-GPU nodes (see `check_size`)."""
    check_size(nodes, ranks)
    spares_from = nodes - nodes // SPARE_SHARE
    healthy = {"verdict": "HEALTH_VERDICT_HEALTHY", "gpus": [{"index": g} for g in range(GPUS)]}
    node_rows: list[Any] = [
        models.Node(
            id=node_id(job_id, i),
            role=NodeRole.SPARE if i >= spares_from else NodeRole.WORKER,
            state=_STATES.get(i % 100, NodeState.READY),
            reason="synthetic",
            zone=f"z{i // 250}",
            block=f"b{(i // 50) % 5}",
            rack=f"r{(i // 10) % 5:02d}",
            connected=True,
            health=healthy,
        )
        for i in range(nodes)
    ]
    goodput = jobs_pb2.Goodput(ratio=0.97, recoveries=INCIDENTS, incident_count=INCIDENTS)
    now = time.time()
    for n in range(INCIDENTS):
        goodput.incidents.add(
            cause=f"{node_id(job_id, n)} unhealthy",
            kind=jobs_pb2.INCIDENT_KIND_NODE,
            outcome=jobs_pb2.INCIDENT_OUTCOME_RESUMED,
            failed_at=now - 300 + 60 * n,
            detect_seconds=0.05,
            decide_seconds=0.04,
            resume_seconds=0.6 + n,
            lost_steps=n,
        )
    dp = ranks // (GPUS * PP)
    spec = jobs_pb2.JobSpec(name="synthetic", command=["true"], tp=GPUS, pp=PP, dp=dp)
    job_rows: list[Any] = [
        models.Job(
            id=job_id,
            name="synthetic",
            spec=spec_to_json(spec),
            state=JobState.RUNNING,
            generation=1,
            current_step=STEPS,
            goodput=json_format.MessageToDict(goodput),
        )
    ]
    job_rows += [
        models.RankAssignment(
            job_id=job_id,
            since_generation=1,
            rank=rank,
            node_id=node_id(job_id, rank // GPUS),
            gpu_index=rank % GPUS,
            local_rank=rank % GPUS,
            tp=rank % GPUS,
            pp=(rank // GPUS) % PP,
            dp=rank // (GPUS * PP),
        )
        for rank in range(ranks)
    ]
    async with session_factory(scheduler.engine)() as session, session.begin():
        session.add_all(node_rows)
        await session.flush()  # the rank map refers to the nodes
        session.add_all(job_rows)

    slow = straggler(ranks)
    # What each node's agent sends each step: its ranks' steps folded into windows. The
    # nodes' agents send at once, so their summaries are written side by side, a few
    # dozen in flight (one after another, 20,000 round trips took most of 20 s).
    folds = [
        WindowFold(StragglerPolicy(window_steps=1, warmup_steps=0), start_step=1)
        for _ in range(ranks // GPUS)
    ]
    for step in range(1, STEPS + 1):
        summaries = []
        for node, fold in enumerate(folds):
            ranks_here = range(node * GPUS, (node + 1) * GPUS)
            summary = agent_pb2.StepSummary(
                job_id=job_id,
                generation=1,
                node_id=node_id(job_id, node),
                ranks=GPUS,
                slowest_step=step,
                newest_step=step,
                samples=GPUS,
                tokens=4096 * GPUS,
                loss_step=step,
                loss=8.0 / step,
            )
            summary.time.FromMilliseconds(int((now - 60 + step) * 1000))
            for rank in ranks_here:
                seconds = 1.0 + (0.6 if rank == slow else 0.001 * (rank % 7))
                summary.windows.extend(
                    w.to_proto() for w in fold.add(StepSampleOf(rank, step, seconds))
                )
            summaries.append(summary)
        for first in range(0, len(summaries), IN_FLIGHT):
            await scheduler.hot.record_step_summaries(
                {job_id: summaries[first : first + IN_FLIGHT]}
            )
    await scheduler.hot.set_rank_stats(
        job_id,
        [
            {
                "rank": slow,
                "node_id": node_id(job_id, slow // GPUS),
                "straggler": True,
                "p50_seconds": 1.6,
            }
        ],
    )
