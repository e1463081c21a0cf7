"""The agent's host watch and its drills: readings judged over the window they keep, the
links the settings count, an OOM kill named as the cause of a rank's exit, and every
host fault `pitstop node inject-fault` sends carried out on the simulated host."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pitstop.agent.config import AgentSettings
from pitstop.agent.gpu.base import FaultNotSupported
from pitstop.agent.gpu.sim import SimulatedBackend
from pitstop.agent.host.drills import FaultInjector
from pitstop.agent.host.sim import SimulatedHost
from pitstop.agent.host.sysfs import SysfsHost
from pitstop.agent.host.watch import OOM_CAUSE, HostWatch, open_host_watch
from pitstop.health.host import HostThresholds
from pitstop.v1 import common_pb2

HEALTHY = common_pb2.HEALTH_VERDICT_HEALTHY
WARNING = common_pb2.HEALTH_VERDICT_WARNING
FATAL = common_pb2.HEALTH_VERDICT_FATAL


def test_a_flap_is_judged_within_the_window_and_forgotten_after_it() -> None:
    sim = SimulatedHost()
    watch = HostWatch(sim, HostThresholds(flap_window_seconds=30))
    assert watch.look(0).verdict == HEALTHY
    sim.link_flap("mlx5_1/1", 2)
    assert watch.look(10).verdict == HEALTHY  # two downs: not yet a flap
    sim.link_flap("mlx5_1/1", 1)
    judged = watch.look(20)
    assert judged.verdict == WARNING
    assert judged.reasons == ["infiniband link mlx5_1/1 flapped 3 times in 30 s"]
    assert watch.look(25).verdict == WARNING  # judged from t=0's reading, in the window
    assert watch.look(70).verdict == HEALTHY  # a quiet window later it is history


def test_only_a_link_seen_up_is_judged_down_and_uncounted_links_are_not_read() -> None:
    sim = SimulatedHost(ports=("mlx5_0/1", "mlx5_1/1"))
    sim.link_down("mlx5_1/1")  # never cabled: down from the first reading on
    watch = HostWatch(sim, links=["mlx5_0/*", "mlx5_1/*"])
    assert watch.look(0).verdict == HEALTHY
    sim.link_down("mlx5_0/1")
    judged = watch.look(1)
    assert judged.verdict == FATAL
    assert judged.reasons == ["infiniband link mlx5_0/1 is down"]
    only_the_first = HostWatch(SimulatedHost(), links=["mlx5_0/*"])
    assert [link.name for link in only_the_first.look(0).links] == ["mlx5_0/1"]


def test_a_rank_killed_for_memory_is_named_so_and_any_other_kill_is_not() -> None:
    sim = SimulatedHost()
    watch = HostWatch(sim)
    sim.oom_kill(4321, "python")
    assert watch.exit_cause(4321, signal.SIGKILL) == OOM_CAUSE
    assert watch.exit_cause(4322, signal.SIGKILL) == ""  # another process
    assert watch.exit_cause(4321, signal.SIGTERM) == ""  # the OOM killer sends SIGKILL


def test_the_settings_choose_the_backend_and_carry_the_thresholds(tmp_path: Path) -> None:
    gpu = SimulatedBackend("node-a", 1)
    settings = AgentSettings(
        gpus="sim:1", state_dir=tmp_path, host_flap_downs=5, host_links=["*/*", "eth1"]
    )
    watch = open_host_watch(settings, gpu)
    assert watch is not None
    assert isinstance(watch.backend, SimulatedHost)
    assert watch.backend.disk_paths == [tmp_path]  # no disk named: the state directory
    assert watch.thresholds.flap_downs == 5
    assert watch.links == ("*/*", "eth1")
    real = open_host_watch(settings.model_copy(update={"host_backend": "sysfs"}), gpu)
    assert real is not None
    assert isinstance(real.backend, SysfsHost)
    real.close()
    assert open_host_watch(settings.model_copy(update={"host_backend": "off"}), gpu) is None


def _injector(host: SimulatedHost | None = None, pids: list[int] | None = None) -> FaultInjector:
    return FaultInjector(SimulatedBackend("node-a", 2), host, lambda gpu: list(pids or []))


def _host(**kind: object) -> common_pb2.Fault:
    return common_pb2.Fault(host=common_pb2.HostFault(**kind))  # type: ignore[arg-type]


def test_every_host_drill_reaches_the_simulated_host() -> None:
    sim = SimulatedHost()
    faults = _injector(sim)
    faults.inject(_host(link_flap=common_pb2.PortCount(port="mlx5_0/1", count=4)))
    faults.inject(_host(link_errors=common_pb2.PortCount(port="mlx5_1/1", count=7)))
    faults.inject(_host(pcie_aer=2))
    faults.inject(_host(pcie_degraded=True))
    faults.inject(_host(link_down="mlx5_1/1"))
    reading = sim.read()
    assert [(link.up, link.down_count, link.error_count) for link in reading.links] == [
        (True, 4, 0),
        (False, 1, 7),
    ]
    gpu = next(d for d in reading.pcie if d.role == "gpu")
    assert (gpu.aer_fatal, gpu.link_width) == (2, 8)
    faults.inject(_host(edac_corrected=150))
    faults.inject(_host(edac_uncorrected=1))
    faults.inject(_host(memory_pressure_percent=35.0))
    faults.inject(_host(pcie=common_pb2.PcieFault(role="nic", nonfatal=2, correctable=9)))
    faults.inject(_host(pcie=common_pb2.PcieFault(role="nic", degraded=True)))
    reading = sim.read()
    memory = reading.memory
    assert (memory.edac_corrected, memory.edac_uncorrected) == (150, 1)
    assert memory.pressure_full_avg10 == 35.0
    nic = next(d for d in reading.pcie if d.role == "nic")
    assert (nic.aer_nonfatal, nic.aer_correctable, nic.aer_fatal) == (2, 9, 0)
    assert (nic.link_width, nic.link_speed_gts) == (8, 16.0)
    faults.inject(_host(clear=True))
    assert all(link.up for link in sim.read().links)
    assert sim.read().memory.pressure_full_avg10 == 0
    with pytest.raises(ValueError, match="the PCIe fault names nothing"):
        faults.inject(_host(pcie=common_pb2.PcieFault(role="nic")))
    with pytest.raises(ValueError, match="reads no disk"):
        faults.inject(_host(disk_read_only=True))
    with pytest.raises(ValueError, match="port 'ib9/1'"):
        faults.inject(_host(link_down="ib9/1"))
    with pytest.raises(ValueError, match="names no kind"):
        faults.inject(_host())


def test_a_slower_link_slows_every_rank_of_the_node_until_it_is_back() -> None:
    sim = SimulatedHost()
    faults = _injector(sim)
    gpus = faults.gpu
    faults.inject(_host(link_degraded=common_pb2.PortRate(port="mlx5_0/1", rate_gbps=100)))
    assert [gpus.slow_multiplier(i) for i in (0, 1)] == [4.0, 4.0]
    faults.inject(_host(link_up="mlx5_0/1"))
    assert [gpus.slow_multiplier(i) for i in (0, 1)] == [1.0, 1.0]
    # A GPU slowed by its own drill stays slow when a link comes up that was never slow.
    gpus.inject_fault(common_pb2.Fault(gpu_index=1, slow_multiplier=3.0))
    faults.inject(_host(link_up="mlx5_0/1"))
    assert gpus.slow_multiplier(1) == 3.0


def test_the_oom_drill_kills_the_rank_on_the_gpu_and_the_kill_is_on_record() -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sim = SimulatedHost()
        faults = _injector(sim, [victim.pid])
        faults.inject(common_pb2.Fault(gpu_index=0, host=common_pb2.HostFault(oom=True)))
        assert victim.wait(timeout=10) == -signal.SIGKILL
        assert HostWatch(sim).exit_cause(victim.pid, signal.SIGKILL) == OOM_CAUSE
        assert sim.read().memory.oom_kills == 1
    finally:
        victim.kill()
        victim.wait()
    with pytest.raises(ValueError, match="no rank runs on GPU 1"):
        _injector(SimulatedHost()).inject(
            common_pb2.Fault(gpu_index=1, host=common_pb2.HostFault(oom=True))
        )


def test_host_drills_need_the_simulated_host_and_gpu_faults_go_to_the_gpus() -> None:
    with pytest.raises(FaultNotSupported, match="this node runs no host backend"):
        _injector(None).inject(_host(disk_full=True))
    real = FaultInjector(SimulatedBackend("node-a", 1), SysfsHost(root=Path("/nonexistent")), list)
    with pytest.raises(FaultNotSupported, match="the sysfs host backend"):
        real.inject(_host(pcie_aer=1))
    faults = _injector(SimulatedHost())
    faults.inject(common_pb2.Fault(gpu_index=1, slow_multiplier=2.0))
    assert faults.gpu.slow_multiplier(1) == 2.0
