"""ProjectService: projects' GPU quotas, set by an admin, read by anyone who may view."""

from __future__ import annotations

import grpc

from pitstop.scheduler.auth import current_caller
from pitstop.scheduler.convert import project_to_pb
from pitstop.scheduler.errors import InvalidArgument
from pitstop.scheduler.services import projects as project_service
from pitstop.scheduler.store import Store
from pitstop.v1 import jobs_pb2

MAX_QUOTA = 10_000_000
"""The largest GPU quota accepted (above any fleet)."""


class ProjectServicer:
    def __init__(self, store: Store) -> None:
        self.store = store

    async def SetQuota(  # noqa: N802 (gRPC method names)
        self, request: jobs_pb2.SetQuotaRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.Project:
        if request.unlimited and request.gpus:
            raise InvalidArgument("gpus", request.gpus, "give either gpus or unlimited, not both")
        if request.gpus > MAX_QUOTA:
            raise InvalidArgument("gpus", request.gpus, f"use at most {MAX_QUOTA}")
        gpus = None if request.unlimited else int(request.gpus)
        async with self.store.write() as session:
            await project_service.set_quota(
                session, request.project, gpus, actor=current_caller.get().actor
            )
        async with self.store.read() as session:
            (use,) = [
                p for p in await project_service.list_projects(session) if p.name == request.project
            ]
        return project_to_pb(use)

    async def List(  # noqa: N802
        self, request: jobs_pb2.ListProjectsRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.ListProjectsResponse:
        async with self.store.read() as session:
            found = await project_service.list_projects(session)
        return jobs_pb2.ListProjectsResponse(projects=[project_to_pb(p) for p in found])
