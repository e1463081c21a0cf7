"""One job and one node in full, as `pitstop job show`, `pitstop node show` and the
dashboard have them: PostgreSQL's record together with what Redis holds live.
(convert.py's job_in_full_to_pb and node_in_full_to_pb put them on the wire.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pitstop.scheduler.db import models
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.services import jobs as job_service
from pitstop.scheduler.services import nodes as node_service
from pitstop.scheduler.store import Store


@dataclass(frozen=True)
class JobInFull:
    job: models.Job
    ranks: Sequence[models.RankAssignment]
    """The current generation's rank map."""
    queue_position: int
    """Its place in the queue (0: not queued, or placed)."""
    rank_stats: list[dict[str, Any]]
    """The per-rank step-time statistics the leader last computed."""


@dataclass(frozen=True)
class NodeInFull:
    node: models.Node
    xids: Sequence[models.XidRecord]
    job_ids: Sequence[str]
    """The jobs with a rank on it."""
    live_health: dict[str, Any] | None
    """Its live health as its last heartbeat reported it."""


async def job_in_full(store: Store, hot: HotState, job_id: str) -> JobInFull:
    """One job with its current rank map and the per-rank step statistics from Redis."""
    async with store.read() as session:
        job = await job_service.get_job(session, job_id)
        ranks = await job_service.current_ranks(session, job)
        queue = await job_service.queue_positions(session) if not ranks else {}
    stats = await hot.rank_stats(job.id)
    return JobInFull(job, ranks, queue.get(job.id, 0), stats)


async def node_in_full(store: Store, hot: HotState, node_id: str) -> NodeInFull:
    """One node with its Xid history, the jobs on it, and its live health from Redis."""
    async with store.read() as session:
        node = await node_service.get_node(session, node_id)
        xids = await node_service.xid_history(session, node.id)
        jobs = await node_service.active_jobs_on(session, node.id)
    return NodeInFull(node, xids, jobs, await hot.node_health(node.id))
