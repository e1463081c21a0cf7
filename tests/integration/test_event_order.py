"""A watcher of the event log sees every event, in id order, though transactions that
record events commit in any order: the one that drew the smaller id may commit last."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from kit.stores import StoreUrls, unique
from pitstop.scheduler.api.watch import follow_events
from pitstop.scheduler.db.engine import create_engine_for, migrate, session_factory
from pitstop.scheduler.hotstate import EventBus, HotState
from pitstop.scheduler.store import Store
from pitstop.v1 import common_pb2

# Every wait in these tests ends on what it waits for; this only stops a hang.
HANG = 30.0


class CountedBus(EventBus):
    """The real bus, counting the follower's waits: each one comes after a full read of
    the log, so two more waits mean the follower has read what was committed before."""

    def __init__(self, hot: HotState) -> None:
        super().__init__(hot)
        self.waits = 0
        self.waited = asyncio.Event()

    async def wait(self, seen_version: int, timeout: float) -> int:
        self.waits += 1
        self.waited.set()
        self.waited = asyncio.Event()
        return await super().wait(seen_version, timeout)

    async def reads_after_now(self) -> None:
        """Returns once the follower began and finished a read after this call."""
        target = self.waits + 2
        while self.waits < target:
            await self.waited.wait()


@pytest.fixture
async def store(stores: StoreUrls) -> AsyncIterator[Store]:
    await asyncio.to_thread(migrate, stores.database_url)
    engine = create_engine_for(stores.database_url, pool_size=2)
    hot = HotState.from_url(stores.redis_url, f"{stores.redis_prefix}{unique('order')}:")
    try:
        yield Store(session_factory(engine), CountedBus(hot))
    finally:
        await hot.redis.aclose()
        await engine.dispose()


async def begin_event(
    url: str, node_id: str, reason: str
) -> tuple[psycopg.AsyncConnection[Any], int]:
    """A transaction that recorded an event and has not committed: its connection and the
    id the event drew."""
    conn = await psycopg.AsyncConnection.connect(url)
    cursor = await conn.execute(
        "INSERT INTO events (time, kind, node_id, from_state, to_state, reason, actor,"
        " attributes) VALUES (now(), 'node.test', %s, '', '', %s, 'test', %s) RETURNING id",
        (node_id, reason, json.dumps({})),
    )
    row = await cursor.fetchone()
    assert row is not None
    return conn, int(row[0])


async def next_event(events: AsyncIterator[common_pb2.Event]) -> common_pb2.Event:
    return await asyncio.wait_for(anext(events), HANG)


async def test_an_event_whose_transaction_commits_last_is_still_seen_and_first(
    stores: StoreUrls, store: Store
) -> None:
    bus = store.bus
    assert isinstance(bus, CountedBus)
    node = unique("order")
    events = follow_events(store, node_id=node, after_id=-1)
    first = asyncio.ensure_future(next_event(events))
    await asyncio.wait_for(bus.reads_after_now(), HANG)  # the follower has its place

    slow, slow_id = await begin_event(stores.database_url, node, "drew its id first")
    fast, fast_id = await begin_event(stores.database_url, node, "committed first")
    assert fast_id > slow_id
    await fast.commit()
    # The follower has read the log with the later event committed and the earlier one
    # not: it must not hand out the later one yet (its place would pass the earlier).
    reads = asyncio.ensure_future(bus.reads_after_now())
    await asyncio.wait([first, reads], timeout=HANG, return_when=asyncio.FIRST_COMPLETED)
    read_again = reads.done()
    reads.cancel()
    assert not first.done(), f"handed out event {first.result().id} before {slow_id} committed"
    assert read_again, f"the follower never read the log again within {HANG:.0f}s"
    await slow.commit()

    assert [(await first).id, (await next_event(events)).id] == [slow_id, fast_id]
    for conn in (slow, fast):
        await conn.close()
    await events.aclose()


async def test_an_id_whose_transaction_rolled_back_does_not_hold_the_events_after_it(
    stores: StoreUrls, store: Store
) -> None:
    node = unique("order")
    events = follow_events(store, node_id=node, after_id=-1)
    first = asyncio.ensure_future(next_event(events))
    bus = store.bus
    assert isinstance(bus, CountedBus)
    await asyncio.wait_for(bus.reads_after_now(), HANG)

    undone, undone_id = await begin_event(stores.database_url, node, "rolled back")
    kept, kept_id = await begin_event(stores.database_url, node, "kept")
    await kept.commit()
    await undone.rollback()

    event = await first
    assert (event.id, event.reason) == (kept_id, "kept")
    assert undone_id < kept_id
    for conn in (undone, kept):
        await conn.close()
    await events.aclose()
