"""The scheduler as a server: health checking, reflection, authorization, shutdown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kit.schedulers import SchedulerThread, scheduler_settings
from kit.stores import StoreUrls, unique
from pitstop.scheduler.config import ApiToken
from pitstop.scheduler.domain import Role
from pitstop.v1 import jobs_pb2, jobs_pb2_grpc, nodes_pb2, nodes_pb2_grpc

VIEWER = "viewer-token-0123456789"
OPERATOR = "operator-token-0123456789"


def test_stock_health_client_sees_serving(scheduler: SchedulerThread) -> None:
    stub = health_pb2_grpc.HealthStub(scheduler.channel())
    for service in ("", "pitstop.v1.JobService", "pitstop.v1.AgentService"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_stock_reflection_client_lists_the_pitstop_services(scheduler: SchedulerThread) -> None:
    database = ProtoReflectionDescriptorDatabase(scheduler.channel())
    services = set(database.get_services())
    assert {
        "pitstop.v1.JobService",
        "pitstop.v1.NodeService",
        "pitstop.v1.EventService",
        "pitstop.v1.AgentService",
        "grpc.health.v1.Health",
    } <= services
    described = database.FindFileContainingSymbol("pitstop.v1.JobService")
    assert described.package == "pitstop.v1"


@pytest.fixture(scope="module")
def guarded(stores: StoreUrls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    settings = scheduler_settings(
        stores,
        tmp_path_factory.mktemp("guarded"),
        tokens=[
            ApiToken(token=VIEWER, role=Role.VIEWER, name="alice"),
            ApiToken(token=OPERATOR, role=Role.OPERATOR, name="bob"),
        ],
    )
    thread = SchedulerThread(settings)
    yield thread
    thread.stop()


def _auth(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


def test_without_a_token_calls_are_unauthenticated(guarded: SchedulerThread) -> None:
    jobs = jobs_pb2_grpc.JobServiceStub(guarded.channel())
    with pytest.raises(grpc.RpcError) as err:
        jobs.List(jobs_pb2.ListJobsRequest())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "Bearer" in err.value.details()


def test_a_viewer_reads_but_cannot_submit_and_an_operator_can(guarded: SchedulerThread) -> None:
    jobs = jobs_pb2_grpc.JobServiceStub(guarded.channel())
    jobs.List(jobs_pb2.ListJobsRequest(), metadata=_auth(VIEWER))
    spec = jobs_pb2.JobSpec(name=unique("auth"), command=["python", "x.py"])
    with pytest.raises(grpc.RpcError) as err:
        jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec), metadata=_auth(VIEWER))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "operator" in err.value.details()
    job = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec), metadata=_auth(OPERATOR)).job
    events = nodes_pb2_grpc.EventServiceStub(guarded.channel())
    log = events.List(nodes_pb2.ListEventsRequest(job_id=job.id), metadata=_auth(VIEWER))
    assert log.events[0].actor == "token:bob"


def test_an_operator_cannot_set_roles(guarded: SchedulerThread) -> None:
    nodes = nodes_pb2_grpc.NodeServiceStub(guarded.channel())
    with pytest.raises(grpc.RpcError) as err:
        nodes.SetRole(nodes_pb2.SetNodeRoleRequest(node_id="x"), metadata=_auth(OPERATOR))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_health_stays_public_with_tokens(guarded: SchedulerThread) -> None:
    stub = health_pb2_grpc.HealthStub(guarded.channel())
    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_stop_lets_an_in_flight_watch_end_and_then_refuses_calls(
    stores: StoreUrls, tmp_path: Path
) -> None:
    thread = SchedulerThread(scheduler_settings(stores, tmp_path))
    channel = thread.channel()
    jobs = jobs_pb2_grpc.JobServiceStub(channel)
    job = jobs.Submit(
        jobs_pb2.SubmitJobRequest(spec=jobs_pb2.JobSpec(name=unique("stop"), command=["x"]))
    ).job
    stream = jobs.Watch(jobs_pb2.WatchJobRequest(job_id=job.id), timeout=30)
    assert next(stream).kind == "job.submitted"
    thread.stop()
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    with pytest.raises(grpc.RpcError) as err:
        jobs_pb2_grpc.JobServiceStub(grpc.insecure_channel(thread.address)).List(
            jobs_pb2.ListJobsRequest(), timeout=2
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
