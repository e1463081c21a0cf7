"""A retrying loop stops when cancelled, even when the call it interrupted turned the
cancellation into an ordinary error (as a database driver cut short mid-query may)."""

from __future__ import annotations

import asyncio

import pytest

from pitstop.scheduler.cancelling import reraise_if_cancelling


async def _driver_call() -> None:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        raise ConnectionError("the query was cut short") from None


async def _retrying(entered: asyncio.Event, passes: list[int], *, guard: bool) -> None:
    while not (passes and passes[-1] == 0):  # a 0 appended: stop (the unguarded case)
        passes.append(1)
        entered.set()
        try:
            await _driver_call()
        except Exception:
            if guard:
                reraise_if_cancelling()
        await asyncio.sleep(0)


async def test_a_loop_whose_call_swallows_the_cancellation_still_stops() -> None:
    entered, passes = asyncio.Event(), list[int]()
    loop = asyncio.create_task(_retrying(entered, passes, guard=True))
    await entered.wait()
    loop.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(loop, 5)
    assert passes == [1]


async def test_without_the_guard_the_same_loop_runs_on_after_its_cancel() -> None:
    entered, passes = asyncio.Event(), list[int]()
    loop = asyncio.create_task(_retrying(entered, passes, guard=False))
    await entered.wait()
    entered.clear()
    loop.cancel()
    await asyncio.wait_for(entered.wait(), 5)  # it went round again, cancel swallowed
    assert not loop.done()
    passes.append(0)
    loop.cancel()  # lands in the driver call again, swallowed again; the flag ends it
    await asyncio.wait_for(loop, 5)
    assert passes[:2] == [1, 1]
