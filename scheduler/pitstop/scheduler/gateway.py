"""Open agent streams held by this process, and the commands queued down them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import struct
import uuid
from collections import Counter
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
            heard = await self.hot.publish(channel, frame)
            if not heard and channel != self.channel:  # its holder is gone: ask everyone
                await self.hot.publish(self.channel, frame)
        except RedisError:
            log.warning("cannot route a command to node %s: Redis unreachable", node_id)
            return None
        return 0

    async def send_many(self, commands: list[tuple[str, agent_pb2.SchedulerMessage]]) -> None:
        """`send` for a fan-out: the commands for streams held here go down them, all the
        others go to Redis in one pipelined round trip, batched per holding process (a
        frame of up to BATCH_COMMANDS commands to its channel), not one PUBLISH a node:
        12,500 of them at full scale, each parsed again by Redis and by its receiver. A
        message given for many nodes (the same object: a recovery's survivors all get
        one) is serialized once and goes to each holding process as one broadcast frame,
        its bytes and the nodes' ids, which that process parses once."""
        shared = Counter(id(message) for _, message in commands)
        remote: dict[str, list[tuple[str, bytes]]] = {}
        broadcast: dict[tuple[int, str], list[str]] = {}
        encoded: dict[int, bytes] = {}
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
            key = id(message)
            if shared[key] > 1:
                encoded.setdefault(key, message.SerializeToString())
                broadcast.setdefault((key, channel), []).append(node_id)
            else:
                remote.setdefault(channel, []).append((node_id, message.SerializeToString()))
        if not remote and not broadcast:
            return
        frames = [
            (channel, _batch_frame(entries[at : at + BATCH_COMMANDS]))
            for channel, entries in remote.items()
            for at in range(0, len(entries), BATCH_COMMANDS)
        ]
        frames += [
            (channel, _broadcast_frame(encoded[key], nodes[at : at + BROADCAST_NODES]))
            for (key, channel), nodes in broadcast.items()
            for at in range(0, len(nodes), BROADCAST_NODES)
        ]
        try:
            heard = await self.hot.publish_all(frames)
            # A holder gone: ask everyone (whoever holds the stream now forwards it).
            unheard = [
                frame
                for (channel, frame), listeners in zip(frames, heard, strict=True)
                if not listeners and channel != self.channel
            ]
            if unheard:
                await self.hot.publish_all([(self.channel, frame) for frame in unheard])
        except RedisError:
            count = sum(len(entries) for entries in remote.values())
            log.warning("cannot route %d commands: Redis unreachable", count)

    async def close(self, node_id: str, reason: str) -> None:
        """Close the node's agent stream wherever it is held (a revoked node)."""
        if self.gateway.close(node_id, reason):
            return
        try:
            await self.hot.publish(self.channel, _frame(CLOSE, node_id, reason.encode()))
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
            notice = _frame(HOLDER, node_id, self.process_id.encode())
            await self.hot.name_stream_holder(node_id, self.process_id, self.channel, notice)
        except RedisError:
            log.debug("could not name this process node %s's holder", node_id, exc_info=True)

    async def _listen(self) -> None:
        while True:
            try:
                async with self.hot.subscribed(self.channel, self.own_channel) as messages:
                    # After subscribing: a claim made meanwhile arrives as a notice.
                    for node, holder in (await self.hot.stream_holders()).items():
                        self.holders.setdefault(node, holder)
                    async for item in messages:
                        try:
                            await self._handle(item["channel"], item["data"])
                        except (ValueError, DecodeError) as exc:  # one bad frame, not the loop
                            log.warning("command router: a frame it cannot read: %s", exc)
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
        elif kind in (COMMAND, BATCH):
            entries = [(node_id, body)] if kind == COMMAND else _unbatch(body)
            moved = []
            for node, command in entries:
                if self.gateway.connected(node):
                    await self.gateway.forward(node, agent_pb2.SchedulerMessage.FromString(command))
                else:
                    moved.append((node, command))
            if moved and _text(channel) == self.own_channel:
                # Sent here on a stale holder: those streams moved. Whoever holds them
                # now hears them on the shared channel; the sender learns the new
                # holder from that process's notice.
                await self.hot.publish(self.channel, _batch_frame(moved))
        elif kind == BROADCAST:
            encoded, nodes = _unbroadcast(body)
            message = agent_pb2.SchedulerMessage.FromString(encoded)  # once, for all of them
            away = []
            for node in nodes:
                if self.gateway.connected(node):
                    await self.gateway.forward(node, message)
                else:
                    away.append(node)
            if away and _text(channel) == self.own_channel:
                await self.hot.publish(self.channel, _broadcast_frame(encoded, away))


COMMAND, CLOSE, HOLDER, BATCH, BROADCAST = b"M", b"C", b"H", b"B", b"R"
"""Kinds of router frames: a command for a node, a stream to close, a stream's holder,
commands for several nodes, one command for several nodes."""
BATCH_COMMANDS = 1000
"""Commands per batch frame at most (about 330 kB: well under what Redis lets a
subscriber's output buffer hold)."""
BROADCAST_NODES = 5000
"""Node ids per broadcast frame at most (about 50 kB of ids)."""
_LENGTH = struct.Struct(">I")


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


def _batch_frame(entries: list[tuple[str, bytes]]) -> bytes:
    """A batch frame: its kind, an empty node id, NUL, then per command the node id, NUL,
    the command's length (4 bytes, big-endian) and its bytes."""
    parts = [BATCH, b"\0"]
    for node_id, body in entries:
        parts += (node_id.encode(), b"\0", _LENGTH.pack(len(body)), body)
    return b"".join(parts)


def _broadcast_frame(encoded: bytes, node_ids: list[str]) -> bytes:
    """A broadcast frame: its kind, an empty node id, NUL, the command's length (4 bytes,
    big-endian) and its bytes, then the node ids, NUL between them."""
    ids = b"\0".join(node.encode() for node in node_ids)
    return b"".join((BROADCAST, b"\0", _LENGTH.pack(len(encoded)), encoded, ids))


def _unbroadcast(body: bytes) -> tuple[bytes, list[str]]:
    """The command bytes and the node ids of a broadcast frame's body."""
    if len(body) < _LENGTH.size:
        raise ValueError(f"a broadcast frame cut short: {len(body)} bytes")
    (length,) = _LENGTH.unpack_from(body, 0)
    end = _LENGTH.size + length
    if end > len(body):
        raise ValueError(f"a broadcast frame cut short at {len(body)} of {end} bytes")
    ids = body[end:]
    return body[_LENGTH.size : end], [n.decode() for n in ids.split(b"\0")] if ids else []


def _unbatch(body: bytes) -> list[tuple[str, bytes]]:
    """The (node id, command bytes) of a batch frame's body."""
    entries, at = [], 0
    while at < len(body):
        end = body.find(b"\0", at)
        if end < 0 or end + 1 + _LENGTH.size > len(body):
            raise ValueError(f"a batch frame cut short at byte {at} of {len(body)}")
        (length,) = _LENGTH.unpack_from(body, end + 1)
        start = end + 1 + _LENGTH.size
        if start + length > len(body):
            raise ValueError(f"a batch frame cut short at byte {at} of {len(body)}")
        entries.append((body[at:end].decode(), body[start : start + length]))
        at = start + length
    return entries
