"""The agent's preflight on simulated GPUs: what fails it, what it reports, and that it
checks an idle node only (pitstop.agent.preflight)."""

from __future__ import annotations

import asyncio

from pitstop.agent.gpu.sim import SimulatedBackend
from pitstop.agent.preflight import Preflight
from pitstop.v1 import agent_pb2, common_pb2


class Processes:
    """The supervisor's view the preflight reads: the processes running here. The loop
    asks it once an interval, so `stop` is set once it has been asked `looks` times."""

    def __init__(self) -> None:
        self.now: list[agent_pb2.RunningRank] = []
        self.looks = 0
        self.stop = asyncio.Event()

    def running(self) -> list[agent_pb2.RunningRank]:
        self.looks -= 1
        if self.looks <= 0:
            self.stop.set()
        return list(self.now)


def test_a_drilled_failure_fails_the_next_preflight_only_and_is_a_fatal_condition() -> None:
    backend = SimulatedBackend("n1", 2)
    changes: list[str] = []
    preflight = Preflight(backend, Processes(), 1.0, on_change=lambda: changes.append("x"))
    assert asyncio.run(preflight.check()) == ""
    assert preflight.conditions() == []
    backend.inject_fault(common_pb2.Fault(gpu_index=1, fail_preflight=True))
    assert "injected preflight failure" in asyncio.run(preflight.check())
    (condition,) = preflight.conditions()
    assert condition.verdict == common_pb2.HEALTH_VERDICT_FATAL
    assert condition.reason.startswith("preflight failed: ")
    assert asyncio.run(preflight.check()) == ""  # the drill fails one preflight
    assert changes == ["x", "x"]  # failed, then passed: each a heartbeat's news


def test_a_lost_gpu_fails_it_and_a_warning_does_not() -> None:
    backend = SimulatedBackend("n1", 2)
    preflight = Preflight(backend, Processes(), 1.0)
    backend.inject_fault(common_pb2.Fault(gpu_index=0, pending_row_remap=True))
    assert asyncio.run(preflight.check()) == ""  # the heartbeats drain it already
    backend.inject_fault(common_pb2.Fault(gpu_index=1, gpu_lost=True))
    assert "GPU 1" in asyncio.run(preflight.check())


def test_only_a_node_without_ranks_checks_itself() -> None:
    backend = SimulatedBackend("n1", 1)
    processes = Processes()
    preflight = Preflight(backend, processes, 0.01)

    def intervals(looks: int) -> int:
        """Run the loop for `looks` intervals; the preflights it ran."""
        before, processes.looks, processes.stop = preflight.runs, looks, asyncio.Event()
        asyncio.run(preflight.run(processes.stop))
        return preflight.runs - before

    # A standby touches no GPU: its node still checks itself, every interval.
    processes.now = [agent_pb2.RunningRank(job_id="j", standby=True)]
    assert intervals(3) == 3
    processes.now = [agent_pb2.RunningRank(job_id="j", rank=0)]
    backend.inject_fault(common_pb2.Fault(gpu_index=0, fail_preflight=True))
    assert intervals(10) == 0  # a rank runs: no preflight in ten intervals
    assert backend.take_preflight_fault()  # still waiting for the next idle preflight
