"""Replication to the buddy's checkpointd, and pulling a shard back from a peer.

A shard travels as a client stream of 4 MiB ShardChunks, the header on the first. The
chunks are produced only as fast as gRPC's stream flow control takes them, so a slow
buddy slows the push down instead of filling this daemon's memory. Pushes are retried
with jittered exponential backoff; only the newest sealed shard of each (job, rank)
waits to be pushed: a newer snapshot supersedes an older one still waiting or retrying.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    retry_if_exception_type,
    wait_random_exponential,
)

from pitstop.checkpointd.catalog import CatalogClient
from pitstop.checkpointd.errors import InvalidArgument
from pitstop.checkpointd.slots import Segment, SlotPool
from pitstop.checkpointd.store import ShardRecord
from pitstop.common.tls import NodeIdentity, open_channel
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
CHANNEL_IDLE_SECONDS = 600.0
"""A peer's channel not handed out for this long is closed (see Replicator.stub)."""
CHANNEL_CLOSE_GRACE = 60.0
"""Seconds a closed channel's calls still in flight get to finish."""
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.max_receive_message_length", 16 << 20),
]
"""A chunk is 4 MiB of data plus its header: above gRPC's default 4 MiB message limit."""


class NoBuddy(Exception):
    """Neither the configuration nor the scheduler names a buddy."""


class NoBuddyYet(NoBuddy):
    """The scheduler names no buddy now, but may later (a node joins, a failed push made
    it ask again): the shard waits for one."""


class PushRefused(Exception):
    """The buddy answered but did not store the shard (e.g. its memory budget is full)."""


_REFUSALS = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT})
"""How a buddy that is up refuses a push: full, or the bytes did not add up."""


class ShardStreamError(InvalidArgument):
    """A peer's stream of chunks did not add up to the shard its header announced."""


def transfer_timeout(size_bytes: int) -> float:
    """Seconds allowed for moving `size_bytes` over one stream: generous, but finite so
    that a hung peer is noticed."""
    return 30.0 + size_bytes / 20e6


def shard_chunks(header: checkpoint_pb2.ShardHeader, data: memoryview) -> Iterator[Any]:
    """The chunks of one shard, the header on the first."""
    for offset in range(0, max(len(data), 1), CHUNK_BYTES):
        chunk = checkpoint_pb2.ShardChunk(
            offset=offset, data=bytes(data[offset : offset + CHUNK_BYTES])
        )
        if offset == 0:
            chunk.header.CopyFrom(header)
        yield chunk


async def push_shard(
    stub: Any,
    header: checkpoint_pb2.ShardHeader,
    data: memoryview,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> checkpoint_pb2.PushShardResponse:
    """Push one shard over one PushShard stream (one attempt)."""

    async def chunks() -> AsyncIterator[checkpoint_pb2.ShardChunk]:
        for chunk in shard_chunks(header, data):
            yield chunk

    response: checkpoint_pb2.PushShardResponse = await stub.PushShard(
        chunks(), metadata=metadata, timeout=transfer_timeout(len(data))
    )
    return response


async def receive_chunks(
    chunks: AsyncIterator[checkpoint_pb2.ShardChunk],
    allocate: Callable[[checkpoint_pb2.ShardHeader], Awaitable[Segment]],
    release: Callable[[Segment], None],
) -> tuple[checkpoint_pb2.ShardHeader, Segment]:
    """Write a stream of chunks into a segment from `allocate` (given the header); the
    segment is released again if the stream does not add up."""
    header: checkpoint_pb2.ShardHeader | None = None
    segment: Segment | None = None
    received = 0
    try:
        async for chunk in chunks:
            if header is None:
                if not chunk.HasField("header"):
                    raise ShardStreamError("the first chunk carries no header")
                header = chunk.header
                segment = await allocate(header)
            assert segment is not None
            end = chunk.offset + len(chunk.data)
            if chunk.offset != received or end > header.size_bytes:
                raise ShardStreamError(
                    f"chunk at {chunk.offset}+{len(chunk.data)} does not follow byte {received}"
                    f" of a {header.size_bytes}-byte shard"
                )
            segment.view[chunk.offset : end] = chunk.data
            received = end
        if header is None:
            raise ShardStreamError("the stream ended before any chunk")
        if received != header.size_bytes:
            raise ShardStreamError(f"got {received} of {header.size_bytes} bytes")
    except BaseException:
        if segment is not None:
            release(segment)
        raise
    assert segment is not None
    return header, segment


class Replicator:
    """Pushes each newly sealed local shard to the buddy, in the background."""

    def __init__(
        self,
        catalog: CatalogClient,
        pool: SlotPool,
        *,
        token: str = "",
        retry_max_seconds: float = 30.0,
        identity: NodeIdentity | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._catalog = catalog
        self._clock = clock
        self._identity = identity
        self._pool = pool
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._retry_max = retry_max_seconds
        self._pending: dict[tuple[str, int], ShardRecord] = {}
        self._in_flight: ShardRecord | None = None
        self._wake = asyncio.Event()
        self._channels: dict[str, tuple[grpc.aio.Channel, Any]] = {}
        self._used: dict[str, float] = {}  # when each channel was last handed out
        self._closing: set[asyncio.Future[None]] = set()
        self._warned_no_buddy = False
        self.pushed_bytes = 0
        self.pushed_shards = 0

    def submit(self, record: ShardRecord) -> None:
        """Push `record` when its turn comes, instead of any older shard of its rank."""
        owner = (record.shard.job_id, record.shard.rank)
        older = self._pending.pop(owner, None)
        if older is not None and older is not self._in_flight:
            self._pool.unref(older.segment)
        self._pool.ref(record.segment)
        self._pending[owner] = record
        self._wake.set()

    def stub(self, address: str) -> Any:
        """A CheckpointService stub for the daemon at `address`. Channels are kept, but
        one unused for CHANNEL_IDLE_SECONDS is closed: a peer's daemon that restarted on
        another port, or a buddy replaced long ago, leaves an address no one calls."""
        now = self._clock()
        for idle in [a for a, at in self._used.items() if now - at > CHANNEL_IDLE_SECONDS]:
            if idle != address:
                del self._used[idle]
                channel, _ = self._channels.pop(idle)
                closing = asyncio.ensure_future(channel.close(CHANNEL_CLOSE_GRACE))
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
        if address not in self._channels:
            channel = open_channel(address, self._identity, aio=True, options=CHANNEL_OPTIONS)
            self._channels[address] = (channel, checkpoint_pb2_grpc.CheckpointServiceStub(channel))
        self._used[address] = now
        return self._channels[address][1]

    @property
    def peers(self) -> list[str]:
        """The addresses a channel is open to."""
        return sorted(self._channels)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Call metadata for peers (the bearer token)."""
        return self._metadata

    async def run(self) -> None:
        """Push pending shards, oldest first, until cancelled."""
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            owner = next(iter(self._pending))
            record = self._in_flight = self._pending[owner]
            try:
                await self._replicate(record)
            finally:
                self._in_flight = None
                if self._pending.get(owner) is record:
                    del self._pending[owner]
                self._pool.unref(record.segment)

    async def _replicate(self, record: ShardRecord) -> None:
        owner = (record.shard.job_id, record.shard.rank)

        def superseded(_: RetryCallState) -> bool:
            return self._pending.get(owner) is not record

        # Without a buddy now that the scheduler may name later (none assigned yet, or its
        # answer changed after a failed push) the shard waits for one like any failed
        # push: the newest snapshot of a rank that writes no more (stopped, or the last
        # of its run) must still reach a second node, or its step never commits.
        retrying = AsyncRetrying(
            wait=wait_random_exponential(multiplier=0.1, max=self._retry_max),
            retry=retry_if_exception_type((grpc.aio.AioRpcError, PushRefused, NoBuddyYet)),
            stop=superseded,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await self._push_once(record)
        except NoBuddy:
            pass  # no scheduler to name one: shards stay on this node (said once)
        except RetryError as exc:
            log.info(
                "push of %s given up (a newer one supersedes it): %s",
                record.shard,
                exc.last_attempt.exception(),
            )

    async def _push_once(self, record: ShardRecord) -> None:
        buddy = await self._catalog.buddy()
        if buddy is None:
            if not self._warned_no_buddy:
                log.warning("no buddy configured or assigned: shards stay on this node for now")
                self._warned_no_buddy = True
            raise NoBuddyYet() if self._catalog.may_name_buddy else NoBuddy()
        try:
            response = await push_shard(
                self.stub(buddy.address), record.header(), record.data(), self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REFUSALS:
                log.warning("buddy %s refused %s: %s", buddy.address, record.shard, exc.details())
                raise PushRefused(exc.details()) from None
            log.warning(
                "push of %s to %s failed: %s %s",
                record.shard,
                buddy.address,
                exc.code().name,
                exc.details(),
            )
            self._catalog.forget_buddy()
            raise
        if not response.stored:  # a buddy from before refusals were status codes
            log.warning("buddy %s refused %s", buddy.address, record.shard)
            raise PushRefused(f"buddy {buddy.address} did not store {record.shard}")
        self._warned_no_buddy = False
        self.pushed_bytes += record.size
        self.pushed_shards += 1

    async def close(self) -> None:
        """Drop what is pending and close the channels."""
        for record in self._pending.values():
            if record is not self._in_flight:
                self._pool.unref(record.segment)
        self._pending.clear()
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._used.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
