"""The one outbox every message to the scheduler leaves through, kept across streams:
a message taken as a stream ended goes out first on the next one."""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from pitstop.v1 import agent_pb2


async def first_of(wanted: asyncio.Event | asyncio.Future[Any], ended: asyncio.Event) -> bool:
    """Wait for `wanted` (an event set, a future done) or `ended`; whether `wanted` came.
    A future that has not come is cancelled."""
    want = asyncio.ensure_future(wanted.wait()) if isinstance(wanted, asyncio.Event) else wanted
    end = asyncio.ensure_future(ended.wait())
    try:
        await asyncio.wait({want, end}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        end.cancel()
        if not want.done():
            want.cancel()
    return want.done() and not want.cancelled()


class Outbox:
    """Messages queued for the scheduler, read by one stream's writer at a time."""

    def __init__(self) -> None:
        # None ends the stream: the request iterator returns, which half-closes it.
        self._queue: asyncio.Queue[agent_pb2.AgentMessage | None] = asyncio.Queue()
        self._held: agent_pb2.AgentMessage | None = None
        """A message taken from the outbox as its stream ended: the next stream's first."""

    def put(self, message: agent_pb2.AgentMessage) -> None:
        self._queue.put_nowait(message)

    def close(self) -> None:
        """Half-close the current stream once what is queued before has gone out."""
        self._queue.put_nowait(None)

    async def next_message(self, ended: asyncio.Event) -> agent_pb2.AgentMessage | None:
        """The next message to send on this stream; None to half-close it (the agent
        stops) or once it has ended (a message taken as it ended goes out first on the
        next stream)."""
        held, self._held = self._held, None
        if held is not None:
            return held
        getter = asyncio.ensure_future(self._queue.get())
        try:
            came = await first_of(getter, ended)
        except asyncio.CancelledError:  # the call was cancelled: keep what was taken
            if getter.done() and not getter.cancelled():
                self._held = getter.result()
            raise
        if not came:
            return None
        message = getter.result()
        if message is not None and ended.is_set():
            self._held = message
            return None
        return message


RECENT_EXITS_SECONDS = 600.0
RECENT_EXITS_KEPT = 256


class RecentExits:
    """The ranks' exits of the last ten minutes (at most 256), which each Register
    carries again: a report sent on a stream that broke before the scheduler recorded it
    (its PostgreSQL restarting) is otherwise lost, and a job whose ranks all finished
    would wait for their exits for good. The scheduler records an exit once."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._exits: collections.deque[tuple[float, agent_pb2.RankExited]] = collections.deque(
            maxlen=RECENT_EXITS_KEPT
        )

    def add(self, exited: agent_pb2.RankExited) -> None:
        if exited.job_id:  # a standby's exit decides nothing
            self._exits.append((self._clock(), exited))

    def recent(self) -> list[agent_pb2.RankExited]:
        """Oldest first."""
        since = self._clock() - RECENT_EXITS_SECONDS
        return [exited for at, exited in self._exits if at >= since]
