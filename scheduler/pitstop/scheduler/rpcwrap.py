"""Wrap a gRPC method handler of any of the four kinds with a step before the call and an
error hook around it. The interceptors are built on this, so each stays a few lines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

Before = Callable[[], Any]
OnError = Callable[[Exception, grpc.aio.ServicerContext], Awaitable[None]]


def wrap_handler(
    handler: grpc.RpcMethodHandler, before: Before | None = None, on_error: OnError | None = None
) -> grpc.RpcMethodHandler:
    """A handler that runs ``before()`` then the original behaviour; an exception other than
    an abort goes to ``on_error`` (which is expected to abort the call)."""

    async def guard(exc: Exception, context: grpc.aio.ServicerContext) -> None:
        if on_error is None or isinstance(exc, grpc.aio.AbortError):
            raise exc
        await on_error(exc, context)
        raise exc  # on_error must abort; if it did not, the error still surfaces

    def unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if before is not None:
                    before()
                return await behavior(request, context)
            except Exception as exc:
                await guard(exc, context)

        return call

    def streaming(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                if before is not None:
                    before()
                async for item in behavior(request, context):
                    yield item
            except Exception as exc:
                await guard(exc, context)

        return call

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kwargs)
