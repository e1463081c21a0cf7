"""A mass expiry (a rack's switch, a power feed) is one liveness scan and one
transaction: every silent node is LOST with its event, none waits behind another's
commit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import select

from kit.stores import StoreUrls, unique
from pitstop.scheduler.db import models
from pitstop.scheduler.db.engine import create_engine_for, migrate, session_factory
from pitstop.scheduler.domain import NodeState
from pitstop.scheduler.gateway import AgentGateway
from pitstop.scheduler.hotstate import EventBus, HotState
from pitstop.scheduler.liveness import LivenessMonitor
from pitstop.scheduler.store import Store

SILENT = 200
DEADLINE = "no heartbeat before the liveness deadline (agent hung or cut off)"


@pytest.fixture
async def hot(stores: StoreUrls) -> AsyncIterator[HotState]:
    state = HotState.from_url(stores.redis_url, f"{stores.redis_prefix}{unique('batch')}:")
    try:
        yield state
    finally:
        await state.redis.delete(state.deadlines_key)
        await state.redis.aclose()


@pytest.fixture
async def store(stores: StoreUrls, hot: HotState) -> AsyncIterator[Store]:
    await asyncio.to_thread(migrate, stores.database_url)
    engine = create_engine_for(stores.database_url, pool_size=2)
    try:
        yield Store(session_factory(engine), EventBus(hot))
    finally:
        await engine.dispose()


async def test_a_mass_expiry_is_lost_in_one_scan_and_one_transaction(
    store: Store, hot: HotState
) -> None:
    rack = unique("rack")
    silent = [f"{rack}-{i:03d}" for i in range(SILENT)]
    beating = f"{rack}-beating"
    unhealthy = f"{rack}-unhealthy"
    async with store.write() as session:
        for node_id in [*silent, beating]:
            session.add(models.Node(id=node_id, rack=rack, state=NodeState.READY, connected=True))
        session.add(models.Node(id=unhealthy, rack=rack, state=NodeState.UNHEALTHY, connected=True))
    now = 1_000.0  # the beats' time; the scan looks 10 s later
    for node_id in [*silent, unhealthy]:
        await hot.record_heartbeat(node_id, 2.0, now=now)
    await hot.record_heartbeat(beating, 60.0, now=now)
    scan = LivenessMonitor(
        store,
        hot,
        AgentGateway(),
        tick_seconds=0.5,
        startup_grace_seconds=0.0,
        clock=lambda: now + 10.0,
    )

    assert sorted(await scan.scan_once()) == sorted([*silent, unhealthy])
    assert await scan.scan_once() == []  # each expiry is claimed once

    async with store.read() as session:
        nodes = {
            n.id: n
            for n in await session.scalars(select(models.Node).where(models.Node.rack == rack))
        }
        events = (
            await session.scalars(select(models.Event).where(models.Event.node_id.in_(list(nodes))))
        ).all()
    assert {n for n, node in nodes.items() if node.state == NodeState.LOST} == set(silent)
    assert nodes[unhealthy].state == NodeState.UNHEALTHY  # the worse news stays
    assert (nodes[beating].connected, nodes[beating].state) == (True, NodeState.READY)
    assert not any(nodes[n].connected for n in [*silent, unhealthy])
    lost = [e for e in events if e.kind == "node.lost"]
    assert sorted(e.node_id for e in lost) == sorted(silent)
    assert {e.reason for e in lost} == {DEADLINE}
    (disconnected,) = [e for e in events if e.kind == "node.disconnected"]
    assert disconnected.node_id == unhealthy
    # An event's time is its transaction's start: one time, one transaction.
    assert len({e.time for e in [*lost, disconnected]}) == 1
