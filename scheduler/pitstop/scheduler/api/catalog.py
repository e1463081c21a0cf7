"""CheckpointCatalogService: checkpoint daemons report shards; the restore path asks."""

from __future__ import annotations

import grpc

from pitstop.scheduler.auth import current_caller
from pitstop.scheduler.convert import restore_point_to_pb, shard_report_from_pb
from pitstop.scheduler.errors import InvalidArgument, PermissionDenied
from pitstop.scheduler.jobspec import check_text
from pitstop.scheduler.services import catalog as catalog_service
from pitstop.scheduler.services import jobs as job_service
from pitstop.scheduler.store import Store
from pitstop.v1 import checkpoint_pb2


class CatalogServicer:
    def __init__(self, store: Store) -> None:
        self.store = store

    async def ReportShards(  # noqa: N802 (gRPC method names)
        self, request: checkpoint_pb2.ReportShardsRequest, context: grpc.aio.ServicerContext
    ) -> checkpoint_pb2.ReportShardsResponse:
        check_text("node_id", request.node_id, max_len=253)
        caller = current_caller.get()
        if caller.node_id and caller.node_id != request.node_id:
            raise PermissionDenied(
                f"node_id: this call's certificate names node {caller.node_id!r}; it cannot "
                f"report shards held by {request.node_id!r}"
            )
        if len(request.held_jobs) > catalog_service.MAX_HELD_JOBS:
            raise InvalidArgument(
                "held_jobs",
                f"{len(request.held_jobs)} job ids",
                f"name at most {catalog_service.MAX_HELD_JOBS} (the jobs this daemon holds "
                "snapshots of)",
            )
        for job_id in request.held_jobs:
            check_text("held_jobs", job_id, max_len=63)
        if request.held_jobs:
            async with self.store.read() as session:
                ended = await catalog_service.ended_jobs(session, request.held_jobs)
        else:
            ended = []
        changed = request.added or request.removed or request.removed_durable
        if not (changed or request.flush_errors or request.fresh_start):  # only asking
            return checkpoint_pb2.ReportShardsResponse(ended_jobs=ended)
        async with self.store.write() as session:
            settled = await catalog_service.report_shards(session, shard_report_from_pb(request))
            # In the report's own transaction: one lookup by key, no extra round trip.
            unfit = bool(request.buddy_node_id) and not await catalog_service.may_hold_replicas(
                session, request.buddy_node_id
            )
        async with self.store.write() as session:  # the jobs' rows: briefly, on their own
            committed = await catalog_service.advance_jobs(session, settled)
        return checkpoint_pb2.ReportShardsResponse(
            committed_steps=committed, buddy_unfit=unfit, ended_jobs=ended
        )

    async def GetBuddy(  # noqa: N802
        self, request: checkpoint_pb2.GetBuddyRequest, context: grpc.aio.ServicerContext
    ) -> checkpoint_pb2.GetBuddyResponse:
        async with self.store.read() as session:
            buddy = await catalog_service.buddy_of(session, request.node_id)
        if buddy is None:
            return checkpoint_pb2.GetBuddyResponse()
        return checkpoint_pb2.GetBuddyResponse(
            buddy_node_id=buddy.id, buddy_address=buddy.checkpointd_address
        )

    async def GetRestorePoint(  # noqa: N802
        self, request: checkpoint_pb2.GetRestorePointRequest, context: grpc.aio.ServicerContext
    ) -> checkpoint_pb2.GetRestorePointResponse:
        async with self.store.read() as session:
            job = await job_service.get_job(session, request.job_id)
            point = await catalog_service.restore_point(session, job, request.step)
        return restore_point_to_pb(point)
