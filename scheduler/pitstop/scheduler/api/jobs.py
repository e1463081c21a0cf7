"""JobService."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pitstop.scheduler.api.watch import follow_events
from pitstop.scheduler.auth import current_caller
from pitstop.scheduler.convert import event_to_pb, job_in_full_to_pb, job_states_from_pb, job_to_pb
from pitstop.scheduler.domain import TERMINAL_JOB_STATES
from pitstop.scheduler.gateway import CommandRouter
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.services import events as event_service
from pitstop.scheduler.services import jobs as job_service
from pitstop.scheduler.services import records as record_service
from pitstop.scheduler.services import stacks as stacks_service
from pitstop.scheduler.services.views import job_in_full
from pitstop.scheduler.store import Store
from pitstop.v1 import agent_pb2, common_pb2, jobs_pb2

_TERMINAL_NAMES = {s.value for s in TERMINAL_JOB_STATES}


class JobServicer:
    def __init__(self, store: Store, hot: HotState, router: CommandRouter) -> None:
        self.store = store
        self.hot = hot
        self.router = router

    async def Submit(  # noqa: N802 (gRPC method names)
        self, request: jobs_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.SubmitJobResponse:
        async with self.store.write() as session:
            job = await job_service.submit_job(
                session,
                request.spec,
                request_id=request.request_id,
                actor=current_caller.get().actor,
                code=request.code if request.HasField("code") else None,
            )
        return jobs_pb2.SubmitJobResponse(job=job_to_pb(job))

    async def Get(  # noqa: N802
        self, request: jobs_pb2.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.Job:
        return job_in_full_to_pb(await job_in_full(self.store, self.hot, request.job_id))

    async def List(  # noqa: N802
        self, request: jobs_pb2.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.ListJobsResponse:
        states = job_states_from_pb(request.states)
        async with self.store.read() as session:
            jobs, token = await job_service.list_jobs(
                session, states=states, page_size=request.page_size, page_token=request.page_token
            )
            queue = await job_service.queue_positions(session)
        return jobs_pb2.ListJobsResponse(
            jobs=[job_to_pb(j, queue_position=queue.get(j.id, 0)) for j in jobs],
            next_page_token=token,
        )

    async def _control(self, request: jobs_pb2.JobControlRequest, action: str) -> jobs_pb2.Job:
        async with self.store.write() as session:
            job = await job_service.change_job_state(
                session,
                request.job_id,
                action,
                reason=request.reason,
                actor=current_caller.get().actor,
            )
            nodes = await job_service.job_nodes(session, job)
        # After the commit: tell the job's agents (the decision stands even if one is away).
        command = {
            "cancel": agent_pb2.SchedulerMessage(
                stop_ranks=agent_pb2.StopRanks(job_id=job.id, reason=job.reason, grace_seconds=10)
            ),
            "pause": agent_pb2.SchedulerMessage(
                pause=agent_pb2.PauseJob(job_id=job.id, generation=job.generation)
            ),
            "resume": agent_pb2.SchedulerMessage(
                resume=agent_pb2.ResumeJob(job_id=job.id, generation=job.generation)
            ),
        }[action]
        for node_id in nodes:
            await self.router.send(node_id, command)
        return job_to_pb(job)

    async def Cancel(  # noqa: N802
        self, request: jobs_pb2.JobControlRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.Job:
        return await self._control(request, "cancel")

    async def Pause(  # noqa: N802
        self, request: jobs_pb2.JobControlRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.Job:
        return await self._control(request, "pause")

    async def Resume(  # noqa: N802
        self, request: jobs_pb2.JobControlRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.Job:
        return await self._control(request, "resume")

    async def Stacks(  # noqa: N802
        self, request: jobs_pb2.JobStacksRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.JobStacksResponse:
        async with self.store.read() as session:
            return await stacks_service.job_stacks(session, request.job_id, request.incident)

    async def Record(  # noqa: N802
        self, request: jobs_pb2.JobRecordRequest, context: grpc.aio.ServicerContext
    ) -> jobs_pb2.JobRecord:
        async with self.store.read() as session:
            return await record_service.job_record(session, request.job_id)

    async def Watch(  # noqa: N802
        self, request: jobs_pb2.WatchJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.Event]:
        async with self.store.read() as session:
            job = await job_service.get_job(session, request.job_id)
            if job.state in TERMINAL_JOB_STATES:
                # Nothing more will happen: replay what is left and end the stream.
                for row in await event_service.list_events(
                    session, job_id=job.id, after_id=request.after_event_id, limit=1000
                ):
                    yield event_to_pb(row)
                return
        async for event in follow_events(
            self.store,
            job_id=job.id,
            after_id=request.after_event_id,
            until=lambda e: e.to_state in _TERMINAL_NAMES,
        ):
            yield event
