"""What goes wrong with a local cluster, said so that a person knows what to do."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pitstop.client.netns import NetnsError

_T = TypeVar("_T")
_TAIL_LINES = 20


class ClusterError(Exception):
    """Something about the local cluster went wrong; the message says what to do."""


class ClusterAlreadyRunning(ClusterError):
    """`up` found processes of an earlier `up` still running in the state dir."""


class ClusterStartError(ClusterError):
    """A daemon did not come up; the message ends with the tail of its log."""

    def __init__(self, message: str, log: Path | None = None, offset: int = 0) -> None:
        if log is not None:
            tail = log_tail(log, offset)
            message += (
                f"; its log {log} ends with:\n{tail}" if tail else f"; its log {log} is empty"
            )
        super().__init__(message)
        self.log = log


def log_tail(path: Path, offset: int = 0, lines: int = _TAIL_LINES) -> str:
    """The last lines of a log after byte `offset`, indented; empty when there are none."""
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(log.tell() - 16384, offset, 0))
            text = log.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(f"  {line}" for line in text.rstrip().splitlines()[-lines:])


def checked(action: Callable[[], _T]) -> _T:
    """`action()`, its NetnsError raised as a ClusterError."""
    try:
        return action()
    except NetnsError as exc:
        raise ClusterError(str(exc)) from exc
