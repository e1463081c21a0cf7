"""The append-only event log."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select, text
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
    through_id: int | None = None,
    limit: int = 100,
) -> Sequence[models.Event]:
    """Events with id > ``after_id`` (and <= ``through_id`` where given), oldest first.
    A negative ``after_id`` asks for the newest ``limit`` events (still oldest first):
    what a person wants to look at."""
    query = select(models.Event)
    if after_id >= 0:
        query = query.where(models.Event.id > after_id)
    if through_id is not None:
        query = query.where(models.Event.id <= through_id)
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


@dataclass(frozen=True)
class LogView:
    """The ids of the events after a point, as one snapshot of the database saw them,
    and that snapshot's transaction horizon: every transaction with an id below
    ``xmin`` had ended; every one that started later has an id at or above ``xmax``."""

    xmin: int
    xmax: int
    ids: list[int]


_LOG_VIEW = text(
    "SELECT pg_snapshot_xmin(s)::text::bigint, pg_snapshot_xmax(s)::text::bigint,"
    " ARRAY(SELECT id FROM events WHERE id > :after ORDER BY id LIMIT :limit)"
    " FROM pg_current_snapshot() AS s"
)


async def log_view(session: AsyncSession, after_id: int, limit: int) -> LogView:
    """Every event id after ``after_id`` (whatever its job or node), up to ``limit``,
    with the horizon of the one snapshot they were read in."""
    row = (await session.execute(_LOG_VIEW, {"after": after_id, "limit": limit})).one()
    return LogView(xmin=int(row[0]), xmax=int(row[1]), ids=list(row[2]))
