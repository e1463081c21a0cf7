"""A bounded CPU load: busy processes beside a local cluster, to try it on a loaded
machine (a shared CI runner, a laptop compiling). Each process spins one core until its
time is up, until it is stopped, or until the process that started it dies (even by
SIGKILL), so a load can never outlive what it was for.

>>> from pitstop.client.cpuload import cpu_load
>>> with cpu_load(procs=2, seconds=600):  # doctest: +SKIP
...     run_the_fault_tests()

From the command line: ``python scripts/cpuload.py --procs 2 --seconds 600``; beside the
demo: ``scripts/demo.py --load 2`` (``make demo-load``). Tests read the number of busy
processes from ``PITSTOP_TEST_CPU_LOAD`` with :func:`cpu_load_from_env` (unset or 0: no
load).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Self

MAX_SECONDS = 2 * 3600.0
"""The longest a load may run: a forgotten one ends by itself."""
MAX_PROCS = 64
DEFAULT_PROCS = 2
ENV = "PITSTOP_TEST_CPU_LOAD"
"""Busy processes for the tests that honour it (e.g. ``PITSTOP_TEST_CPU_LOAD=2``)."""
STOP_TIMEOUT = 5.0

# One busy process. SIGTERM ends it (the default action); SIGINT is the parent's to act
# on (Ctrl-C in a terminal reaches the whole foreground group). It dies with its parent:
# Linux's parent-death signal, and a ppid check between bursts of ~10 ms elsewhere.
_BUSY = """\
# pitstop cpuload: one busy process
import ctypes, os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
except (AttributeError, OSError):
    pass
deadline = time.monotonic() + float(sys.argv[1])
parent = int(sys.argv[2])
spins = 0
while os.getppid() == parent and time.monotonic() < deadline:
    for _ in range(100_000):
        spins += 1
"""


class CpuLoadError(ValueError):
    """A load asked for is out of bounds; the message names the value and the limit."""


def check_bounds(procs: int, seconds: float) -> None:
    """CpuLoadError unless 0 ≤ `procs` ≤ MAX_PROCS and 0 < `seconds` ≤ MAX_SECONDS."""
    if not 0 <= procs <= MAX_PROCS:
        raise CpuLoadError(f"procs {procs}: give 0 to {MAX_PROCS} busy processes")
    if not 0 < seconds <= MAX_SECONDS:
        raise CpuLoadError(
            f"seconds {seconds:g}: give more than 0 and at most {MAX_SECONDS:.0f} "
            f"({MAX_SECONDS / 3600:.0f} h)"
        )


class CpuLoad:
    """`procs` busy processes for at most `seconds`. A context manager: started on
    entry, stopped (SIGTERM, then SIGKILL) on exit, however the block ends. Start it
    from the main thread, or from one that outlives it: Linux's parent-death signal
    follows the thread that started each process."""

    def __init__(self, procs: int = DEFAULT_PROCS, seconds: float = MAX_SECONDS) -> None:
        check_bounds(procs, seconds)
        self.procs = procs
        self.seconds = seconds
        self._children: list[subprocess.Popen[bytes]] = []

    @property
    def pids(self) -> list[int]:
        """The busy processes started (alive or not)."""
        return [child.pid for child in self._children]

    def running(self) -> list[int]:
        """The busy processes still alive."""
        return [child.pid for child in self._children if child.poll() is None]

    def start(self) -> Self:
        """Start the busy processes (again, if they had ended)."""
        self.stop()
        try:
            for _ in range(self.procs):
                self._children.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _BUSY, repr(self.seconds), str(os.getpid())],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        except BaseException:
            self.stop()
            raise
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every busy process has ended (its time is up), or `timeout` s;
        whether they all ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for child in self._children:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                child.wait(left)
            except subprocess.TimeoutExpired:
                return False
        return True

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM every busy process, SIGKILL those alive `timeout` s later; reaps them."""
        for child in self._children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in self._children:
            try:
                child.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self._children = []

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def cpu_load(procs: int = DEFAULT_PROCS, seconds: float = MAX_SECONDS) -> CpuLoad:
    """`procs` busy processes for at most `seconds` s, as a context manager."""
    return CpuLoad(procs, seconds)


def procs_from_env(env: Mapping[str, str] | None = None, name: str = ENV) -> int:
    """The number of busy processes `name` asks for: 0 when unset or empty;
    CpuLoadError when it is not a whole number from 0 to MAX_PROCS."""
    value = (os.environ if env is None else env).get(name, "").strip()
    if not value:
        return 0
    try:
        procs = int(value)
    except ValueError:
        raise CpuLoadError(
            f"{name}={value!r}: give the number of busy processes, e.g. {name}=2"
        ) from None
    try:
        check_bounds(procs, MAX_SECONDS)
    except CpuLoadError as exc:
        raise CpuLoadError(f"{name}={value!r}: {exc}") from None
    return procs


def cpu_load_from_env(
    env: Mapping[str, str] | None = None, seconds: float = MAX_SECONDS, name: str = ENV
) -> CpuLoad:
    """The load ``PITSTOP_TEST_CPU_LOAD`` asks for (none when unset or 0), as a context
    manager: ``with cpu_load_from_env(): ...`` in a fixture or a test."""
    return CpuLoad(procs_from_env(env, name), seconds)
