"""Every drill of one node: a GPU fault goes to the GPU backend, a host fault to the
simulated host, as `pitstop node inject-fault` and the ranks' local socket send them.

Two host drills reach beyond the host's readings, as the real faults do:
- an OOM kill records the kill in the kernel's log (the simulated one) and then kills
  the rank on the fault's GPU with SIGKILL, as the kernel's OOM killer does;
- a link retrained at a lower rate slows the node's ranks in proportion (each GPU's
  step multiplier), as their collectives over it would be; back up at its rate, they
  step at full speed again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable

from pitstop.agent.gpu import GpuBackend
from pitstop.agent.gpu.base import FaultNotSupported
from pitstop.agent.host.base import HostBackend
from pitstop.agent.host.sim import RATE_GBPS, SimulatedHost
from pitstop.v1 import common_pb2

log = logging.getLogger(__name__)


class FaultInjector:
    """Injects a `common_pb2.Fault` on this node. `rank_pids(gpu_index)`: the pids of the
    ranks running on a GPU (the OOM drill's victims)."""

    def __init__(
        self,
        gpu: GpuBackend,
        host: HostBackend | None,
        rank_pids: Callable[[int], list[int]],
    ) -> None:
        self.gpu = gpu
        self.host = host
        self._rank_pids = rank_pids
        self._slowed = False

    def inject(self, fault: common_pb2.Fault) -> None:
        """Raises FaultNotSupported where this node's backends cannot, and ValueError for
        a fault that names no kind, a port or GPU the node lacks, or a bad count."""
        if fault.WhichOneof("kind") != "host":
            self.gpu.inject_fault(fault)
            return
        host = self.host
        if not isinstance(host, SimulatedHost):
            name = "no host backend" if host is None else f"the {host.name} host backend"
            raise FaultNotSupported(
                f"host faults are drilled on the simulated host; this node runs {name} "
                "(host_backend: sim)"
            )
        drill = fault.host
        kind = drill.WhichOneof("kind")
        if kind == "link_down":
            host.link_down(drill.link_down)
        elif kind == "link_up":
            host.link_up(drill.link_up)
            self._slow(1.0)
        elif kind == "link_flap":
            host.link_flap(drill.link_flap.port, drill.link_flap.count)
        elif kind == "link_errors":
            host.link_errors(drill.link_errors.port, drill.link_errors.count)
        elif kind == "link_degraded":
            rate = drill.link_degraded.rate_gbps
            host.link_degraded(drill.link_degraded.port, rate)
            self._slow(RATE_GBPS / rate)
        elif kind == "oom":
            self._oom_kill(host, fault.gpu_index)
        elif kind == "disk_full":
            host.disk_full(drill.disk_full)
        elif kind == "pcie_aer":
            host.pcie_aer(drill.pcie_aer)
        elif kind == "pcie_degraded":
            host.pcie_degraded()
        elif kind == "clear":
            host.clear()
            self._slow(1.0)
        elif kind == "edac_corrected":
            host.memory_errors(corrected=drill.edac_corrected)
        elif kind == "edac_uncorrected":
            host.memory_errors(uncorrected=drill.edac_uncorrected)
        elif kind == "memory_pressure_percent":
            host.memory_pressure(drill.memory_pressure_percent)
        elif kind == "disk_read_only":
            host.disk_read_only(drill.disk_read_only)
        elif kind == "pcie":
            _pcie(host, drill.pcie)
        else:
            raise ValueError("the host fault names no kind: set one of link_down .. clear")

    def _oom_kill(self, host: SimulatedHost, gpu_index: int) -> None:
        pids = self._rank_pids(gpu_index)
        if not pids:
            raise ValueError(f"no rank runs on GPU {gpu_index} for the OOM killer to kill")
        for pid in pids:
            host.oom_kill(pid, "python")
            log.warning("drill: the kernel kills pid %d for memory (OOM)", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _slow(self, multiplier: float) -> None:
        if multiplier == 1.0 and not self._slowed:
            return  # nothing slowed: leave each GPU's own slow drill alone
        for gpu in self.gpu.inventory():
            self.gpu.inject_fault(common_pb2.Fault(gpu_index=gpu.index, slow_multiplier=multiplier))
        self._slowed = multiplier != 1.0


def _pcie(host: SimulatedHost, fault: common_pb2.PcieFault) -> None:
    role = fault.role or "gpu"
    counts = [(s, getattr(fault, s)) for s in ("fatal", "nonfatal", "correctable")]
    if not fault.degraded and not any(n for _, n in counts):
        raise ValueError("the PCIe fault names nothing: give errors or degraded")
    for severity, count in counts:
        if count:
            host.pcie_aer(count, severity=severity, role=role)
    if fault.degraded:
        host.pcie_degraded(role)
