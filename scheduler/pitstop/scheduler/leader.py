"""Leader election: a lease row in PostgreSQL with a fencing token.

Every scheduler process serves the API and holds agent streams; only the lease holder
runs the loops that decide. The token grows only when another process takes the lease
over, and every deciding transaction checks it (``assert_leader``) — the token, never
the lease's expiry: a renewal that comes late on a busy machine, with nobody else
taking over, changes nothing and refuses nothing.

The deciding transaction holds the lease row ``FOR KEY SHARE`` until it commits. The
holder's renewal is a plain UPDATE of a non-key column, which that lock does not block,
so decisions never hold up a renewal. A takeover reads the row ``FOR UPDATE`` first,
which waits for the old holder's deciding transactions in flight to end: a stale
leader can never commit a decision after a new one took over.

The renewal runs in a thread of its own on a connection of its own, so neither a busy
event loop nor an exhausted connection pool can starve it. A frozen holder (SIGSTOP)
that keeps a transaction open loses it to ``idle_in_transaction_session_timeout``
(set on every scheduler connection), and a takeover waits at most ``lock_timeout``
per attempt. Times come from PostgreSQL's clock, so the processes' clocks may disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db.engine import libpq_url
from pitstop.scheduler.errors import FailedPrecondition
from pitstop.scheduler.store import Store

log = logging.getLogger(__name__)

LEASE_NAME = "leader"

_CHECK = text(
    """
    SELECT 1 FROM leases
    WHERE name = :name AND holder = :holder AND token = :token
    FOR KEY SHARE
    """
)
_RENEW = """
    UPDATE leases SET expires_at = now() + make_interval(secs => %(period)s)
    WHERE name = %(name)s AND holder = %(holder)s AND token = %(token)s
    RETURNING token
"""
_READ_FOR_TAKEOVER = """
    SELECT holder, token, expires_at < now() FROM leases WHERE name = %(name)s FOR UPDATE
"""
_TAKE = """
    UPDATE leases SET holder = %(holder)s, token = token + %(bump)s,
        expires_at = now() + make_interval(secs => %(period)s)
    WHERE name = %(name)s
    RETURNING token
"""
_CREATE = """
    INSERT INTO leases (name, holder, token, expires_at)
    VALUES (%(name)s, %(holder)s, 1, now() + make_interval(secs => %(period)s))
    ON CONFLICT (name) DO NOTHING
    RETURNING token
"""
_EVENT = """
    INSERT INTO events (kind, from_state, to_state, reason, actor, attributes)
    VALUES ('scheduler.leader', '', '', %(reason)s, %(holder)s, %(attributes)s::jsonb)
    RETURNING id
"""
_RELEASE = "UPDATE leases SET expires_at = now() WHERE name = %(name)s AND holder = %(holder)s"


class LeaseKeeper(threading.Thread):
    """Takes and renews the lease every third of a period, on its own connection, and
    calls ``on_change(token, event_id)`` (from this thread) whenever the token this
    process holds changes: a token when it leads, None when it no longer does."""

    def __init__(
        self,
        database_url: str,
        holder: str,
        period: float,
        on_change: Callable[[int | None, int | None], None],
    ) -> None:
        super().__init__(name="leader-lease", daemon=True)
        self.url = libpq_url(database_url)
        self.holder = holder
        self.period = period
        self.on_change = on_change
        self.token: int | None = None
        self._renewed_at = 0.0
        self._halt = threading.Event()
        self._conn: psycopg.Connection[Any] | None = None

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                token, event_id = self._attempt()
                if token != self.token:
                    self.token = token
                    self.on_change(token, event_id)
                self._halt.wait(self.period / 3)
        finally:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()

    def release(self) -> None:
        """Give the lease up (the caller stopped this thread first)."""
        with (
            contextlib.suppress(Exception),
            psycopg.connect(self.url, autocommit=True, connect_timeout=3) as conn,
        ):
            conn.execute(_RELEASE, {"name": LEASE_NAME, "holder": self.holder})

    def _attempt(self) -> tuple[int | None, int | None]:
        now = time.monotonic()
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self.url, connect_timeout=3)
            token, event_id = self._renew_or_take(self._conn)
        except psycopg.Error as exc:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()
            self._conn = None
            if self.token is not None and now - self._renewed_at < self.period:
                # PostgreSQL unreachable for a moment: nobody can take the lease over
                # before it expires, and decisions are refused anyway while it is gone.
                log.warning("leader lease renewal failed (%s); retrying", exc)
                return self.token, None
            if self.token is not None:
                log.warning("leader lease not renewed for a whole period (%s)", exc)
            return None, None
        if token is not None:
            self._renewed_at = now
        return token, event_id

    def _renew_or_take(self, conn: psycopg.Connection[Any]) -> tuple[int | None, int | None]:
        args: dict[str, Any] = {
            "name": LEASE_NAME,
            "holder": self.holder,
            "period": self.period,
            "token": self.token,
        }
        with conn.transaction():
            if self.token is not None:
                row = conn.execute(_RENEW, args).fetchone()
                if row is not None:
                    return int(row[0]), None
            # A takeover waits for the old holder's deciding transactions, but only so
            # long: the next attempt tries again.
            conn.execute(f"SET LOCAL lock_timeout = '{max(int(self.period * 1000), 100)}ms'")
            found = conn.execute(_READ_FOR_TAKEOVER, args).fetchone()
            if found is None:
                created = conn.execute(_CREATE, args).fetchone()
                token = None if created is None else int(created[0])
            else:
                holder, _, expired = found
                if holder != self.holder and not expired:
                    return None, None
                # Its own lease, even expired, keeps its token: nobody took it over.
                bump = 0 if holder == self.holder else 1
                token = int(conn.execute(_TAKE, args | {"bump": bump}).fetchone()[0])  # type: ignore[index]
            if token is None:
                return None, None
            attributes = json.dumps({"token": str(token), "holder": self.holder})
            event = conn.execute(
                _EVENT,
                {
                    "reason": f"{self.holder} leads with fencing token {token}",
                    "holder": self.holder,
                    "attributes": attributes,
                },
            ).fetchone()
            return token, None if event is None else int(event[0])


class LeaderElection:
    """Campaigns for the lease and runs ``lead(token)`` while holding it."""

    def __init__(
        self,
        store: Store,
        *,
        database_url: str,
        period_seconds: float,
        holder: str | None = None,
    ) -> None:
        self.store = store
        self.database_url = database_url
        self.period = period_seconds
        self.holder = holder or f"scheduler-{uuid.uuid4().hex[:12]}"
        self.token: int | None = None
        self.became_leader = asyncio.Event()
        self._keeper: LeaseKeeper | None = None

    @property
    def leading(self) -> bool:
        return self.token is not None

    async def assert_leader(self, session: AsyncSession) -> None:
        """Inside a deciding transaction: refuse unless this process still holds the
        lease with the same fencing token. The row stays key-share locked until the
        commit, so no takeover completes while this decision is in flight."""
        if self.token is None:
            raise FailedPrecondition(f"{self.holder} is not the leader")
        found = await session.scalar(
            _CHECK, {"name": LEASE_NAME, "holder": self.holder, "token": self.token}
        )
        if found is None:
            raise FailedPrecondition(
                f"{self.holder} no longer holds the leader lease with token {self.token} "
                "(another scheduler took over); it decides nothing"
            )

    async def run(self, lead: Callable[[int], Coroutine[Any, Any, None]]) -> None:
        """Campaign forever; while leading, run ``lead``. Losing the lease cancels it."""
        loop = asyncio.get_running_loop()
        changes: asyncio.Queue[tuple[int | None, int | None]] = asyncio.Queue()

        def changed(token: int | None, event_id: int | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                loop.call_soon_threadsafe(changes.put_nowait, (token, event_id))

        keeper = LeaseKeeper(self.database_url, self.holder, self.period, changed)
        self._keeper = keeper
        keeper.start()
        task: asyncio.Task[None] | None = None
        waiter: asyncio.Future[tuple[int | None, int | None]] | None = None
        try:
            while True:
                waiter = asyncio.ensure_future(changes.get())
                pending = {waiter} if task is None else {waiter, task}
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if task is not None and task in done:
                    waiter.cancel()
                    task.result()  # surface a crash of the loops
                    raise RuntimeError("the leader loops ended on their own")
                token, event_id = waiter.result()
                if task is not None:
                    log.warning("%s lost the leader lease", self.holder)
                    self.token = None
                    self.became_leader.clear()
                    await _cancelled(task)
                    task = None
                if token is not None:
                    self.token = token
                    self.became_leader.set()
                    log.info("%s is the leader (fencing token %d)", self.holder, token)
                    task = asyncio.create_task(lead(token), name="leader-loops")
                # Announced only once this process acts on it: a watcher that sees the
                # event and asks whether this process leads must hear yes.
                if event_id is not None:
                    await self.store.bus.announce([event_id])
        finally:
            if waiter is not None:
                waiter.cancel()
            keeper.stop()
            self.token = None
            self.became_leader.clear()
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def release(self) -> None:
        """Give the lease up at shutdown so a standby takes over without waiting (a no-op
        unless this process holds it)."""
        keeper = self._keeper
        self.token = None
        if keeper is None:
            return
        keeper.stop()
        await asyncio.to_thread(keeper.join, 5.0)
        await asyncio.to_thread(keeper.release)


_LOOP_CODE = ("/pitstop/scheduler/reconcile/", "/pitstop/scheduler/liveness.py")
STUCK_LOOPS_SECONDS = 10.0
"""Leader loops still running this long after their cancel are logged with their stack."""


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancel the leader loops and wait until they end. While they have not (an await
    that ignores cancellation), this process cannot lead again: say where they are."""
    task.cancel()
    while True:
        done, _ = await asyncio.wait({task}, timeout=STUCK_LOOPS_SECONDS)
        if done:
            with contextlib.suppress(asyncio.CancelledError):
                task.result()
            return
        where = io.StringIO()
        stuck = []
        for other in asyncio.all_tasks():  # the loops' own tasks, under the task group
            frames = other.get_stack()
            if other is task or any(c in f.f_code.co_filename for f in frames for c in _LOOP_CODE):
                other.print_stack(file=where)
                stuck.append(other)
        log.error(
            "the leader loops have not stopped %.0fs after losing the lease; this process "
            "cannot lead again until they do. They wait in:\n%s\nCancelling them again.",
            STUCK_LOOPS_SECONDS,
            where.getvalue(),
        )
        # A cancellation swallowed by a call it interrupted (a driver that made it an
        # ordinary error) is delivered again, at the await the loop waits in now.
        for other in stuck:
            other.cancel()
