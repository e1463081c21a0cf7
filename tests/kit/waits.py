"""Poll a condition until it holds: the condition, not the time, ends the wait; the
timeout only bounds a wait that would never end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    what: str,
    timeout: float = 60.0,
    *,
    poll: float = 0.05,
    explain: Callable[[], str] | None = None,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll `condition` every `poll` s until it returns something true, and return that.
    Past `timeout` s it fails, saying `what` did not happen (and what `explain()` tells).
    An exception of a type in `ignore` counts as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except ignore:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{explain()}" if explain is not None else ""
            raise AssertionError(f"not within {timeout:g} s: {what}{detail}")
        time.sleep(poll)


async def until(
    condition: Callable[[], T],
    what: str,
    timeout: float = 60.0,
    *,
    poll: float = 0.05,
    in_thread: bool = False,
) -> T:
    """`wait_until` inside an event loop: the loop runs on between polls. With
    `in_thread`, a `condition` that blocks (a file, a process table, a gRPC call) runs in
    a thread of its own."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(condition) if in_thread else condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(poll)
