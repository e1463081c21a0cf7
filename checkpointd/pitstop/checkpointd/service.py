"""CheckpointService over grpc.aio: decode, call the daemon, encode. Domain errors become
status codes in one place (`_abort`); the bearer token, when one is configured, is
checked by one interceptor."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from pitstop.checkpointd.replication import ShardStreamError
from pitstop.checkpointd.restore import ShardNotFound
from pitstop.checkpointd.slots import MemoryBudgetFull, SlotMismatch
from pitstop.checkpointd.store import ShardId
from pitstop.v1 import checkpoint_pb2, checkpoint_pb2_grpc

if TYPE_CHECKING:
    from pitstop.checkpointd.daemon import CheckpointDaemon

log = logging.getLogger(__name__)


async def _abort(exc: Exception, context: grpc.aio.ServicerContext) -> NoReturn:
    if isinstance(exc, ShardNotFound):
        await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    if isinstance(exc, ShardStreamError | ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, SlotMismatch):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    if isinstance(exc, MemoryBudgetFull):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    log.exception("internal error in a CheckpointService call", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the checkpointd log")
    raise exc  # abort raises; this is never reached


def _shard(key: checkpoint_pb2.ShardKey, *, step_required: bool) -> ShardId:
    if not key.job_id:
        raise ValueError("key.job_id is empty: name the job")
    if step_required and key.step == 0:
        raise ValueError("key.step is 0: name the step the snapshot is after")
    return ShardId(key.job_id, key.rank, key.step)


class CheckpointServicer:
    """The CheckpointService methods, each a thin call into the daemon."""

    def __init__(self, daemon: CheckpointDaemon) -> None:
        self.daemon = daemon

    def attach(self, server: grpc.aio.Server) -> None:
        """Serve this servicer on `server`."""
        checkpoint_pb2_grpc.add_CheckpointServiceServicer_to_server(self, server)

    async def AcquireSlot(  # noqa: N802 (gRPC method names)
        self, request: checkpoint_pb2.AcquireSlotRequest, context: grpc.aio.ServicerContext
    ) -> checkpoint_pb2.AcquireSlotResponse:
        try:
            shard = _shard(request.key, step_required=True)
            if request.size_bytes == 0:
                raise ValueError("size_bytes is 0: a shard has at least its 8-byte header length")
            slot = await self.daemon.acquire_slot(shard, request.size_bytes)
        except Exception as exc:
            await _abort(exc, context)
        if isinstance(slot, str):
            return checkpoint_pb2.AcquireSlotResponse(refused=slot)
        return checkpoint_pb2.AcquireSlotResponse(shm_name=slot.name, size_bytes=slot.size)

    async def SealSlot(  # noqa: N802
        self, request: checkpoint_pb2.SealSlotRequest, context: grpc.aio.ServicerContext
    ) -> checkpoint_pb2.SealSlotResponse:
        try:
            shard = _shard(request.key, step_required=True)
            self.daemon.seal_slot(
                shard, request.key.generation, request.shm_name, request.size_bytes
            )
        except Exception as exc:
            await _abort(exc, context)
        return checkpoint_pb2.SealSlotResponse()

    async def Restore(  # noqa: N802
        self, request: checkpoint_pb2.RestoreRequest, context: grpc.aio.ServicerContext
    ) -> checkpoint_pb2.RestoreResponse:
        try:
            record, source = await self.daemon.restore(_shard(request.key, step_required=False))
        except Exception as exc:
            await _abort(exc, context)
        return checkpoint_pb2.RestoreResponse(
            header=record.header(), shm_name=record.segment.name, source=source.value
        )

    async def PushShard(  # noqa: N802
        self,
        request_iterator: AsyncIterator[checkpoint_pb2.ShardChunk],
        context: grpc.aio.ServicerContext,
    ) -> checkpoint_pb2.PushShardResponse:
        try:
            return await self.daemon.receive_replica(request_iterator)
        except Exception as exc:
            await _abort(exc, context)

    async def PullShard(  # noqa: N802
        self, request: checkpoint_pb2.PullShardRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[checkpoint_pb2.ShardChunk]:
        try:
            async for chunk in self.daemon.pull_chunks(_shard(request.key, step_required=False)):
                yield chunk
        except Exception as exc:
            await _abort(exc, context)

    async def ListShards(  # noqa: N802
        self, request: checkpoint_pb2.ListShardsRequest, context: grpc.aio.ServicerContext
    ) -> checkpoint_pb2.ListShardsResponse:
        try:
            shards = await self.daemon.list_shards(request.job_id)
        except Exception as exc:
            await _abort(exc, context)
        return checkpoint_pb2.ListShardsResponse(shards=shards)


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses, UNAUTHENTICATED, every call without `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if handler is None or hmac.compare_digest(str(given).encode(), self._expected):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "checkpointd needs authorization: Bearer <token> (the agent token)"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield None  # pragma: no cover - abort raises

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)
