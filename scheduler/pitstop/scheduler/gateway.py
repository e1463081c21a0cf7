"""Open agent streams held by this process, and the commands queued down them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from pitstop.scheduler.hotstate import HotState
from pitstop.v1 import agent_pb2

log = logging.getLogger(__name__)


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

    def close_all(self, reason: str) -> int:
        """End every stream held here (shutdown: the agents reconnect to another scheduler
        process rather than hold this one's grace); returns how many."""
        for queue in self._queues.values():
            queue.put_nowait(CloseStream(reason))
        return len(self._queues)

    def connected(self, node_id: str) -> bool:
        return node_id in self._queues

    async def forward(self, node_id: str, message: agent_pb2.SchedulerMessage) -> int | None:
        """Queue a ready-made command under a fresh id; None if no stream here."""
        queue = self._queues.get(node_id)
        if queue is None:
            return None
        command = agent_pb2.SchedulerMessage()
        command.CopyFrom(message)
        command.command_id = next(self._command_ids)
        await queue.put(command)
        return command.command_id


class CommandRouter:
    """Delivers a command to a node's agent wherever its stream is held: straight down
    the stream when this process holds it, else over Redis pub/sub to every scheduler
    process, where the one holding the stream forwards it."""

    def __init__(self, gateway: AgentGateway, hot: HotState) -> None:
        self.gateway = gateway
        self.hot = hot
        self.channel = hot.commands_channel
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="command-router")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def send(self, node_id: str, message: agent_pb2.SchedulerMessage) -> int | None:
        """The command id when delivered here; 0 when handed to the other processes; None
        when Redis is unreachable too (the caller decides whether that matters)."""
        if self.gateway.connected(node_id):
            return await self.gateway.forward(node_id, message)
        payload = json.dumps({"node": node_id, "message": message.SerializeToString().hex()})
        try:
            await self.hot.redis.publish(self.channel, payload)
        except RedisError:
            log.warning("cannot route a command to node %s: Redis unreachable", node_id)
            return None
        return 0

    async def close(self, node_id: str, reason: str) -> None:
        """Close the node's agent stream wherever it is held (a revoked node)."""
        if self.gateway.close(node_id, reason):
            return
        payload = json.dumps({"node": node_id, "close": reason})
        try:
            await self.hot.redis.publish(self.channel, payload)
        except RedisError:
            log.warning("cannot close node %s's stream elsewhere: Redis unreachable", node_id)

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.hot.redis.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self.channel)
                try:
                    async for item in pubsub.listen():
                        data = json.loads(item["data"])
                        if "close" in data:
                            self.gateway.close(data["node"], data["close"])
                            continue
                        # Every process hears every command: only the one holding the
                        # node's stream decodes it (a command carries the job's whole rank
                        # map; bench/scale.py saw fan-out slow with each process added).
                        if not self.gateway.connected(data["node"]):
                            continue
                        message = agent_pb2.SchedulerMessage.FromString(
                            bytes.fromhex(data["message"])
                        )
                        await self.gateway.forward(data["node"], message)
                finally:
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, ValueError, KeyError):
                log.debug("command router: retrying after an error", exc_info=True)
                await asyncio.sleep(1.0)
