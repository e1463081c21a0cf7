"""Signals that end a program the orderly way: its ``finally`` blocks run, so a local
cluster, a load generator or a reference run it started is stopped, not orphaned.

Python's default SIGTERM and SIGHUP end the process at once, skipping every
``finally``; :func:`orderly_exit` turns them into :class:`Terminated`, raised in the main
thread like the KeyboardInterrupt of SIGINT. Once one has arrived, later ones are
noted and ignored: a second Ctrl-C must not cut short the shutdown the first one began
(each step of which has its own deadline).

>>> with orderly_exit():  # doctest: +SKIP
...     with LocalCluster.up(...) as cluster:
...         ...  # SIGTERM here: the cluster goes down, then Terminated propagates
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

ORDERLY_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived under :func:`orderly_exit`. A BaseException, like
    KeyboardInterrupt, so ``except Exception`` does not swallow it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        """The shell's convention for a death by this signal: 128 + its number."""
        return 128 + self.signum


def exit_code(error: BaseException) -> int:
    """128 + the signal's number for Terminated and KeyboardInterrupt (SIGINT); 1 else."""
    if isinstance(error, Terminated):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


def _say_on_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextmanager
def orderly_exit(notice: Callable[[str], None] = _say_on_stderr) -> Iterator[None]:
    """Inside the block, the first SIGINT raises KeyboardInterrupt and the first SIGTERM
    or SIGHUP raises :class:`Terminated`, in the main thread; any later one only calls
    `notice` with a line saying the shutdown goes on. The previous handlers come back
    when the block ends. Only from the main thread (Python runs handlers there)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("orderly_exit() installs signal handlers: call it in the main thread")
    arrived: list[int] = []

    def handle(signum: int, _frame: FrameType | None) -> None:
        if arrived:
            notice(
                f"{signal.Signals(signum).name} again: still shutting down after "
                f"{signal.Signals(arrived[0]).name}; every step has a deadline"
            )
            return
        arrived.append(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, handle) for sig in ORDERLY_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# Run a command that dies with this process, even one killed by SIGKILL. Linux keeps the
# parent-death signal across execve; the ppid check covers a parent that died before
# prctl ran. Elsewhere the command simply runs.
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
except (AttributeError, OSError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def dying_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` wrapped so that its process is killed (SIGKILL) when this one dies, whatever
    kills it. Start it from a thread that outlives it: Linux sends the signal when the
    thread that forked the child ends."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]
