"""The simulated host backend: a node of the local cluster, with every host fault the
real backend can report injectable (the drills of `pitstop node inject-fault`).

It starts healthy: two InfiniBand ports at 400 Gb/s, a quiet memory, the daemons' disk
with room, and a GPU and a NIC on full PCIe links. Each injection changes the readings
as the kernel's would change: a flap grows a port's link_downed counter and leaves it
up, a full disk shows no bytes free, an AER error grows its TOTAL_ERR_* count.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pitstop.agent.host.base import HostBackend
from pitstop.v1 import common_pb2

RATE_GBPS = 400.0
PCIE_GEN5_GTS = 32.0


class SimulatedHost(HostBackend):
    name = "sim"

    def __init__(
        self, ports: Sequence[str] = ("mlx5_0/1", "mlx5_1/1"), disk: str = "/var/lib/pitstop"
    ) -> None:
        self._lock = threading.Lock()
        self._reading = common_pb2.HostHealth(
            links=[
                common_pb2.LinkReading(name=port, kind="infiniband", up=True, rate_gbps=RATE_GBPS)
                for port in ports
            ],
            memory=common_pb2.MemoryReading(),
            disks=[
                common_pb2.DiskReading(
                    path=disk,
                    free_bytes=800 << 30,
                    total_bytes=1 << 40,
                    free_inodes=60_000_000,
                    total_inodes=64_000_000,
                )
            ],
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
        with self._lock:
            copy = common_pb2.HostHealth()
            copy.CopyFrom(self._reading)
            return copy

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

    def disk_full(self, full: bool = True) -> None:
        """No byte free on the daemons' disk; `full=False` gives its room back."""
        with self._lock:
            disk = self._reading.disks[0]
            disk.free_bytes = 0 if full else 800 << 30

    def pcie_aer(self, count: int, *, fatal: bool = True, role: str = "gpu") -> None:
        _positive("count", count)
        with self._lock:
            device = self._device(role)
            if fatal:
                device.aer_fatal += count
            else:
                device.aer_correctable += count

    def pcie_degraded(self, role: str = "gpu") -> None:
        """The device's link retrained at half its width."""
        with self._lock:
            device = self._device(role)
            device.link_width = device.link_width_max // 2

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
