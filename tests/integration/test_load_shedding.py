"""A process holding agent streams whose event loop falls behind drops telemetry first:
step summaries sent while it lags are counted as shed and never written, while an Xid on
the same stream is still recorded; once it has caught up, summaries flow again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kit.ports import free_port
from kit.schedulers import SchedulerThread, scheduler_settings
from kit.stores import StoreUrls, unique
from kit.waits import wait_until
from pitstop.v1 import agent_pb2, common_pb2, nodes_pb2, nodes_pb2_grpc


@pytest.fixture
def scheduler(stores: StoreUrls, tmp_path: Path) -> Iterator[SchedulerThread]:
    thread = SchedulerThread(
        scheduler_settings(
            stores,
            tmp_path / "scheduler",
            database_url=stores.fresh_database(),
            redis_prefix=f"{stores.redis_prefix}{unique('shed')}:",
            heartbeat_interval_seconds=60.0,
            shed_lag_seconds=0.25,  # the default, which the tests' schedulers raise
        )
    )
    yield thread
    thread.stop()


def summary(job_id: str, step: int) -> agent_pb2.StepSummary:
    return agent_pb2.StepSummary(
        job_id=job_id, generation=1, ranks=1, slowest_step=step, newest_step=step
    )


def steps_written(client: redis.Redis, key: str) -> list[int]:
    found = []
    for _, fields in client.xrange(key):
        batch = agent_pb2.StepSummaries.FromString(fields[b"summaries"])
        found += [s.newest_step for s in batch.summaries]
    return found


def test_a_lagging_process_sheds_step_summaries_but_not_an_xid(
    scheduler: SchedulerThread, stores: StoreUrls
) -> None:
    node_id, job_id = unique("lagging"), unique("j")
    settings = scheduler.settings
    client = redis.Redis.from_url(stores.redis_url)
    key = f"{settings.redis_prefix}steps:{job_id}"
    shedder = scheduler.scheduler.agents.shedder
    nodes = nodes_pb2_grpc.NodeServiceStub(scheduler.channel())
    try:
        with scheduler.agent_stream(node_id) as agent:
            agent.send(step_summary=summary(job_id, 1))
            wait_until(lambda: steps_written(client, key) == [1], "step 1 written", 15)
            # The scheduler's event loop is blocked for 0.6 s: its lag watcher sees it.
            scheduler.loop.call_soon_threadsafe(time.sleep, 0.6)
            wait_until(lambda: shedder.shedding, "the process to shed", 15)
            agent.send(step_summary=summary(job_id, 2))
            agent.send(xid=common_pb2.XidEvent(gpu_index=0, xid=13))
            wait_until(
                lambda: nodes.Get(nodes_pb2.GetNodeRequest(node_id=node_id)).xid_history,
                "the Xid recorded",
                15,
            )
            assert shedder.shed.labels("step_summary")._value.get() >= 1
            wait_until(lambda: not shedder.shedding, "the process to catch up", 15)
            agent.send(step_summary=summary(job_id, 3))
            wait_until(lambda: 3 in steps_written(client, key), "step 3 written", 15)
            assert steps_written(client, key) == [1, 3]
    finally:
        client.close()


def test_a_stream_lost_while_the_process_is_behind_counts_as_silent(
    scheduler: SchedulerThread,
) -> None:
    """A keepalive ping missed while the process holding the stream was starved may be
    the process's fault: the loss counts toward a mass loss whatever the host says."""
    node_id = unique("behind")
    refused = f"127.0.0.1:{free_port()}"  # the host answers (a refusal)
    shedder = scheduler.scheduler.agents.shedder
    events = nodes_pb2_grpc.EventServiceStub(scheduler.channel())
    stream = scheduler.open_stream(node_id, checkpointd_address=refused)
    scheduler.loop.call_soon_threadsafe(time.sleep, 0.6)
    wait_until(lambda: shedder.shedding, "the process to shed", 15)
    stream.close()
    lost = wait_until(
        lambda: [
            e
            for e in events.List(nodes_pb2.ListEventsRequest(node_id=node_id)).events
            if e.kind == "node.lost"
        ],
        "the node lost",
        15,
    )
    assert lost[0].attributes["cause"] == "silent"
