"""The Python stacks of a rank process that hangs, for the scheduler's hang incident.

py-spy reads another process's stacks from outside without stopping it for longer than
a sample (it needs ptrace: the agent's user, or CAP_SYS_PTRACE in a container). Where it
is missing or cannot attach, the rank's own faulthandler (pitstop.trainer registers it
for SIGUSR1 on every rank it runs) writes every thread's stack to the rank's log, and
the new part of the log is the answer. Everything here blocks: call it from a thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PY_SPY_SECONDS = 15.0
"""The longest py-spy may take over one process."""
FAULTHANDLER_SECONDS = 3.0
"""The longest a rank's faulthandler gets to write its stacks to the log."""
FAULTHANDLER_SIGNAL = signal.SIGUSR1
MAX_TEXT = 60_000
"""Characters of stacks kept per rank (the innermost frames come first in both tools)."""


@dataclass(frozen=True)
class Stacks:
    method: str  # "py-spy" or "faulthandler"; "" when neither answered
    text: str
    error: str = ""


def py_spy() -> str | None:
    """The py-spy executable: beside this Python (a virtual environment), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def take(pid: int, log_path: Path | None) -> Stacks:
    """Every thread's stack of process `pid`, by py-spy, else by its faulthandler into
    `log_path`."""
    errors = []
    tool = py_spy()
    if tool is None:
        errors.append("py-spy is not installed")
    else:
        try:
            done = subprocess.run(
                [tool, "dump", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=PY_SPY_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired:
            errors.append(f"py-spy took over {PY_SPY_SECONDS:.0f} s")
        else:
            if done.returncode == 0 and done.stdout.strip():
                return Stacks("py-spy", done.stdout[:MAX_TEXT])
            errors.append(f"py-spy: {(done.stderr or done.stdout).strip()[-300:]}")
    if log_path is not None:
        written = _faulthandler(pid, log_path)
        if written:
            return Stacks("faulthandler", written[:MAX_TEXT])
        errors.append(f"no faulthandler output in {log_path}")
    return Stacks("", "", "; ".join(errors))


def _faulthandler(pid: int, log_path: Path) -> str:
    """Signal the rank's faulthandler and read what it appended to its log, once the
    log stops growing (or FAULTHANDLER_SECONDS passed)."""
    try:
        start = log_path.stat().st_size
        os.kill(pid, FAULTHANDLER_SIGNAL)
    except OSError as exc:
        log.warning("faulthandler of pid %d: %s", pid, exc)
        return ""
    deadline = time.monotonic() + FAULTHANDLER_SECONDS
    size, steady = start, 0
    while time.monotonic() < deadline and steady < 3:
        time.sleep(0.05)  # the rank writes on its own; its log is all there is to watch
        now = log_path.stat().st_size
        steady = steady + 1 if now == size and now > start else 0
        size = now
    with log_path.open("rb") as file:
        file.seek(start)
        return file.read(MAX_TEXT).decode(errors="replace")
