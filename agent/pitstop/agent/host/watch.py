"""The agent's watch over its host: every heartbeat's look reads the host backend and
judges the reading against the ones kept of the last window (`pitstop.health.host`).

It keeps what the rules need between looks: the readings of the last flap window, and
each link's highest rate while up (a link is judged down only once seen up, and slow
only against a rate it ran at). Links the settings do not count (`host_links`: the
management NIC) are dropped before anything judges them.
"""

from __future__ import annotations

import fnmatch
import signal
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pitstop.agent.host.base import HostBackend
from pitstop.agent.host.kmsg import KernelLog
from pitstop.agent.host.sim import SimulatedHost
from pitstop.agent.host.sysfs import SysfsHost
from pitstop.health.host import HostThresholds, Timed, assess_host
from pitstop.v1 import common_pb2

if TYPE_CHECKING:
    from pitstop.agent.config import AgentSettings
    from pitstop.agent.gpu import GpuBackend

OOM_CAUSE = "the kernel killed it for memory (OOM)"


class HostWatch:
    """One node's host, read and judged; thread-safe (looks run in a worker thread)."""

    def __init__(
        self,
        backend: HostBackend,
        thresholds: HostThresholds | None = None,
        links: Sequence[str] = ("*/*",),
    ) -> None:
        self.backend = backend
        self.thresholds = thresholds or HostThresholds()
        self.links = tuple(links)
        self._lock = threading.Lock()
        self._earlier: deque[Timed] = deque()
        self._peaks: dict[str, float] = {}
        self.latest: common_pb2.HostHealth | None = None

    def look(self, now: float) -> common_pb2.HostHealth:
        """The host now (taken at `now`, seconds on any steady clock), judged."""
        reading = self.backend.read()
        kept = [link for link in reading.links if self._counts(link.name)]
        del reading.links[:]
        reading.links.extend(kept)
        with self._lock:
            window = self.thresholds.flap_window_seconds
            while self._earlier and now - self._earlier[0][0] > window:
                self._earlier.popleft()
            judged = assess_host(
                reading,
                now=now,
                earlier=list(self._earlier),
                seen_up=self._peaks,
                thresholds=self.thresholds,
            )
            self._earlier.append((now, reading))
            for link in reading.links:
                if link.up:
                    self._peaks[link.name] = max(self._peaks.get(link.name, 0.0), link.rate_gbps)
            self.latest = judged
        return judged

    def _counts(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.links)

    def exit_cause(self, pid: int, signum: int) -> str:
        """What ended process `pid`, killed by `signum`, where the host knows more than
        the signal: an OOM kill. "" otherwise."""
        if signum == signal.SIGKILL and self.backend.killed_for_memory(pid):
            return OOM_CAUSE
        return ""

    def close(self) -> None:
        self.backend.close()


def open_host_watch(settings: AgentSettings, gpu: GpuBackend) -> HostWatch | None:
    """The host watch the settings ask for (`host_backend`); None when it is off."""
    choice = settings.host_backend
    if choice == "off":
        return None
    if choice == "auto":
        choice = "sim" if gpu.name == "sim" else "sysfs"
    disks = settings.host_disk_paths or [settings.state_dir]
    backend: HostBackend
    if choice == "sim":
        backend = SimulatedHost(disk_paths=disks)
    else:
        backend = SysfsHost(
            disk_paths=disks,
            gpu_addresses=[g.pci_bus_id for g in gpu.inventory() if g.pci_bus_id],
            kernel_log=KernelLog.open(),
        )
    thresholds = HostThresholds(
        flap_window_seconds=settings.host_flap_window_seconds,
        flap_downs=settings.host_flap_downs,
        link_error_growth=settings.host_link_error_growth,
        pcie_correctable_growth=settings.host_pcie_correctable_growth,
        edac_corrected_growth=settings.host_edac_corrected_growth,
        memory_pressure_percent=settings.host_memory_pressure_percent,
        disk_free_fraction=settings.host_disk_free_fraction,
        disk_free_bytes=settings.host_disk_free_bytes,
    )
    return HostWatch(backend, thresholds, settings.host_links)
