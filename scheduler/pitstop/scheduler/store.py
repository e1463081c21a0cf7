"""Database sessions with the event announcement that must follow each commit."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import event as sa_event
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session

from pitstop.scheduler.db import models
from pitstop.scheduler.hotstate import EventBus

_PENDING_EVENTS = "pitstop_events"


@sa_event.listens_for(Session, "pending_to_persistent")
def _collect_event(session: Session, instance: object) -> None:
    if isinstance(instance, models.Event):
        session.info.setdefault(_PENDING_EVENTS, []).append(instance)


class Store:
    """One place to open a transaction. Events commit with their change, and watchers
    are woken only after the commit, never from inside the transaction."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], bus: EventBus) -> None:
        self.sessions = sessions
        self.bus = bus

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncSession]:
        """A transaction; commits on success, rolls back on error, then announces events."""
        async with self.sessions() as session:
            async with session.begin():
                yield session
            events = session.sync_session.info.pop(_PENDING_EVENTS, [])
        await self.bus.announce([e.id for e in events])

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        """A read-only session; whatever it began is rolled back at the end."""
        async with self.sessions() as session:
            yield session
