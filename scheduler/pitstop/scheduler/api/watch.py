"""Following the event log: replay from PostgreSQL, then wait on the event bus.

An event's id is drawn when its row is inserted, but the row is seen only once its
transaction commits, and transactions commit in any order: event 101 can be visible
while event 100 is still being written. A follower that moved its place past 101 would
never hand out 100 (a test watching for a recovery missed its ``job.recovering`` that
way, while a rank's exit was recorded beside it). So a follower hands out events in id
order with no hole: at a missing id it waits until the id is filled, or is known to stay
empty because the transaction that drew it rolled back. That is known once every
transaction that was running a moment after the hole was first seen has ended: the
moment (``HOLE_SETTLE_SECONDS``) covers the instant between a transaction drawing an id
and taking its own transaction id, in the first write of a transaction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from pitstop.scheduler.convert import event_to_pb
from pitstop.scheduler.db import models
from pitstop.scheduler.services import events as event_service
from pitstop.scheduler.store import Store
from pitstop.v1 import common_pb2

log = logging.getLogger(__name__)

# A watcher re-reads the log at least this often even without a notification, so a
# lost Redis message delays it by at most this long.
SAFETY_POLL_SECONDS = 1.0
# How many event ids one read of the log takes in.
LOG_PAGE = 500
# See the module's text. A hole is looked at this often while it is open (a rolled-back
# id is announced by nobody), and given up on after the patience: a transaction that held
# an event uncommitted that long is stuck, and its event is handed out late, if ever.
HOLE_SETTLE_SECONDS = 0.5
HOLE_POLL_SECONDS = 0.1
HOLE_PATIENCE_SECONDS = 60.0


@dataclass
class _Hole:
    """Missing ids up to ``drawn_by`` (the highest id seen when the hole was first seen:
    every missing id below it was drawn before that read), and the transaction horizon
    that settles them: once no transaction below it runs, what is missing stays so."""

    drawn_by: int
    seen_at: float
    horizon: int | None = None


class _Place:
    """How far a follower has handed out the log, and the hole it waits at."""

    def __init__(self, after_id: int) -> None:
        self.after = after_id
        self.hole: _Hole | None = None

    def through(self, view: event_service.LogView, now: float) -> int:
        """The highest id in ``view`` that may be handed out now: every id up to it is
        visible, or settled as never to be."""
        through = self.after
        for event_id in view.ids:
            if event_id != through + 1 and not self._settled(through + 1, view, now):
                break
            through = event_id
        return through

    def _settled(self, missing: int, view: event_service.LogView, now: float) -> bool:
        hole = self.hole
        if hole is None or missing > hole.drawn_by:
            self.hole = _Hole(drawn_by=view.ids[-1], seen_at=now)
            return False
        waited = now - hole.seen_at
        if hole.horizon is None:
            if waited >= HOLE_SETTLE_SECONDS:
                hole.horizon = view.xmax
            return False
        if view.xmin >= hole.horizon:
            return True
        if waited >= HOLE_PATIENCE_SECONDS:
            log.warning(
                "event %d is still uncommitted after %.0fs: handing out the events after "
                "it (a transaction holding it is stuck; it may never be seen)",
                missing,
                waited,
            )
            hole.horizon = 0  # settled: the ids below drawn_by are not waited for again
            return True
        return False


async def follow_events(
    store: Store,
    *,
    job_id: str = "",
    node_id: str = "",
    after_id: int = 0,
    until: Callable[[common_pb2.Event], bool] = lambda _e: False,
) -> AsyncIterator[common_pb2.Event]:
    """Yield events with id > ``after_id`` as they are recorded, in id order and none
    left out (see the module's text); stop after one ``until`` accepts. A negative
    ``after_id`` starts at the newest event without replay."""
    if after_id < 0:
        async with store.read() as session:
            after_id = await event_service.newest_event_id(session)
    place = _Place(after_id)
    version = store.bus.version
    while True:
        async with store.read() as session:
            view = await event_service.log_view(session, place.after, LOG_PAGE)
            through = place.through(view, time.monotonic())
            rows: Sequence[models.Event] = ()
            if through > place.after:
                rows = await event_service.list_events(
                    session,
                    job_id=job_id,
                    node_id=node_id,
                    after_id=place.after,
                    through_id=through,
                    limit=LOG_PAGE,
                )
        for row in rows:
            event = event_to_pb(row)
            yield event
            if until(event):
                return
        place.after = through
        if len(view.ids) == LOG_PAGE and through == view.ids[-1]:
            continue  # more backlog: read on before waiting
        waiting_at_hole = bool(view.ids) and through < view.ids[-1]
        poll = HOLE_POLL_SECONDS if waiting_at_hole else SAFETY_POLL_SECONDS
        version = await store.bus.wait(version, poll)
