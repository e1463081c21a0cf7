"""Typed, synchronous client for the pitstop scheduler's admin API."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Generator, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar, cast

import grpc
from google.protobuf.message import Message
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from pitstop.client.errors import PitstopError
from pitstop.client.streams import follow, is_unavailable
from pitstop.common.tls import channel_options
from pitstop.v1 import agent_pb2, common_pb2, jobs_pb2, jobs_pb2_grpc, nodes_pb2, nodes_pb2_grpc

DEFAULT_SERVER = "127.0.0.1:50051"
SERVER_ENV = "PITSTOP_SERVER"
TOKEN_ENV = "PITSTOP_TOKEN"
CA_CERT_ENV = "PITSTOP_CA_CERT"

_M = TypeVar("_M", bound=Message)


def _stub(stub_class: Any, channel: grpc.Channel) -> Any:
    # The generated *_pb2_grpc modules carry no types; keep that Any in one place.
    return stub_class(channel)


class PitstopClient:
    """A connection to the scheduler's JobService, NodeService, TokenService and EventService.

    Every unary call gets a deadline of ``timeout`` seconds and is retried on
    UNAVAILABLE with bounded exponential backoff and jitter. Streams have no deadline;
    they resume after the last event seen when the connection drops. Failures raise
    :class:`PitstopError`. Use it as a context manager to close the channel.
    """

    def __init__(
        self,
        server: str = DEFAULT_SERVER,
        token: str | None = None,
        timeout: float = 10.0,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        channel: grpc.Channel | None = None,
        max_attempts: int = 5,
        max_retry_seconds: float = 10.0,
    ) -> None:
        self.server = server
        self.timeout = timeout
        if channel is not None:
            self._channel = channel
        elif credentials is not None:
            # The scheduler's certificate names it "pitstop-scheduler" on any address.
            self._channel = grpc.secure_channel(server, credentials, options=channel_options())
        else:
            self._channel = grpc.insecure_channel(server)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        self._max_attempts = max_attempts
        self._retrying = Retrying(
            retry=retry_if_exception(is_unavailable),
            stop=stop_after_attempt(max_attempts) | stop_after_delay(max_retry_seconds),
            # Spelled out rather than wait_exponential_jitter, whose arguments changed
            # between the tenacity versions pyproject allows.
            wait=wait_exponential(multiplier=0.1, max=2.0) + wait_random(0, 0.1),
            reraise=True,
        )
        self._jobs = _stub(jobs_pb2_grpc.JobServiceStub, self._channel)
        self._nodes = _stub(nodes_pb2_grpc.NodeServiceStub, self._channel)
        self._events = _stub(nodes_pb2_grpc.EventServiceStub, self._channel)
        self._tokens = _stub(nodes_pb2_grpc.TokenServiceStub, self._channel)
        self._projects = _stub(jobs_pb2_grpc.ProjectServiceStub, self._channel)

    @classmethod
    def from_env(cls, server: str | None = None, token: str | None = None, **kwargs: Any) -> Self:
        """A client for ``PITSTOP_SERVER`` with ``PITSTOP_TOKEN``; arguments given win."""
        return cls(
            server or os.environ.get(SERVER_ENV) or DEFAULT_SERVER,
            token if token is not None else os.environ.get(TOKEN_ENV) or None,
            **kwargs,
        )

    def close(self) -> None:
        """Close the channel; in-flight streams end with CANCELLED."""
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # Jobs

    def submit_job(
        self,
        spec: jobs_pb2.JobSpec,
        request_id: str | None = None,
        code: agent_pb2.CodeVersion | None = None,
    ) -> jobs_pb2.Job:
        """Submit a job. A request id is always sent so that a retry after a lost answer
        returns the first job instead of creating a second one. `code`: the code as this
        side sees it (`pitstop.common.codeversion.code_version`), kept in the job's record."""
        request = jobs_pb2.SubmitJobRequest(
            spec=spec, request_id=request_id or uuid.uuid4().hex, code=code
        )
        response = self._unary(self._jobs.Submit, request, jobs_pb2.SubmitJobResponse)
        return response.job

    def get_job(self, job_id: str) -> jobs_pb2.Job:
        """One job; NOT_FOUND when the id is unknown."""
        return self._unary(self._jobs.Get, jobs_pb2.GetJobRequest(job_id=job_id), jobs_pb2.Job)

    def job_record(self, job_id: str) -> jobs_pb2.JobRecord:
        """The job's experiment record: spec, code, environment, data, durable
        checkpoints, goodput, result; NOT_FOUND when the id is unknown."""
        request = jobs_pb2.JobRecordRequest(job_id=job_id)
        return self._unary(self._jobs.Record, request, jobs_pb2.JobRecord)

    def job_stacks(self, job_id: str, incident: int = 0) -> jobs_pb2.JobStacksResponse:
        """The stacks taken of the job's ranks when it hung (`incident` 0: the newest)."""
        request = jobs_pb2.JobStacksRequest(job_id=job_id, incident=incident)
        return self._unary(self._jobs.Stacks, request, jobs_pb2.JobStacksResponse)

    def list_jobs(self, states: Sequence[int] = (), page_size: int = 100) -> list[jobs_pb2.Job]:
        """Every job (newest first), optionally only those in ``states``; follows pages."""
        jobs: list[jobs_pb2.Job] = []
        page_token = ""
        while True:
            request = jobs_pb2.ListJobsRequest(
                states=[cast(common_pb2.JobState, s) for s in states],
                page_size=page_size,
                page_token=page_token,
            )
            page = self._unary(self._jobs.List, request, jobs_pb2.ListJobsResponse)
            jobs.extend(page.jobs)
            if not page.next_page_token or page.next_page_token == page_token:
                return jobs
            page_token = page.next_page_token

    def cancel_job(self, job_id: str, reason: str = "") -> jobs_pb2.Job:
        """Stop a job for good; FAILED_PRECONDITION when it already ended."""
        return self._job_control(self._jobs.Cancel, job_id, reason)

    def pause_job(self, job_id: str, reason: str = "") -> jobs_pb2.Job:
        """Pause a running job at its next step boundary."""
        return self._job_control(self._jobs.Pause, job_id, reason)

    def resume_job(self, job_id: str, reason: str = "") -> jobs_pb2.Job:
        """Continue a paused job."""
        return self._job_control(self._jobs.Resume, job_id, reason)

    def watch_job(
        self, job_id: str, after_event_id: int = 0
    ) -> Generator[common_pb2.Event, None, None]:
        """The job's events, replaying those after ``after_event_id`` first."""

        def open_stream(cursor: int) -> Any:
            request = jobs_pb2.WatchJobRequest(job_id=job_id, after_event_id=cursor)
            return self._jobs.Watch(request, metadata=self._metadata)

        return follow(open_stream, after_event_id, self._max_attempts)

    # Nodes

    def list_nodes(
        self, states: Sequence[int] = (), roles: Sequence[int] = ()
    ) -> list[nodes_pb2.Node]:
        """Nodes ordered by id, optionally only those in ``states`` and ``roles``."""
        request = nodes_pb2.ListNodesRequest(
            states=[cast(common_pb2.NodeState, s) for s in states],
            roles=[cast(common_pb2.NodeRole, r) for r in roles],
        )
        return list(self._unary(self._nodes.List, request, nodes_pb2.ListNodesResponse).nodes)

    def get_node(self, node_id: str) -> nodes_pb2.Node:
        """One node with per-GPU health and Xid history; NOT_FOUND when unknown."""
        request = nodes_pb2.GetNodeRequest(node_id=node_id)
        return self._unary(self._nodes.Get, request, nodes_pb2.Node)

    def cordon_node(self, node_id: str, reason: str = "") -> nodes_pb2.Node:
        """Let the node take nothing new."""
        return self._node_control(self._nodes.Cordon, node_id, reason)

    def uncordon_node(self, node_id: str, reason: str = "") -> nodes_pb2.Node:
        """Make a cordoned or draining node ready again."""
        return self._node_control(self._nodes.Uncordon, node_id, reason)

    def drain_node(self, node_id: str, reason: str = "") -> nodes_pb2.Node:
        """Take nothing new and move ranks off at the next committed checkpoint."""
        return self._node_control(self._nodes.Drain, node_id, reason)

    def revoke_node(self, node_id: str, reason: str = "") -> nodes_pb2.Node:
        """Cut the node off: its certificates stop working now; it re-joins with a new token."""
        return self._node_control(self._nodes.Revoke, node_id, reason)

    def set_node_role(self, node_id: str, role: int, reason: str = "") -> nodes_pb2.Node:
        """Make the node a worker or a hot spare (``common_pb2.NODE_ROLE_*``)."""
        request = nodes_pb2.SetNodeRoleRequest(
            node_id=node_id, role=cast(common_pb2.NodeRole, role), reason=reason
        )
        return self._unary(self._nodes.SetRole, request, nodes_pb2.Node)

    def inject_fault(self, node_id: str, fault: common_pb2.Fault) -> nodes_pb2.InjectFaultResponse:
        """Send a fault down the node's agent stream (drills and tests)."""
        request = nodes_pb2.InjectFaultRequest(node_id=node_id, fault=fault)
        return self._unary(self._nodes.InjectFault, request, nodes_pb2.InjectFaultResponse)

    def create_join_token(
        self, ttl_seconds: int = 3600, node_id: str = ""
    ) -> nodes_pb2.CreateJoinTokenResponse:
        """A one-time join token for a node's enrollment (``node_id`` "": any one node)."""
        request = nodes_pb2.CreateJoinTokenRequest(ttl_seconds=ttl_seconds, node_id=node_id)
        return self._unary(self._nodes.CreateJoinToken, request, nodes_pb2.CreateJoinTokenResponse)

    # API tokens

    def create_api_token(
        self, name: str, role: int, ttl_seconds: int = 0, projects: Sequence[str] = ()
    ) -> nodes_pb2.CreateApiTokenResponse:
        """An API token for a person or a script (admin), shown once: ``role`` is
        ``common_pb2.ROLE_VIEWER``, ``ROLE_OPERATOR`` or ``ROLE_ADMIN``; ``ttl_seconds``
        0 means it never expires; ``projects`` limits it to those projects' jobs."""
        request = nodes_pb2.CreateApiTokenRequest(
            name=name,
            role=cast(common_pb2.Role, role),
            ttl_seconds=ttl_seconds,
            projects=list(projects),
        )
        return self._unary(self._tokens.Create, request, nodes_pb2.CreateApiTokenResponse)

    def list_api_tokens(self) -> list[nodes_pb2.ApiToken]:
        """Every API token (admin): configured ones first, then issued ones by name,
        revoked and expired ones included; never a token or its hash."""
        request = nodes_pb2.ListApiTokensRequest()
        return list(self._unary(self._tokens.List, request, nodes_pb2.ListApiTokensResponse).tokens)

    def revoke_api_token(self, name: str) -> nodes_pb2.ApiToken:
        """Revoke an issued API token (admin); a no-op when it already is. A configured
        token is FAILED_PRECONDITION: it is removed from the config file only."""
        request = nodes_pb2.RevokeApiTokenRequest(name=name)
        return self._unary(self._tokens.Revoke, request, nodes_pb2.ApiToken)

    # Projects

    def set_quota(
        self, project: str, gpus: int | None = None, *, unlimited: bool = False
    ) -> jobs_pb2.Project:
        """Set a project's GPU quota (admin), or remove it with ``unlimited``."""
        request = jobs_pb2.SetQuotaRequest(project=project, gpus=gpus or 0, unlimited=unlimited)
        return self._unary(self._projects.SetQuota, request, jobs_pb2.Project)

    def list_projects(self) -> list[jobs_pb2.Project]:
        """Every project with a quota or a job, by name, with its GPUs in use."""
        request = jobs_pb2.ListProjectsRequest()
        reply = self._unary(self._projects.List, request, jobs_pb2.ListProjectsResponse)
        return list(reply.projects)

    # Events

    def list_events(
        self, job_id: str = "", node_id: str = "", after_event_id: int = 0, limit: int = 100
    ) -> list[common_pb2.Event]:
        """Events oldest first, with id above ``after_event_id``, at most ``limit``; a
        negative ``after_event_id`` gives the newest ``limit`` events."""
        request = nodes_pb2.ListEventsRequest(
            job_id=job_id, node_id=node_id, after_event_id=after_event_id, limit=limit
        )
        return list(self._unary(self._events.List, request, nodes_pb2.ListEventsResponse).events)

    def watch_events(
        self, job_id: str = "", node_id: str = "", after_event_id: int = -1
    ) -> Generator[common_pb2.Event, None, None]:
        """Events as they are recorded; a negative ``after_event_id`` starts at the newest
        without replay, otherwise events after that id are replayed first."""

        def open_stream(cursor: int) -> Any:
            request = nodes_pb2.WatchEventsRequest(
                job_id=job_id, node_id=node_id, after_event_id=cursor
            )
            return self._events.Watch(request, metadata=self._metadata)

        return follow(open_stream, after_event_id, self._max_attempts)

    # Plumbing

    def _job_control(self, rpc: Any, job_id: str, reason: str) -> jobs_pb2.Job:
        request = jobs_pb2.JobControlRequest(job_id=job_id, reason=reason)
        return self._unary(rpc, request, jobs_pb2.Job)

    def _node_control(self, rpc: Any, node_id: str, reason: str) -> nodes_pb2.Node:
        request = nodes_pb2.NodeControlRequest(node_id=node_id, reason=reason)
        return self._unary(rpc, request, nodes_pb2.Node)

    def _unary(self, rpc: Callable[..., Any], request: Message, response_type: type[_M]) -> _M:
        try:
            response = self._retrying(rpc, request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise PitstopError.from_rpc_error(error) from None
        if not isinstance(response, response_type):
            raise TypeError(f"expected {response_type.__name__}, got {type(response).__name__}")
        return response
