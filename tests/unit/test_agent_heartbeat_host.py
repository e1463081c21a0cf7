"""The host in every heartbeat: its verdict folded into the node's, its reasons after
the GPUs', and a host read that hangs (a stuck NFS mount under a watched path) never
holding the heartbeat that liveness hangs on."""

from __future__ import annotations

import threading
import time

import pytest

from pitstop.agent import heartbeats
from pitstop.agent.config import AgentSettings
from pitstop.agent.gpu.sim import SimulatedBackend
from pitstop.agent.heartbeats import Heartbeats
from pitstop.agent.host.sim import SimulatedHost
from pitstop.agent.host.watch import HostWatch
from pitstop.agent.metrics import AgentMetrics
from pitstop.v1 import agent_pb2, common_pb2

NODE = "node-h"


class NoRanks:
    def running(self) -> list[agent_pb2.RunningRank]:
        return []

    def kill_gpu(self, gpu_index: int, reason: str) -> list[tuple[str, int]]:
        return []


class NoSteps:
    pending = 0
    dropped = 0

    def drain(self, due: bool = True) -> list[agent_pb2.StepSummary]:
        return []

    def forget_idle(self, active: object, now: float) -> list[str]:
        return []


class StuckHost(SimulatedHost):
    """Reads once, then blocks until released: a statvfs on a hung mount."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.reads = 0

    def read(self) -> common_pb2.HostHealth:
        self.reads += 1
        if self.reads > 1:
            self.release.wait(30)
        return super().read()


def beats(host: SimulatedHost) -> Heartbeats:
    return Heartbeats(
        AgentSettings(node_id=NODE, gpus="sim:1"),
        SimulatedBackend(NODE, 1),
        NoRanks(),
        NoSteps(),
        AgentMetrics(NODE),
        send=lambda **_: None,
        clock=time.time,
        host=HostWatch(host),
    )


async def test_the_hosts_verdict_and_reasons_are_the_nodes() -> None:
    host = SimulatedHost()
    heartbeat = beats(host)
    assert (await heartbeat._look()).health.verdict == common_pb2.HEALTH_VERDICT_HEALTHY
    host.pcie_aer(1)
    health = (await heartbeat._look()).health
    assert health.verdict == common_pb2.HEALTH_VERDICT_FATAL
    assert list(health.reasons) == ["PCIe gpu 0000:17:00.0: 1 new fatal AER errors"]
    assert health.host.reasons == health.reasons
    assert [link.name for link in health.host.links] == ["mlx5_0/1", "mlx5_1/1"]


async def test_a_stuck_host_read_is_reported_and_never_holds_the_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(heartbeats, "HOST_READ_SECONDS", 0.2)
    host = StuckHost()
    heartbeat = beats(host)
    try:
        await heartbeat._look()  # the first read answers
        for _ in range(3):
            began = time.monotonic()
            health = (await heartbeat._look()).health
            assert time.monotonic() - began < 5
            assert health.verdict == common_pb2.HEALTH_VERDICT_DEGRADED
            assert health.reasons[-1] == "reading the host's health took over 0.2 s"
            assert len(health.host.links) == 2  # the last reading, kept
        assert host.reads == 2  # one stuck read, never a second beside it
    finally:
        host.release.set()
    health = (await heartbeat._look()).health  # the stuck read ends: news again
    assert health.verdict == common_pb2.HEALTH_VERDICT_HEALTHY
