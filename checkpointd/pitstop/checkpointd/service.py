"""CheckpointService over grpc.aio: decode, call the daemon, encode. Nothing here
catches an error: the daemon raises domain errors (errors.py) and one interceptor
(interceptors.py) turns them into status codes, so no response carries an error.

The servicer knows the daemon only as `Backend`, the methods it calls: the daemon
(daemon.py) imports this module to serve, and this module imports nothing of it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import grpc

from pitstop.checkpointd.errors import InvalidArgument, PermissionDenied
from pitstop.checkpointd.slots import Segment
from pitstop.checkpointd.store import ShardRecord, Tier
from pitstop.rankside.durable import valid_name
from pitstop.rankside.shards import ShardId
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc


class Backend(Protocol):
    """What the servicer asks of the daemon (CheckpointDaemon is the one there is)."""

    @property
    def node_id(self) -> str: ...

    async def acquire_slot(self, shard: ShardId, size_bytes: int) -> Segment: ...

    async def lease_next(self, sealed: ShardId, size_bytes: int) -> Segment | None: ...

    def seal_slot(
        self, shard: ShardId, generation: int, shm_name: str, size_bytes: int
    ) -> None: ...

    def other_sources(self) -> tuple[str, str]: ...

    async def receive_replica(
        self,
        chunks: AsyncIterator[checkpoint_pb2.ShardChunk],
        admitted: Callable[[str], Awaitable[None]] | None = None,
    ) -> None: ...

    async def is_member(self, job_id: str, node_id: str) -> bool: ...

    def pull_chunks(self, shard: ShardId) -> AsyncIterator[checkpoint_pb2.ShardChunk]: ...

    async def restore(self, shard: ShardId) -> tuple[ShardRecord, Tier]: ...

    async def list_shards(self, job_id: str) -> list[checkpoint_pb2.ShardInfo]: ...


def _shard(key: checkpoint_pb2.ShardKey, *, step_required: bool) -> ShardId:
    if not key.job_id:
        raise InvalidArgument("key.job_id is empty: name the job")
    if not valid_name(key.job_id):
        raise InvalidArgument(
            f"key.job_id {key.job_id[:80]!r} is invalid: use letters, digits and _.@=+- only "
            "(it names the job's directory in the durable store)"
        )
    if step_required and key.step == 0:
        raise InvalidArgument("key.step is 0: name the step the snapshot is after")
    return ShardId(key.job_id, key.rank, key.step)


def _peer_node(context: grpc.aio.ServicerContext) -> str | None:
    """The node whose certificate the caller presented (mutual TLS), else None."""
    names = context.auth_context().get("x509_common_name")
    return names[0].decode() if names else None


class CheckpointServicer:
    """The CheckpointService methods, each a thin call into the daemon."""

    def __init__(self, daemon: Backend) -> None:
        self.daemon = daemon

    def attach(self, server: grpc.aio.Server) -> None:
        """Serve this servicer on `server`."""
        checkpoint_pb2_grpc.add_CheckpointServiceServicer_to_server(self, server)

    def _local(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """With mutual TLS: only this node (its ranks, its agent) may call `method`."""
        peer = _peer_node(context)
        if peer is not None and peer != self.daemon.node_id:
            raise PermissionDenied(
                f"{method} is for node {self.daemon.node_id}'s own ranks; node {peer} may "
                "only push or pull shards of jobs it runs a rank of"
            )

    async def _member(self, context: grpc.aio.ServicerContext, job_id: str, what: str) -> None:
        """With mutual TLS: the calling node must run a rank of `job_id` (or be this one)."""
        peer = _peer_node(context)
        if peer is None or peer == self.daemon.node_id:
            return
        if not await self.daemon.is_member(job_id, peer):
            raise PermissionDenied(
                f"node {peer} runs no rank of job {job_id}: it may not {what} its shards"
            )

    async def AcquireSlot(  # noqa: N802 (gRPC method names)
        self, request: checkpoint_pb2.AcquireSlotRequest, context: grpc.aio.ServicerContext
    ) -> checkpoint_pb2.AcquireSlotResponse:
        self._local(context, "AcquireSlot")
        shard = _shard(request.key, step_required=True)
        if request.size_bytes == 0:
            raise InvalidArgument("size_bytes is 0: a shard has at least its 8-byte header length")
        slot = await self.daemon.acquire_slot(shard, request.size_bytes)
        return checkpoint_pb2.AcquireSlotResponse(shm_name=slot.name, size_bytes=slot.size)

    async def SealSlot(  # noqa: N802
        self, request: checkpoint_pb2.SealSlotRequest, context: grpc.aio.ServicerContext
    ) -> checkpoint_pb2.SealSlotResponse:
        self._local(context, "SealSlot")
        shard = _shard(request.key, step_required=True)
        self.daemon.seal_slot(shard, request.key.generation, request.shm_name, request.size_bytes)
        catalog, buddy = self.daemon.other_sources()
        sealed = checkpoint_pb2.SealSlotResponse(catalog_address=catalog, buddy_address=buddy)
        if request.next_size_bytes:
            segment = await self.daemon.lease_next(shard, request.next_size_bytes)
            if segment is not None:
                sealed.next_slot.shm_name, sealed.next_slot.size_bytes = segment.name, segment.size
        return sealed

    async def Restore(  # noqa: N802
        self, request: checkpoint_pb2.RestoreRequest, context: grpc.aio.ServicerContext
    ) -> checkpoint_pb2.RestoreResponse:
        self._local(context, "Restore")
        record, source = await self.daemon.restore(_shard(request.key, step_required=False))
        return checkpoint_pb2.RestoreResponse(
            header=record.header(), shm_name=record.segment.name, source=source.value
        )

    async def PushShard(  # noqa: N802
        self,
        request_iterator: AsyncIterator[checkpoint_pb2.ShardChunk],
        context: grpc.aio.ServicerContext,
    ) -> checkpoint_pb2.PushShardResponse:
        async def admitted(job_id: str) -> None:
            await self._member(context, job_id, "push")

        await self.daemon.receive_replica(request_iterator, admitted)
        return checkpoint_pb2.PushShardResponse(stored=True)

    async def PullShard(  # noqa: N802
        self, request: checkpoint_pb2.PullShardRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[checkpoint_pb2.ShardChunk]:
        shard = _shard(request.key, step_required=False)
        await self._member(context, shard.job_id, "pull")
        async for chunk in self.daemon.pull_chunks(shard):
            yield chunk

    async def ListShards(  # noqa: N802
        self, request: checkpoint_pb2.ListShardsRequest, context: grpc.aio.ServicerContext
    ) -> checkpoint_pb2.ListShardsResponse:
        shards = await self.daemon.list_shards(request.job_id)
        return checkpoint_pb2.ListShardsResponse(shards=shards)
