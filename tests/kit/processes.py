"""Processes a test started: stopping one for sure, whether one runs, which run."""

from __future__ import annotations

import os
import queue
import subprocess
import time
from pathlib import Path
from typing import Any

from pitstop.client.localcluster import pid_alive


def terminate(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, and SIGKILL after 30 s: a process that will not stop is not left running
    after the test."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def running(pid: int) -> bool:
    """Whether `pid` runs; a zombie (reaped late by a container's init) does not."""
    return pid_alive(pid)


def processes_under(root: Path) -> list[int]:
    """Every live process whose command line names a path under `root`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdecimal() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(str(root).encode() in arg for arg in argv) and running(int(entry.name)):
            found.append(int(entry.name))
    return found


def line_with(lines: queue.Queue[str], text: str, deadline: float, never: str) -> str:
    """The next line from `lines` (a reader thread fills it from a process's output) that
    holds `text`; AssertionError `never` once the monotonic `deadline` passes."""
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(never) from None
        if text in line:
            return line
