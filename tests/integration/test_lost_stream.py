"""A stream that ends is recorded as a LOST node even when gRPC cancels its handler while
the loss is being written: it does so when the agent's side resets the call (a dead
host's TCP reset), and half of the broken streams in bench/scale.py then went
unrecorded until the liveness deadline, 10 s later."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import psycopg
import pytest

from kit.stores import StoreUrls, unique
from pitstop.scheduler.api.agent import AgentServicer, Beats
from pitstop.scheduler.db.engine import create_engine_for, migrate, session_factory
from pitstop.scheduler.domain import NodeState
from pitstop.scheduler.gateway import AgentGateway
from pitstop.scheduler.hotstate import EventBus, HotState
from pitstop.scheduler.metrics import SchedulerMetrics
from pitstop.scheduler.store import Store
from pitstop.v1 import agent_pb2, common_pb2

GUARD = 15.0  # seconds: only a hang waits this long


@pytest.fixture
async def servicer(stores: StoreUrls) -> AsyncIterator[tuple[AgentServicer, str]]:
    url = stores.fresh_database()
    await asyncio.to_thread(migrate, url)
    hot = HotState.from_url(stores.redis_url, f"{stores.redis_prefix}{unique('lost')}:")
    engine = create_engine_for(url, pool_size=2)
    store = Store(session_factory(engine), EventBus(hot))
    beats = Beats(interval=60.0, refresh=120.0, liveness_timeout=300.0)
    agents = AgentServicer(store, hot, AgentGateway(), beats, SchedulerMetrics())
    try:
        yield agents, url
    finally:
        await agents.drain()
        await engine.dispose()
        await hot.close()


async def until_blocked_on_a_row_lock(url: str) -> None:
    async with asyncio.timeout(GUARD):
        while True:
            async with await psycopg.AsyncConnection.connect(url) as db:
                cursor = await db.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
                row = await cursor.fetchone()
            if row and row[0]:
                return
            await asyncio.sleep(0.02)


async def test_a_loss_being_written_survives_the_handlers_cancellation(
    servicer: tuple[AgentServicer, str],
) -> None:
    agents, url = servicer
    node_id = unique("reset")

    async def requests() -> AsyncIterator[agent_pb2.AgentMessage]:
        gpu = common_pb2.GpuInfo(index=0, uuid=f"GPU-{node_id}")
        inventory = common_pb2.Inventory(gpus=[gpu])
        yield agent_pb2.AgentMessage(
            seq=1, register=agent_pb2.Register(node_id=node_id, inventory=inventory)
        )  # then the stream ends: the agent is gone

    stream = agents.Connect(requests(), context=None)  # type: ignore[arg-type]
    first = await anext(stream)
    assert first.registered.state == common_pb2.NODE_STATE_READY
    async with await psycopg.AsyncConnection.connect(url) as held:
        # The loss's write waits on the node's row...
        await held.execute("SELECT id FROM nodes WHERE id = %s FOR UPDATE", (node_id,))
        ending = asyncio.create_task(anext(stream, None))
        await until_blocked_on_a_row_lock(url)
        ending.cancel()  # ...when gRPC cancels the handler, as on a reset call
        with contextlib.suppress(asyncio.CancelledError):
            await ending
        await held.commit()
    async with asyncio.timeout(GUARD):
        while True:
            async with await psycopg.AsyncConnection.connect(url) as db:
                cursor = await db.execute("SELECT state FROM nodes WHERE id = %s", (node_id,))
                row = await cursor.fetchone()
            if row and row[0] == NodeState.LOST.value:
                break
            await asyncio.sleep(0.02)
    async with await psycopg.AsyncConnection.connect(url) as db:
        cursor = await db.execute(
            "SELECT reason FROM events WHERE node_id = %s AND kind = 'node.lost'", (node_id,)
        )
        assert [r for (r,) in await cursor.fetchall()] == ["agent stream closed"]


async def test_a_loss_is_recorded_when_the_handler_is_cancelled_again_while_it_cleans_up(
    servicer: tuple[AgentServicer, str],
) -> None:
    """gRPC may cancel the handler more than once: the second cancellation lands while
    it waits for its reader to wind down, before it ever got to the loss."""
    agents, url = servicer
    node_id = unique("twice")
    winding_down = asyncio.Event()

    async def requests() -> AsyncIterator[agent_pb2.AgentMessage]:
        gpu = common_pb2.GpuInfo(index=0, uuid=f"GPU-{node_id}")
        yield agent_pb2.AgentMessage(
            seq=1,
            register=agent_pb2.Register(
                node_id=node_id, inventory=common_pb2.Inventory(gpus=[gpu])
            ),
        )
        try:
            await asyncio.Event().wait()  # the agent says nothing more
        except asyncio.CancelledError:
            winding_down.set()
            await asyncio.sleep(1.0)  # a read that takes its time to give up
            raise

    stream = agents.Connect(requests(), context=None)  # type: ignore[arg-type]
    await anext(stream)
    running = asyncio.create_task(anext(stream, None))
    async with asyncio.timeout(GUARD):
        while True:  # until the handler waits on its reader and its command queue
            if stream.ag_await is not None:
                break
            await asyncio.sleep(0)
    running.cancel()  # the call ends: gRPC cancels the handler...
    async with asyncio.timeout(GUARD):
        await winding_down.wait()
    running.cancel()  # ...and again, while it waits for its reader
    with contextlib.suppress(asyncio.CancelledError):
        await running
    await agents.drain()
    async with await psycopg.AsyncConnection.connect(url) as db:
        cursor = await db.execute("SELECT state FROM nodes WHERE id = %s", (node_id,))
        assert await cursor.fetchone() == (NodeState.LOST.value,)
