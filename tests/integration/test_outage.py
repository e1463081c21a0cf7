"""A PostgreSQL outage under a running scheduler: UNAVAILABLE, the process stays up, and
calls succeed again once PostgreSQL is back, without a restart."""

from __future__ import annotations

import contextlib
from pathlib import Path

import grpc
import pytest
from conftest import SchedulerThread, StoreUrls, scheduler_settings, unique
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pitstop.scheduler.embedded import start_postgres
from pitstop.v1 import jobs_pb2, jobs_pb2_grpc, nodes_pb2, nodes_pb2_grpc


def wait_for_health(thread: SchedulerThread, wanted: int, timeout: float = 20) -> None:
    """Follow the health Watch stream until it reports ``wanted``."""
    stub = health_pb2_grpc.HealthStub(thread.channel())
    for reply in stub.Watch(health_pb2.HealthCheckRequest(), timeout=timeout):
        if reply.status == wanted:
            return


def test_postgres_outage_is_unavailable_and_heals(stores: StoreUrls, tmp_path: Path) -> None:
    url, postgres = start_postgres(tmp_path / "pg")
    thread = SchedulerThread(scheduler_settings(stores, tmp_path / "sched", database_url=url))
    try:
        jobs = jobs_pb2_grpc.JobServiceStub(thread.channel())
        nodes = nodes_pb2_grpc.NodeServiceStub(thread.channel())
        spec = jobs_pb2.JobSpec(name=unique("outage"), command=["python", "t.py"])
        before = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job

        postgres.cleanup()  # stops the server; its data stays
        calls = [
            lambda: jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec), timeout=15),
            lambda: jobs.Get(jobs_pb2.GetJobRequest(job_id=before.id), timeout=15),
            lambda: jobs.List(jobs_pb2.ListJobsRequest(), timeout=15),
            lambda: nodes.List(nodes_pb2.ListNodesRequest(), timeout=15),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "PostgreSQL" in err.value.details()
        wait_for_health(thread, health_pb2.HealthCheckResponse.NOT_SERVING)

        url_again, postgres = start_postgres(tmp_path / "pg")
        assert url_again == url
        wait_for_health(thread, health_pb2.HealthCheckResponse.SERVING)
        after = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec), timeout=15).job
        assert after.id != before.id
        assert jobs.Get(jobs_pb2.GetJobRequest(job_id=before.id)).id == before.id
    finally:
        thread.stop()
        with contextlib.suppress(Exception):
            postgres.cleanup()
