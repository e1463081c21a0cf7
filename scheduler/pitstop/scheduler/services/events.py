"""The append-only event log."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models

MAX_PAGE = 1000


def record_event(
    session: AsyncSession,
    kind: str,
    *,
    actor: str,
    job_id: str | None = None,
    node_id: str | None = None,
    from_state: str = "",
    to_state: str = "",
    reason: str = "",
    attributes: dict[str, str] | None = None,
) -> models.Event:
    """Add an event to the session's transaction; it commits with the change it describes."""
    event = models.Event(
        kind=kind,
        actor=actor,
        job_id=job_id,
        node_id=node_id,
        from_state=from_state,
        to_state=to_state,
        reason=reason,
        attributes=attributes or {},
    )
    session.add(event)
    return event


async def list_events(
    session: AsyncSession,
    *,
    job_id: str = "",
    node_id: str = "",
    after_id: int = 0,
    limit: int = 100,
) -> Sequence[models.Event]:
    """Events with id > ``after_id``, oldest first. A negative ``after_id`` asks for the
    newest ``limit`` events (still oldest first): what a person wants to look at."""
    query = select(models.Event)
    if after_id >= 0:
        query = query.where(models.Event.id > after_id)
    if job_id:
        query = query.where(models.Event.job_id == job_id)
    if node_id:
        query = query.where(models.Event.node_id == node_id)
    size = min(max(limit, 1), MAX_PAGE)
    if after_id < 0:
        newest = (await session.scalars(query.order_by(models.Event.id.desc()).limit(size))).all()
        return list(reversed(newest))
    return (await session.scalars(query.order_by(models.Event.id).limit(size))).all()


async def newest_event_id(session: AsyncSession) -> int:
    return int(await session.scalar(select(func.coalesce(func.max(models.Event.id), 0))) or 0)
