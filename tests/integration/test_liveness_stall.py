"""The liveness scan judges nodes only by time it was looking: a scheduler that stalled
(a starved CPU, a pause) pushes every deadline back by the stall instead of declaring
nodes lost whose heartbeats sat unread in its own queue."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from kit.stores import StoreUrls, unique
from pitstop.scheduler.hotstate import HotState
from pitstop.scheduler.liveness import STALL_SECONDS, LivenessMonitor


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def hot(stores: StoreUrls) -> AsyncIterator[HotState]:
    client = aioredis.Redis.from_url(stores.redis_url)
    state = HotState(client, f"{stores.redis_prefix}{unique('stall')}:")
    try:
        yield state
    finally:
        await client.delete(state.deadlines_key)
        await client.aclose()


def monitor(hot: HotState, clock: Clock) -> LivenessMonitor:
    # No store and no gateway: these scans find nothing to mark lost, or the test fails.
    return LivenessMonitor(
        None,  # type: ignore[arg-type]
        hot,
        None,  # type: ignore[arg-type]
        tick_seconds=0.5,
        startup_grace_seconds=0.0,
        clock=clock,
    )


async def test_a_stalled_scan_gives_every_node_its_stall_again(hot: HotState) -> None:
    clock = Clock()
    await hot.record_heartbeat("n1", 2.0, now=clock.now)  # due at +2 s
    scans = monitor(hot, clock)
    clock.now += 5.0  # the scheduler did not run for 5 s: the deadline passed meanwhile
    await scans._forgive_stall(5.0)
    assert await scans.scan_once() == []
    clock.now += 4.9
    assert await scans.scan_once() == []
    clock.now += 0.2
    assert await hot.expired_nodes(clock.now) == ["n1"]  # silent past the stall: lost


async def test_a_scan_on_time_forgives_nothing(hot: HotState) -> None:
    clock = Clock()
    await hot.record_heartbeat("n1", 2.0, now=clock.now)
    scans = monitor(hot, clock)
    clock.now += 2.5
    await scans._forgive_stall(STALL_SECONDS / 2)
    assert await hot.expired_nodes(clock.now) == ["n1"]
