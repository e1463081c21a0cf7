"""The host backend interface: what the agent reads of a node beyond its GPUs.

A backend reports raw readings only (links, memory, disks, PCIe devices); the verdict
comes from `pitstop.health.host`, so the same rules judge a real host and a simulated
one. Real on a Linux host (`sysfs.SysfsHost`), simulated in the local cluster
(`sim.SimulatedHost`), where faults are injected.
"""

from __future__ import annotations

import abc

from pitstop.v1 import common_pb2


class HostBackend(abc.ABC):
    """One node's host: its readings, and on the simulated backend its injected faults."""

    name: str
    """"sysfs" or "sim"."""

    @abc.abstractmethod
    def read(self) -> common_pb2.HostHealth:
        """The host's readings now, verdict and reasons unset; sources it lacks named in
        `unsupported`. Reads files and may take milliseconds: call it from a thread."""

    def close(self) -> None:  # noqa: B027 (a backend with nothing to release)
        """Release what the backend holds (the kernel log). Idempotent."""
