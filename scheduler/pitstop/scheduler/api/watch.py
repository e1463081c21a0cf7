"""Following the event log: replay from PostgreSQL, then wait on the event bus."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from pitstop.scheduler.convert import event_to_pb
from pitstop.scheduler.services import events as event_service
from pitstop.scheduler.store import Store
from pitstop.v1 import common_pb2

# A watcher re-reads the log at least this often even without a notification, so a
# lost Redis message delays it by at most this long.
SAFETY_POLL_SECONDS = 1.0


async def follow_events(
    store: Store,
    *,
    job_id: str = "",
    node_id: str = "",
    after_id: int = 0,
    until: Callable[[common_pb2.Event], bool] = lambda _e: False,
) -> AsyncIterator[common_pb2.Event]:
    """Yield events with id > ``after_id`` as they are recorded; stop after one ``until``
    accepts. A negative ``after_id`` starts at the newest event without replay."""
    if after_id < 0:
        async with store.read() as session:
            after_id = await event_service.newest_event_id(session)
    version = store.bus.version
    while True:
        async with store.read() as session:
            rows = await event_service.list_events(
                session, job_id=job_id, node_id=node_id, after_id=after_id, limit=500
            )
        for row in rows:
            event = event_to_pb(row)
            after_id = row.id
            yield event
            if until(event):
                return
        if len(rows) == 500:
            continue  # more backlog: read on before waiting
        version = await store.bus.wait(version, SAFETY_POLL_SECONDS)
