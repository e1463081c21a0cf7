"""One job and one node in full, as `pitstop job show`, `pitstop node show` and the
dashboard have them: PostgreSQL's record together with what Redis holds live."""

from __future__ import annotations

from pitstop.scheduler.convert import job_to_pb, node_to_pb
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.services import jobs as job_service
from pitstop.scheduler.services import nodes as node_service
from pitstop.scheduler.store import Store
from pitstop.v1 import jobs_pb2, nodes_pb2


async def job_in_full(store: Store, hot: HotState, job_id: str) -> jobs_pb2.Job:
    """One job with its current rank map and the per-rank step statistics from Redis."""
    async with store.read() as session:
        job = await job_service.get_job(session, job_id)
        ranks = await job_service.current_ranks(session, job)
        queue = await job_service.queue_positions(session) if not ranks else {}
    message = job_to_pb(job, ranks, queue_position=queue.get(job.id, 0))
    stats = await hot.rank_stats(job.id)
    message.rank_stats.extend(jobs_pb2.RankStepStats(**s) for s in stats)
    return message


async def node_in_full(store: Store, hot: HotState, node_id: str) -> nodes_pb2.Node:
    """One node with its Xid history, the jobs on it, and its live health from Redis."""
    async with store.read() as session:
        node = await node_service.get_node(session, node_id)
        xids = await node_service.xid_history(session, node.id)
        jobs = await node_service.active_jobs_on(session, node.id)
    return node_to_pb(node, xids=xids, job_ids=jobs, live_health=await hot.node_health(node.id))
