"""Leader election: a lease row in PostgreSQL with a fencing token.

Every scheduler process serves the API and holds agent streams; only the lease holder
runs the loops that decide. The lease is renewed well inside its period; a holder that
dies (kill -9) is replaced once the lease expires, within about one period. The token
grows with every change of holder, and every deciding transaction checks it
(``assert_leader``), so a stale leader that wakes up late can never commit a decision.
Times come from PostgreSQL's clock, so the processes' clocks may disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.errors import FailedPrecondition
from pitstop.scheduler.services.events import record_event
from pitstop.scheduler.store import Store

log = logging.getLogger(__name__)

LEASE_NAME = "leader"

_ACQUIRE = text(
    """
    INSERT INTO leases (name, holder, token, expires_at)
    VALUES (:name, :holder, 1, now() + make_interval(secs => :period))
    ON CONFLICT (name) DO UPDATE SET
        token = CASE WHEN leases.holder = :holder THEN leases.token ELSE leases.token + 1 END,
        holder = :holder,
        expires_at = now() + make_interval(secs => :period)
    WHERE leases.holder = :holder OR leases.expires_at < now()
    RETURNING token
    """
)
_CHECK = text(
    """
    SELECT 1 FROM leases
    WHERE name = :name AND holder = :holder AND token = :token AND expires_at > now()
    FOR SHARE
    """
)
_RELEASE = text("UPDATE leases SET expires_at = now() WHERE name = :name AND holder = :holder")


class LeaderElection:
    """Campaigns for the lease and runs ``lead(token)`` while holding it."""

    def __init__(self, store: Store, *, period_seconds: float, holder: str | None = None) -> None:
        self.store = store
        self.period = period_seconds
        self.holder = holder or f"scheduler-{uuid.uuid4().hex[:12]}"
        self.token: int | None = None
        self.became_leader = asyncio.Event()

    @property
    def leading(self) -> bool:
        return self.token is not None

    async def try_acquire(self) -> int | None:
        """Take or renew the lease; the fencing token if this process holds it now. Taking
        it over (a new token) is recorded in the event log."""
        async with self.store.write() as session:
            row = await session.execute(
                _ACQUIRE, {"name": LEASE_NAME, "holder": self.holder, "period": self.period}
            )
            token = row.scalar_one_or_none()
            if token is not None and token != self.token:
                record_event(
                    session,
                    "scheduler.leader",
                    actor=self.holder,
                    reason=f"{self.holder} leads with fencing token {token}",
                    attributes={"token": str(token), "holder": self.holder},
                )
        return None if token is None else int(token)

    async def assert_leader(self, session: AsyncSession) -> None:
        """Inside a deciding transaction: refuse unless this process still holds the lease
        with the same token (the row stays share-locked until the commit)."""
        if self.token is None:
            raise FailedPrecondition(f"{self.holder} is not the leader")
        found = await session.scalar(
            _CHECK, {"name": LEASE_NAME, "holder": self.holder, "token": self.token}
        )
        if found is None:
            # The campaign loop owns the token: it learns of a lost lease at its next
            # renewal. Until then every decision is refused here.
            raise FailedPrecondition(f"{self.holder} lost the leader lease; it decides nothing")

    async def run(self, lead: Callable[[int], Coroutine[Any, Any, None]]) -> None:
        """Campaign forever; while leading, run ``lead`` and renew every third of a period.
        Losing the lease (or failing to renew in time) cancels ``lead``."""
        renew_every = self.period / 3
        while True:
            token = await self._attempt()
            if token is None:
                await asyncio.sleep(renew_every)
                continue
            self.token = token
            self.became_leader.set()
            log.info("%s is the leader (fencing token %d)", self.holder, token)
            task = asyncio.create_task(lead(token), name="leader-loops")
            try:
                while True:
                    await asyncio.sleep(renew_every)
                    if task.done():
                        task.result()  # surface a crash of the loops
                        break
                    renewed = await self._attempt()
                    if renewed != token:
                        log.warning("%s lost the leader lease", self.holder)
                        break
            finally:
                self.token = None
                self.became_leader.clear()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _attempt(self) -> int | None:
        try:
            return await self.try_acquire()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("leader lease unreachable (PostgreSQL down?)", exc_info=True)
            return None

    async def release(self) -> None:
        """Give the lease up at shutdown so a standby takes over without waiting (a no-op
        unless this process holds it)."""
        with contextlib.suppress(Exception):
            async with self.store.write() as session:
                await session.execute(_RELEASE, {"name": LEASE_NAME, "holder": self.holder})
        self.token = None
