"""The simulated host backend: a node of the local cluster, with every host fault the
real backend can report injectable (the drills of `pitstop node inject-fault`).

It starts healthy: two InfiniBand ports at 400 Gb/s, a quiet memory, and a GPU and a
NIC on full PCIe links. Its disks are real: the daemons' paths it is given are read as
the real backend reads them (a full filesystem under a daemon is a full filesystem on
any host). Each injection changes the readings as the kernel's would change: a flap
grows a port's link_downed counter and leaves it up, `disk_full` shows no byte free on
every disk, an AER error grows its TOTAL_ERR_* count.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from pitstop.agent.host.base import HostBackend
from pitstop.agent.host.sysfs import read_disk
from pitstop.v1 import common_pb2

RATE_GBPS = 400.0
PCIE_GEN5_GTS = 32.0


class SimulatedHost(HostBackend):
    name = "sim"

    def __init__(
        self, ports: Sequence[str] = ("mlx5_0/1", "mlx5_1/1"), disk_paths: Sequence[Path] = ()
    ) -> None:
        self._lock = threading.Lock()
        self.disk_paths = list(disk_paths)
        self._disk_full = False
        self._read_only = False
        self._recent_kills: deque[str] = deque(maxlen=256)
        self._reading = common_pb2.HostHealth(
            links=[
                common_pb2.LinkReading(name=port, kind="infiniband", up=True, rate_gbps=RATE_GBPS)
                for port in ports
            ],
            memory=common_pb2.MemoryReading(),
            pcie=[
                common_pb2.PcieDeviceReading(
                    address=address,
                    role=role,
                    link_width=16,
                    link_width_max=16,
                    link_speed_gts=PCIE_GEN5_GTS,
                    link_speed_gts_max=PCIE_GEN5_GTS,
                )
                for address, role in (("0000:17:00.0", "gpu"), ("0000:18:00.0", "nic"))
            ],
        )

    def read(self) -> common_pb2.HostHealth:
        disks = [d for d in map(read_disk, self.disk_paths) if d is not None]
        with self._lock:
            copy = common_pb2.HostHealth()
            copy.CopyFrom(self._reading)
            for disk in disks:
                if self._disk_full:
                    disk.free_bytes = 0
                disk.read_only = disk.read_only or self._read_only
            copy.disks.extend(disks)
            return copy

    def recent_oom_kills(self) -> list[str]:
        with self._lock:
            return list(self._recent_kills)

    def link_down(self, port: str) -> None:
        with self._lock:
            link = self._link(port)
            link.up, link.rate_gbps = False, 0.0
            link.down_count += 1

    def link_up(self, port: str) -> None:
        with self._lock:
            link = self._link(port)
            link.up, link.rate_gbps = True, RATE_GBPS

    def link_flap(self, port: str, count: int) -> None:
        """`count` downs, each back up at once: the counter grows, the state is up."""
        _positive("count", count)
        with self._lock:
            self._link(port).down_count += count

    def link_errors(self, port: str, count: int) -> None:
        _positive("count", count)
        with self._lock:
            self._link(port).error_count += count

    def link_degraded(self, port: str, rate_gbps: float) -> None:
        """The port retrained at a lower rate (a lane lost: 4X to 2X)."""
        if not 0 < rate_gbps < RATE_GBPS:
            raise ValueError(
                f"rate_gbps {rate_gbps:g}: give a rate between 0 and {RATE_GBPS:g} Gb/s"
            )
        with self._lock:
            self._link(port).rate_gbps = rate_gbps

    def oom_kill(self, pid: int, name: str) -> None:
        with self._lock:
            memory = self._reading.memory
            memory.oom_kills += 1
            memory.last_oom_killed = f"pid {pid} ({name})"
            self._recent_kills.append(memory.last_oom_killed)

    def disk_full(self, full: bool = True) -> None:
        """No byte free on the daemons' disks, as read; `full=False` reads them as they
        are. (The daemons themselves see the real filesystem: the checkpoint daemon's
        own refusal is drilled by filling one, as the fault matrix does on a tmpfs.)"""
        if full and not self.disk_paths:
            raise ValueError("this node reads no disk: set host_disk_paths in its agent config")
        with self._lock:
            self._disk_full = full

    def clear(self) -> None:
        """Every injected fault undone: links up at their full rate, the disks read as
        they are, full PCIe links, no memory pressure. Counters keep their counts, as
        the kernel's do."""
        with self._lock:
            for link in self._reading.links:
                link.up, link.rate_gbps = True, RATE_GBPS
            for device in self._reading.pcie:
                device.link_width = device.link_width_max
                device.link_speed_gts = device.link_speed_gts_max
            self._reading.memory.pressure_full_avg10 = 0.0
            self._disk_full = self._read_only = False

    def pcie_aer(self, count: int, *, severity: str = "fatal", role: str = "gpu") -> None:
        """`count` new AER errors of `severity` (fatal, nonfatal or correctable)."""
        _positive("count", count)
        if severity not in ("fatal", "nonfatal", "correctable"):
            raise ValueError(f"severity {severity!r}: give fatal, nonfatal or correctable")
        with self._lock:
            device = self._device(role)
            field = f"aer_{severity}"
            setattr(device, field, getattr(device, field) + count)

    def pcie_degraded(self, role: str = "gpu") -> None:
        """The device's link retrained at half its width (a NIC's also at half its
        speed: a GPU lowers its speed by itself when idle, which is no fault)."""
        with self._lock:
            device = self._device(role)
            device.link_width = device.link_width_max // 2
            if role == "nic":
                device.link_speed_gts = device.link_speed_gts_max / 2

    def memory_errors(self, corrected: int = 0, uncorrected: int = 0) -> None:
        """New corrected and uncorrected memory errors, as EDAC counts them."""
        if corrected < 0 or uncorrected < 0 or not corrected + uncorrected:
            raise ValueError(
                f"corrected {corrected}, uncorrected {uncorrected}: give 1 or more of either"
            )
        with self._lock:
            self._reading.memory.edac_corrected += corrected
            self._reading.memory.edac_uncorrected += uncorrected

    def memory_pressure(self, percent: float) -> None:
        """PSI's "full avg10" reads `percent` (0: no pressure)."""
        if not 0 <= percent <= 100:
            raise ValueError(f"memory pressure {percent:g}%: give 0 to 100")
        with self._lock:
            self._reading.memory.pressure_full_avg10 = percent

    def disk_read_only(self, read_only: bool = True) -> None:
        """The daemons' disks read as remounted read-only (after an I/O error)."""
        if read_only and not self.disk_paths:
            raise ValueError("this node reads no disk: set host_disk_paths in its agent config")
        with self._lock:
            self._read_only = read_only

    def _link(self, port: str) -> common_pb2.LinkReading:
        for link in self._reading.links:
            if link.name == port:
                return link
        names = ", ".join(link.name for link in self._reading.links)
        raise ValueError(f"port {port!r}: this node has {names}")

    def _device(self, role: str) -> common_pb2.PcieDeviceReading:
        for device in self._reading.pcie:
            if device.role == role:
                return device
        raise ValueError(f"role {role!r}: give gpu or nic")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} {value}: give 1 or more")
