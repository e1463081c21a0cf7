"""Open agent streams held by this process, and the commands queued down them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
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
        self.on_attach: Callable[[str], None] | None = None
        """Called with the node id when this process takes a node's stream."""

    def attach(self, node_id: str) -> asyncio.Queue[Any]:
        """Own the node's stream. An older stream of the same node is told to close."""
        old = self._queues.get(node_id)
        if old is not None:
            old.put_nowait(CloseStream("replaced by a newer stream from the same node"))
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[node_id] = queue
        if self.on_attach is not None:
            self.on_attach(node_id)
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
    the stream when this process holds it, else over Redis pub/sub to the process that
    holds it.

    Each process has a channel of its own. Taking a stream, a process names itself the
    node's holder (a Redis hash, and a notice every process folds into its local map),
    so a command goes to one process, not to all of them, and costs no lookup per send.
    Where the holder is not known yet (a process just started) or is stale (the stream
    moved while a notice was lost), the command goes to the shared channel, where only
    the process holding the stream forwards it. The payload is the command's protobuf
    bytes behind the node id: no JSON, no hex."""

    def __init__(self, gateway: AgentGateway, hot: HotState) -> None:
        self.gateway = gateway
        self.hot = hot
        self.channel = hot.commands_channel
        self.process_id = uuid.uuid4().hex[:12]
        self.own_channel = f"{self.channel}:{self.process_id}"
        self.holders: dict[str, str] = {}
        """node id -> the process holding its stream, as last heard."""
        self._task: asyncio.Task[None] | None = None
        self._claims: set[asyncio.Task[None]] = set()
        gateway.on_attach = self._attached

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="command-router")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._claims) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def send(self, node_id: str, message: agent_pb2.SchedulerMessage) -> int | None:
        """The command id when delivered here; 0 when handed to the other processes; None
        when Redis is unreachable too (the caller decides whether that matters)."""
        if self.gateway.connected(node_id):
            return await self.gateway.forward(node_id, message)
        holder = self.holders.get(node_id)
        channel = (
            f"{self.channel}:{holder}"
            if holder is not None and holder != self.process_id
            else self.channel
        )
        frame = _frame(COMMAND, node_id, message.SerializeToString())
        try:
            heard = await self.hot.redis.publish(channel, frame)
            if not heard and channel != self.channel:  # its holder is gone: ask everyone
                await self.hot.redis.publish(self.channel, frame)
        except RedisError:
            log.warning("cannot route a command to node %s: Redis unreachable", node_id)
            return None
        return 0

    async def send_many(self, commands: list[tuple[str, agent_pb2.SchedulerMessage]]) -> None:
        """`send` for a fan-out: the commands for streams held here go down them, all the
        others go to Redis in one pipelined round trip (one PUBLISH a node, to its
        holder's channel), not one round trip a node: 12,500 of them at full scale."""
        remote: list[tuple[str, bytes]] = []
        for node_id, message in commands:
            if self.gateway.connected(node_id):
                await self.gateway.forward(node_id, message)
                continue
            holder = self.holders.get(node_id)
            channel = (
                f"{self.channel}:{holder}"
                if holder is not None and holder != self.process_id
                else self.channel
            )
            remote.append((channel, _frame(COMMAND, node_id, message.SerializeToString())))
        if not remote:
            return
        try:
            async with self.hot.redis.pipeline(transaction=False) as pipe:
                for channel, frame in remote:
                    pipe.publish(channel, frame)
                heard = await pipe.execute()
            # A holder gone: ask everyone (whoever holds the stream now forwards it).
            unheard = [
                frame
                for (channel, frame), listeners in zip(remote, heard, strict=True)
                if not listeners and channel != self.channel
            ]
            if unheard:
                async with self.hot.redis.pipeline(transaction=False) as pipe:
                    for frame in unheard:
                        pipe.publish(self.channel, frame)
                    await pipe.execute()
        except RedisError:
            log.warning("cannot route %d commands: Redis unreachable", len(remote))

    async def close(self, node_id: str, reason: str) -> None:
        """Close the node's agent stream wherever it is held (a revoked node)."""
        if self.gateway.close(node_id, reason):
            return
        try:
            await self.hot.redis.publish(self.channel, _frame(CLOSE, node_id, reason.encode()))
        except RedisError:
            log.warning("cannot close node %s's stream elsewhere: Redis unreachable", node_id)

    def _attached(self, node_id: str) -> None:
        self.holders[node_id] = self.process_id
        task = asyncio.get_running_loop().create_task(self._claim(node_id))
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)

    async def _claim(self, node_id: str) -> None:
        """Name this process the node's holder, for every process (best effort: without
        it, commands for the node take the shared channel)."""
        try:
            async with self.hot.redis.pipeline(transaction=False) as pipe:
                pipe.hset(self.hot.stream_holders_key, node_id, self.process_id)
                pipe.publish(self.channel, _frame(HOLDER, node_id, self.process_id.encode()))
                await pipe.execute()
        except RedisError:
            log.debug("could not name this process node %s's holder", node_id, exc_info=True)

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.hot.redis.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self.channel, self.own_channel)
                try:
                    # After subscribing: a claim made meanwhile arrives as a notice.
                    known = await self.hot.redis.hgetall(self.hot.stream_holders_key)
                    for node, holder in known.items():
                        self.holders.setdefault(_text(node), _text(holder))
                    async for item in pubsub.listen():
                        try:
                            await self._handle(item["channel"], item["data"])
                        except (ValueError, DecodeError) as exc:  # one bad frame, not the loop
                            log.warning("command router: a frame it cannot read: %s", exc)
                finally:
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError, ValueError):
                log.debug("command router: retrying after an error", exc_info=True)
                await asyncio.sleep(1.0)

    async def _handle(self, channel: bytes | str, data: bytes) -> None:
        kind, node_id, body = _unframe(data)
        if kind == HOLDER:
            self.holders[node_id] = body.decode()
        elif kind == CLOSE:
            self.gateway.close(node_id, body.decode(errors="replace"))
        elif kind == COMMAND:
            if self.gateway.connected(node_id):
                message = agent_pb2.SchedulerMessage.FromString(body)
                await self.gateway.forward(node_id, message)
            elif _text(channel) == self.own_channel:
                # Sent here on a stale holder: the stream moved. Whoever holds it now
                # hears it on the shared channel; the sender learns the new holder from
                # that process's notice.
                await self.hot.redis.publish(self.channel, data)


COMMAND, CLOSE, HOLDER = b"M", b"C", b"H"
"""Kinds of router frames: a command for a node, a stream to close, a stream's holder."""


def _frame(kind: bytes, node_id: str, body: bytes) -> bytes:
    """One router frame: kind, node id, NUL, body (node ids hold no NUL)."""
    return kind + node_id.encode() + b"\0" + body


def _unframe(data: bytes) -> tuple[bytes, str, bytes]:
    node, sep, body = data[1:].partition(b"\0")
    if not sep:
        raise ValueError(f"a command router frame without its node id: {data[:40]!r}")
    return data[:1], node.decode(), body


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
