"""Keeps the authorization interceptor's copy of the issued API tokens current.

The interceptor is synchronous and reads memory only, so the database's active tokens
are copied into the TokenBook: at start, every RELOAD_SECONDS by every scheduler process
(several share one PostgreSQL, and any of them may issue or revoke), and at once by the
process that issued or revoked one, right after its commit.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable

from pitstop.scheduler.auth import TokenBook, utc_now
from pitstop.scheduler.cancelling import reraise_if_cancelling
from pitstop.scheduler.domain import IssuedToken
from pitstop.scheduler.services import api_tokens
from pitstop.scheduler.store import Store

log = logging.getLogger(__name__)

RELOAD_SECONDS = 0.5
"""Another process's revocation takes effect here within this (plus one query)."""


class IssuedTokenRefresher:
    """Copies the active issued tokens from PostgreSQL into `book`."""

    def __init__(
        self,
        store: Store,
        book: TokenBook,
        period_seconds: float = RELOAD_SECONDS,
        clock: Callable[[], dt.datetime] = utc_now,
    ) -> None:
        self.store, self.book = store, book
        self.period_seconds = period_seconds
        self._clock = clock
        # Reads and installs are serialised: a periodic reload that read the table before
        # a revocation committed must not install its copy after the revoking call's.
        self._lock = asyncio.Lock()
        self._failing = False

    async def _reload_locked(self) -> None:
        async with self.store.read() as session:
            tokens, any_issued = await api_tokens.load_issued(session, self._clock())
        self.book.replace_issued(tokens, any_issued)

    async def reload(self) -> None:
        """Install the database's active tokens now; raises when PostgreSQL cannot say."""
        async with self._lock:
            await self._reload_locked()

    async def issued(self, token: IssuedToken) -> None:
        """`token` was just committed by this process: honour it on the very next call."""
        async with self._lock:
            self.book.admit(token)
            await self._reload_after_commit()

    async def revoked(self, name: str) -> None:
        """Token `name` was just revoked by this process: refuse it on the very next call,
        even if PostgreSQL cannot be read again now."""
        async with self._lock:
            self.book.withdraw(name)
            await self._reload_after_commit()

    async def _reload_after_commit(self) -> None:
        # The change is committed and already in the book; a failed reload must not turn
        # the call into an error (a retried Create would find its name taken), and the
        # periodic reload catches up.
        try:
            await self._reload_locked()
        except Exception as exc:
            log.warning("could not reload API tokens after a change (%s); retrying shortly", exc)

    async def run(self) -> None:
        """Reload every period until cancelled; an unreachable database keeps the last copy
        (with the in-memory expiry check) and is reported once, then once recovered."""
        while True:
            await asyncio.sleep(self.period_seconds)
            try:
                await self.reload()
            except Exception as exc:
                reraise_if_cancelling()
                if not self._failing:
                    log.warning("cannot reload API tokens from PostgreSQL: %s", exc)
                self._failing = True
            else:
                if self._failing:
                    log.info("API tokens reload from PostgreSQL again")
                self._failing = False
