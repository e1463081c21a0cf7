"""Redis: hot state that may be lost and is rebuilt by the next heartbeats.

Nothing here is the only copy of a decision. Event notifications are hints:
watchers re-read the event log from PostgreSQL, so a lost notification costs
latency, never an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pitstop.v1 import agent_pb2

STANDBY_READY = "standby_ready"
"""Key in a node's live health: the jobs whose standby process there waits for a rank."""

log = logging.getLogger(__name__)


def with_received_at(health: str, at: float) -> str:
    """The JSON object `health` with ``received_at`` set to `at`, without parsing it."""
    body = health.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError(f"live health must be a JSON object, not {health[:80]!r}")
    rest = body[1:-1].strip()
    return f'{{"received_at": {json.dumps(at)}{", " + rest if rest else ""}}}'


MAX_CONNECTIONS = 64
"""Redis connections per scheduler process. A call finding all of them busy waits for
one (up to POOL_WAIT_SECONDS) instead of failing: redis-py's plain pool raised
MaxConnectionsError past 100 at once, which ended agent streams under a fleet's load."""
POOL_WAIT_SECONDS = 2.0


class HotState:
    """Typed access to the scheduler's Redis keys and channels, all under one prefix.

    The one owner of them: the rest of the scheduler reaches Redis through its methods
    (pub/sub included), never through `redis` itself."""

    def __init__(self, client: aioredis.Redis, prefix: str = "pitstop:") -> None:
        self.redis = client
        self.prefix = prefix
        self.events_channel = f"{prefix}events"
        self.deadlines_key = f"{prefix}liveness"
        self.stream_holders_key = f"{prefix}stream-holders"
        """Hash: node id -> the scheduler process holding its agent stream."""
        self.suspects = Suspects(client, f"{prefix}suspects")
        # Heartbeats waiting for the next write (node id -> deadline, live health),
        # the future their callers await, and the task writing them.
        self._beats: dict[str, tuple[float, str]] = {}
        self._beats_written: asyncio.Future[None] | None = None
        self._beat_writer: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, prefix: str = "pitstop:") -> HotState:
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=POOL_WAIT_SECONDS,
            socket_connect_timeout=2,
            socket_timeout=2,
            health_check_interval=10,
        )
        return cls(aioredis.Redis.from_pool(pool), prefix)

    @property
    def live_health_key(self) -> str:
        """Hash: node id -> its live health as its last heartbeat said it (JSON, with
        ``received_at``); a node forgotten when lost."""
        return f"{self.prefix}live-health"

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def close(self) -> None:
        if self._beat_writer is not None:
            self._beat_writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat_writer
        await self.redis.aclose()

    async def notify_event(self, event_id: int) -> None:
        """Tell every scheduler process's watchers that the log grew. Best effort."""
        try:
            await self.redis.publish(self.events_channel, str(event_id))
        except RedisError:
            log.warning("redis unreachable: event %d not announced; watchers poll", event_id)

    async def record_heartbeat(
        self,
        node_id: str,
        deadline_s: float,
        health: str = "{}",
        now: float | None = None,
    ) -> None:
        """Push the node's liveness deadline and keep its live health: `health` is a JSON
        object (NodeHealth, with ``standby_ready``: the jobs whose standby process there
        waits for a rank), kept with ``received_at`` added (a decision may only trust a
        report newer than its cause). It comes as text: a stream whose health did not
        change sends the same text again, serialized once."""
        at = time.time() if now is None else now
        live = with_received_at(health, at)
        # Every stream's heartbeats go out together: one pipeline (one ZADD for all the
        # deadlines) per write, one write in flight; what arrives meanwhile waits for the
        # next. Returns once this heartbeat is in Redis, raising what the write raised.
        self._beats[node_id] = (at + deadline_s, live)
        if self._beats_written is None:
            self._beats_written = asyncio.get_running_loop().create_future()
            self._beats_written.add_done_callback(_retrieved)
        written = self._beats_written
        if self._beat_writer is None or self._beat_writer.done():
            self._beat_writer = asyncio.create_task(self._write_beats(), name="heartbeat-writer")
        await asyncio.shield(written)

    async def _write_beats(self) -> None:
        while self._beats:
            beats, self._beats = self._beats, {}
            written, self._beats_written = self._beats_written, None
            assert written is not None
            try:
                # Two commands whatever the count: redis-py packs and parses in Python,
                # and a SET a node cost an ingest process a third of its time at rest.
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.zadd(self.deadlines_key, {node: d for node, (d, _) in beats.items()})
                    pipe.hset(self.live_health_key, mapping={n: h for n, (_, h) in beats.items()})
                    await pipe.execute()
            except asyncio.CancelledError:
                written.cancel()
                raise
            except Exception as exc:  # every heartbeat of the write fails with it
                written.set_exception(exc)
            else:
                written.set_result(None)

    async def ready_standbys(self, job_id: str, node_ids: Iterable[str]) -> set[str]:
        """Which of `node_ids` hold a standby process of `job_id` that waits for a rank
        now (its imports done), as their last heartbeats said."""
        nodes = sorted(node_ids)
        if not nodes:
            return set()
        raw = await self.redis.hmget(self.live_health_key, nodes)
        return {
            node
            for node, live in zip(nodes, raw, strict=True)
            if live is not None and job_id in json.loads(live).get(STANDBY_READY, ())
        }

    def rank_stats_key(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}:rank-stats"

    @property
    def commands_channel(self) -> str:
        """Pub/sub channel of commands for whichever process holds a node's stream; each
        process also listens on this name with its own id appended."""
        return f"{self.prefix}node-commands"

    async def publish(self, channel: str, message: bytes | str) -> int:
        """Publish on `channel`; how many subscribers heard it."""
        return int(await self.redis.publish(channel, message))

    async def publish_all(self, messages: list[tuple[str, bytes]]) -> list[int]:
        """Publish each (channel, message) in one round trip; how many heard each."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for channel, message in messages:
                pipe.publish(channel, message)
            return [int(n) for n in await pipe.execute()]

    @contextlib.asynccontextmanager
    async def subscribed(self, *channels: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """The messages of `channels` (subscription notices left out), while inside."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(*channels)
        # redis-py types aclose from 8.x on; a typed name for it holds for every release
        # the range allows, where an ignore comment would be unused on some of them.
        close: Callable[[], Awaitable[None]] = pubsub.aclose
        try:
            yield pubsub.listen()
        finally:
            await close()

    async def name_stream_holder(
        self, node_id: str, process_id: str, channel: str, notice: bytes
    ) -> None:
        """Record `process_id` as the holder of the node's agent stream and publish
        `notice` on `channel`, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.stream_holders_key, node_id, process_id)
            pipe.publish(channel, notice)
            await pipe.execute()

    async def stream_holders(self) -> dict[str, str]:
        """node id -> the scheduler process holding its agent stream, as recorded."""
        known = await self.redis.hgetall(self.stream_holders_key)
        return {_text(node): _text(holder) for node, holder in known.items()}

    async def node_health(self, node_id: str) -> dict[str, Any] | None:
        """The node's live health as its last heartbeat reported it (with received_at)."""
        raw = await self.redis.hget(self.live_health_key, node_id)
        return None if raw is None else dict(json.loads(raw))

    async def rank_stats(self, job_id: str) -> list[dict[str, Any]]:
        """The job's per-rank step-time statistics, as the leader last computed them."""
        raw = await self.redis.get(self.rank_stats_key(job_id))
        return [] if raw is None else list(json.loads(raw))

    async def set_rank_stats(self, job_id: str, stats: list[dict[str, Any]]) -> None:
        await self.redis.set(self.rank_stats_key(job_id), json.dumps(stats))

    def steps_key(self, job_id: str) -> str:
        return f"{self.prefix}steps:{job_id}"

    def windows_key(self, job_id: str) -> str:
        return f"{self.prefix}step-windows:{job_id}"

    async def record_step_summaries(
        self, by_job: dict[str, list[agent_pb2.StepSummary]], keep: int = 100_000
    ) -> None:
        """Append each job's step summaries (of any number of nodes) to the job's capped
        stream as one entry, and those that closed straggler windows to the job's window
        stream as another: one summary in about a window's steps carries any, and a page
        that opens the job reads back that far for its heatmap. One round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id, summaries in by_job.items():
                if not job_id or not summaries:
                    continue
                batch = agent_pb2.StepSummaries(summaries=summaries)
                pipe.xadd(
                    self.steps_key(job_id),
                    {SUMMARIES: batch.SerializeToString()},
                    maxlen=keep,
                    approximate=True,
                )
                windows = [
                    agent_pb2.StepSummary(
                        job_id=s.job_id,
                        generation=s.generation,
                        node_id=s.node_id,
                        windows=s.windows,
                    )
                    for s in summaries
                    if s.windows
                ]
                if windows:
                    only = agent_pb2.StepSummaries(summaries=windows)
                    pipe.xadd(
                        self.windows_key(job_id),
                        {SUMMARIES: only.SerializeToString()},
                        maxlen=keep,
                        approximate=True,
                    )
            await pipe.execute()

    async def step_summaries_after(
        self, job_id: str, cursor: str, newest: int, *, windows: bool = False
    ) -> tuple[list[agent_pb2.StepSummary], str]:
        """The summaries of the job's steps stream (its window stream with `windows`)
        after entry `cursor` (the newest `newest`, for none yet), and the new cursor."""
        key = self.windows_key(job_id) if windows else self.steps_key(job_id)
        entries: list[Any]
        if not cursor:
            latest = await self.redis.xrevrange(key, count=newest)
            entries = list(reversed(cast(list[Any], latest or [])))
        else:
            entries = cast(list[Any], await self.redis.xrange(key, min=f"({cursor}", count=20_000))
        summaries = []
        for entry_id, fields in entries or []:
            cursor = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            summaries += _summaries(fields)
        return summaries, cursor

    async def read_step_summaries(
        self, cursors: dict[str, str], count: int = 10_000
    ) -> list[tuple[str, str, agent_pb2.StepSummary]]:
        """(job id, entry id, summary) for the summaries after each job's cursor entry id."""
        if not cursors:
            return []
        streams: dict[Any, Any] = {self.steps_key(job): last for job, last in cursors.items()}
        replies = cast(list[Any], await self.redis.xread(streams, count=count))
        batches = []
        for key, entries in replies or []:
            job_id = _text(key).rsplit(":", 1)[1]
            for entry_id, fields in entries:
                batches += [(job_id, _text(entry_id), s) for s in _summaries(fields)]
        return batches

    async def expired_nodes(self, now: float, limit: int = 1000) -> list[str]:
        """Nodes whose liveness deadline passed, claimed: each is returned to one caller only
        (ZREM decides), so the cost follows what expired, not the fleet's size."""
        due = cast(
            list[bytes],
            await self.redis.zrangebyscore(self.deadlines_key, "-inf", now, start=0, num=limit),
        )
        if not due:
            return []
        # One round trip for all the claims; each ZREM's reply still decides its owner.
        async with self.redis.pipeline(transaction=False) as pipe:
            for raw in due:
                pipe.zrem(self.deadlines_key, raw)
            removed = await pipe.execute()
        return [
            raw.decode() if isinstance(raw, bytes) else str(raw)
            for raw, won in zip(due, removed, strict=True)
            if won
        ]

    async def reclaimable(self, node_ids: list[str], deadline: float) -> None:
        """Put claimed nodes back with `deadline`, so a later scan claims them again (after
        marking them failed); a node that beat meanwhile keeps its newer deadline."""
        if node_ids:
            await self.redis.zadd(self.deadlines_key, dict.fromkeys(node_ids, deadline), nx=True)

    async def extend_deadlines(self, at_least: float) -> None:
        """Give every known node until ``at_least``: used when a leader starts, so agents
        that are reconnecting after a scheduler restart are not declared lost."""
        members = cast(list[bytes], await self.redis.zrange(self.deadlines_key, 0, -1))
        if members:
            pushed: dict[bytes, float] = dict.fromkeys(members, at_least)
            await self.redis.zadd(self.deadlines_key, pushed, gt=True)

    async def keep_deadlines(self, node_ids: Collection[str], deadline: float) -> None:
        """Push the deadlines of the nodes whose streams this process holds, and judges
        itself, to `deadline` (never back, never for a node no longer known): the leader's
        scan is left the nodes whose holder stopped keeping them (it died or froze)."""
        ids = sorted(node_ids)
        for at in range(0, len(ids), 1000):
            members = dict.fromkeys(ids[at : at + 1000], deadline)
            await self.redis.zadd(self.deadlines_key, members, xx=True, gt=True)

    async def forget_node(self, node_id: str) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.deadlines_key, node_id)
            pipe.hdel(self.live_health_key, node_id)
            await pipe.execute()


class Suspects:
    """Nodes whose stream ended while whether their host answers is not known yet (a
    sorted set: node id -> when the stream ended): the leader counts them toward a mass
    loss meanwhile (pitstop.health.massloss)."""

    def __init__(self, client: aioredis.Redis, key: str) -> None:
        self.redis = client
        self.key = key

    async def add(self, node_id: str, at: float) -> None:
        await self.redis.zadd(self.key, {node_id: at})

    async def discard(self, node_id: str) -> None:
        await self.redis.zrem(self.key, node_id)

    async def since(self, since: float) -> dict[str, float]:
        """The suspects whose stream ended at `since` or later (node id -> when); older
        ones, left by a process that died while asking, are dropped."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(self.key, "-inf", f"({since}")
            pipe.zrange(self.key, 0, -1, withscores=True)
            _, found = await pipe.execute()
        return {_text(node): float(at) for node, at in found}


SUMMARIES = "summaries"
"""A step-stream entry's field: a StepSummaries of several nodes (its one summary under
the field "batch" in entries written before)."""


def _summaries(fields: dict[bytes, bytes]) -> list[agent_pb2.StepSummary]:
    """The step summaries of one stream entry, in either form."""
    if b"summaries" in fields:
        return list(agent_pb2.StepSummaries.FromString(fields[b"summaries"]).summaries)
    return [agent_pb2.StepSummary.FromString(fields[b"batch"])]


def _retrieved(future: asyncio.Future[None]) -> None:
    """A failed write whose waiters all left is not an unretrieved exception."""
    if not future.cancelled():
        future.exception()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class EventBus:
    """Wakes this process's watchers when the event log grows, here or in another process."""

    def __init__(self, hot: HotState) -> None:
        self._hot = hot
        # Replaced on every wake-up: waiters hold the one that was current when they began.
        self._changed = asyncio.Event()
        self._version = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="event-bus")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def announce(self, event_ids: list[int]) -> None:
        """Wake local watchers now and tell the other processes through Redis."""
        if not event_ids:
            return
        self._wake()
        await self._hot.notify_event(max(event_ids))

    async def wait(self, seen_version: int, timeout: float) -> int:
        """Wait until the log may have grown past ``seen_version`` or ``timeout`` passes."""
        if self._version == seen_version:
            changed = self._changed
            # No lock is held while waiting, so a watcher abandoned mid-wait (client gone,
            # server stopping) leaves nothing half-released behind.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await changed.wait()
        return self._version

    @property
    def version(self) -> int:
        return self._version

    def _wake(self) -> None:
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def _listen(self) -> None:
        # Reconnects forever: a Redis outage only slows watchers down to their poll.
        while True:
            try:
                async with self._hot.subscribed(self._hot.events_channel) as messages:
                    async for _message in messages:
                        self._wake()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError):
                log.debug("event bus: redis unreachable, retrying", exc_info=True)
                await asyncio.sleep(1.0)


async def host_signals(hot: HotState, node_ids: Iterable[str]) -> str:
    """What the hosts of `node_ids` report wrong now (their links, memory, disks, PCIe),
    as their last heartbeats said: "node-12's host: infiniband link mlx5_1/1 flapped 4
    times in 60 s", one clause a node, "; "-joined; "" when all are quiet. What a hang or
    a straggler is explained by."""
    nodes = sorted(set(node_ids))
    if not nodes:
        return ""
    raw = await hot.redis.hmget(hot.live_health_key, nodes)
    said = []
    for node, live in zip(nodes, raw, strict=True):
        reasons = json.loads(live).get("host", {}).get("reasons", []) if live else []
        if reasons:
            said.append(f"{node}'s host: {', '.join(reasons)}")
    return "; ".join(said)
