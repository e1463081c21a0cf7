"""The local cluster as bench/chaos.py runs it: two schedulers on a PostgreSQL and a Redis
of its own, each agent keeping its checkpoint daemon running. A killed checkpoint daemon
comes back at its address, started by its agent; a killed leader's standby takes over
and the killed one comes back on its port; PostgreSQL restarts and Redis is flushed under
the cluster, and its node stays ready; kill_node takes the agent's daemon too."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from kit.waits import wait_until
from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import ClusterError, LocalCluster, running_cluster
from pitstop.client.localcluster.stores import OwnPostgres, OwnRedis
from pitstop.v1 import common_pb2

T = TypeVar("T")
TIMEOUT = 30.0


@pytest.fixture
def cluster() -> Iterator[tuple[LocalCluster, OwnPostgres, OwnRedis]]:
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="pcc-"))  # short: agent sockets
    try:
        try:
            postgres = OwnPostgres(root / "postgres")
            redis = OwnRedis(root / "redis")
        except ClusterError as exc:
            pytest.skip(f"no PostgreSQL or Redis server binaries here: {exc}")
        with (
            postgres,
            redis,
            running_cluster(
                root / "cluster",
                nodes=1,
                spares=0,
                port=0,
                database_url=postgres.url,
                redis_url=redis.url,
                schedulers=2,
                insecure=True,  # several schedulers: a local cluster of them runs insecure
                agent_owns_checkpointd=True,
                env={"PITSTOP_LEADER_LEASE_SECONDS": "1"},
                timeout=90,
            ) as running,
        ):
            yield running, postgres, redis
    finally:  # its stores' data and the cluster's state, one folder per run
        shutil.rmtree(root, ignore_errors=True)


def test_faults_of_the_chaos_run_on_a_two_scheduler_cluster(
    cluster: tuple[LocalCluster, OwnPostgres, OwnRedis],
) -> None:
    local, postgres, redis = cluster
    assert local.scheduler_target.startswith("ipv4:127.0.0.1:")
    leader = wait_until(
        local.leader, "a scheduler leads", TIMEOUT, poll=0.1, ignore=(ClusterError, PitstopError)
    )

    (first,) = local.daemon_pids("node-1", "checkpointd")
    os.kill(first, signal.SIGKILL)
    again = wait_until(
        lambda: [p for p in local.daemon_pids("node-1", "checkpointd") if p != first],
        "the agent started its checkpoint daemon again",
        TIMEOUT,
        poll=0.1,
        ignore=(ClusterError, PitstopError),
    )
    assert len(again) == 1

    address = local.process(leader).address
    local.kill_scheduler(leader)
    other = wait_until(
        lambda: local.leader() not in (None, leader) and local.leader(),
        "takeover",
        TIMEOUT,
        poll=0.1,
        ignore=(ClusterError, PitstopError),
    )
    assert other != leader
    local.start_scheduler(leader)
    assert local.process(leader).address == address
    assert local.process(leader).metrics

    postgres.restart()
    redis.flush_all()

    def ready() -> bool:
        (node,) = local.list_nodes()
        return node.connected and node.state == common_pb2.NODE_STATE_READY

    wait_until(
        ready,
        "node-1 ready after the restart and the flush",
        TIMEOUT,
        poll=0.1,
        ignore=(ClusterError, PitstopError),
    )

    local.kill_node("node-1")
    assert local.daemon_pids("node-1", "checkpointd") == []
    assert local.daemon_pids("node-1", "agent") == []
