"""Loops that retry on errors must still stop when told to.

A driver may turn the cancellation it was interrupted by into an ordinary error (a
connection error from a query cut short). A loop that logs errors and retries would then
swallow its own cancellation and run on: a leader that lost its lease could never lead
again, its loops never ending. Every retrying loop calls `reraise_if_cancelling` in its
error handler.
"""

from __future__ import annotations

import asyncio


def reraise_if_cancelling() -> None:
    """Raise CancelledError when the current task was asked to stop (Task.cancelling),
    whatever error the interrupted call turned the cancellation into."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
