"""Server-side pieces every pitstop gRPC server shares: a handler of another handler's
kind (so an interceptor can answer a call in its place), and one that refuses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc


def handler_like(
    handler: grpc.RpcMethodHandler,
    unary: Callable[..., Awaitable[Any]],
    streaming: Callable[..., AsyncIterator[Any]],
    deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind and (de)serializers (`deserializer` instead of its
    request deserializer, when given), calling `unary` when it answers with one
    message, `streaming` when it answers with a stream."""
    kwargs = {
        "request_deserializer": deserializer or handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)


def refusing(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that answers every call with `code` and `message`."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield None  # pragma: no cover - abort raises

    return handler_like(handler, unary, streaming)
