"""The host backend interface: what the agent reads of a node beyond its GPUs.

A backend reports raw readings only (links, memory, disks, PCIe devices); the verdict
comes from `pitstop.health.host`, so the same rules judge a real host and a simulated
one. Real on a Linux host (`sysfs.SysfsHost`), simulated in the local cluster
(`sim.SimulatedHost`), where faults are injected.
"""

from __future__ import annotations

import abc
import re

from pitstop.v1 import common_pb2

_PID = re.compile(r"pid (\d+)")


class HostBackend(abc.ABC):
    """One node's host: its readings, and on the simulated backend its injected faults."""

    name: str
    """"sysfs" or "sim"."""

    @abc.abstractmethod
    def read(self) -> common_pb2.HostHealth:
        """The host's readings now, verdict and reasons unset; sources it lacks named in
        `unsupported`. Reads files and may take milliseconds: call it from a thread."""

    @abc.abstractmethod
    def recent_oom_kills(self) -> list[str]:
        """The OOM kills this backend saw lately (at most the last 256), oldest first, as
        "pid 4321 (python)", new ones read first: what `killed_for_memory` looks in.
        Cheap enough to call at every rank's exit."""

    def killed_for_memory(self, pid: int) -> bool:
        """Whether the kernel killed process `pid` for memory (an OOM kill it logged)."""
        return any(
            (m := _PID.match(kill)) is not None and int(m.group(1)) == pid
            for kill in self.recent_oom_kills()
        )

    def close(self) -> None:  # noqa: B027 (a backend with nothing to release)
        """Release what the backend holds (the kernel log). Idempotent."""
