"""OOM kills from the kernel log, followed live through `/dev/kmsg`.

Each read of `/dev/kmsg` returns one record: "<priority>,<sequence>,<microseconds>,
<flags>;<message>", then continuation lines (" SUBSYSTEM=...") the parser ignores. The
kernel reports an OOM kill (global or of a memory cgroup) as, for example::

    Out of memory: Killed process 4321 (python) total-vm:5432100kB, anon-rss:...
    Memory cgroup out of memory: Killed process 4321 (python) total-vm:...

and, on the same kill, an "oom-kill:constraint=...,task=python,pid=4321" line, which is
not counted again. Reading the log needs root or CAP_SYSLOG where
kernel.dmesg_restrict is set; without it the agent reports OOM kills as unsupported.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

_KILLED = re.compile(r"Killed process (?P<pid>\d+) \((?P<name>[^)]*)\)")

KMSG = Path("/dev/kmsg")


def oom_killed(record: str) -> str | None:
    """ "pid 4321 (python)" for a record of an OOM kill; None for any other record."""
    message = record.split(";", 1)[1] if ";" in record.split("\n", 1)[0] else record
    match = _KILLED.search(message.split("\n", 1)[0])
    return f"pid {match['pid']} ({match['name']})" if match else None


class KernelLog:
    """The kernel log from the moment it was opened: `oom_kills` drains what arrived."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def open(cls, path: Path = KMSG) -> KernelLog | None:
        """Follow `path` from its end; None where it cannot be read (not root, no
        CAP_SYSLOG, no such device)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        os.lseek(fd, 0, os.SEEK_END)
        return cls(fd)

    def fileno(self) -> int:
        """The descriptor, to poll for a record (-1 once closed)."""
        return -1 if self._fd is None else self._fd

    def oom_kills(self) -> list[str]:
        """The OOM kills logged since the last call, oldest first."""
        kills: list[str] = []
        while self._fd is not None:
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten before read: go on
                    continue
                raise
            if not record:
                break
            killed = oom_killed(record.decode("utf-8", "replace"))
            if killed:
                kills.append(killed)
        return kills

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
