"""Open agent streams held by this process, and the commands queued down them."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

from pitstop.v1 import agent_pb2


@dataclass(frozen=True)
class CloseStream:
    """Put on a stream's queue to end it; the reason is recorded."""

    reason: str


class AgentGateway:
    """node id -> the outbound queue of that node's open stream (one per node)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._command_ids = itertools.count(1)

    def attach(self, node_id: str) -> asyncio.Queue[Any]:
        """Own the node's stream. An older stream of the same node is told to close."""
        old = self._queues.get(node_id)
        if old is not None:
            old.put_nowait(CloseStream("replaced by a newer stream from the same node"))
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[node_id] = queue
        return queue

    def detach(self, node_id: str, queue: asyncio.Queue[Any]) -> bool:
        """Forget the stream if it is still the node's current one; True if it was."""
        if self._queues.get(node_id) is queue:
            del self._queues[node_id]
            return True
        return False

    def close(self, node_id: str, reason: str) -> bool:
        """End the node's stream (its agent will reconnect and register again)."""
        queue = self._queues.get(node_id)
        if queue is None:
            return False
        queue.put_nowait(CloseStream(reason))
        return True

    def connected(self, node_id: str) -> bool:
        return node_id in self._queues

    async def send(self, node_id: str, **body: Any) -> int | None:
        """Queue one command (``fault=...``, ``start_ranks=...``); its id, or None if the
        node has no stream here."""
        queue = self._queues.get(node_id)
        if queue is None:
            return None
        command_id = next(self._command_ids)
        ((key, value),) = body.items()
        field = "inject_fault" if key == "fault" else key
        await queue.put(agent_pb2.SchedulerMessage(command_id=command_id, **{field: value}))
        return command_id

    @staticmethod
    def is_close(item: object) -> bool:
        return isinstance(item, CloseStream)
