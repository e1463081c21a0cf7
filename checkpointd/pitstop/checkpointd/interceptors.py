"""checkpointd's server interceptors: the one place its errors become gRPC status codes,
and the bearer-token check.

INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED and UNAVAILABLE
for the domain errors (errors.py), with their message; anything else is INTERNAL with
the traceback logged and a generic message. The scheduler has its own version of this;
checkpointd may not import the scheduler.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from pitstop.checkpointd import errors
from pitstop.common.rpcguard import handler_like, refusing

log = logging.getLogger(__name__)

_DOMAIN_CODES: list[tuple[type[errors.CheckpointdError], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
]
INTERNAL_MESSAGE = "internal error in checkpointd; see its log"

OnError = Callable[[Exception, grpc.aio.ServicerContext], Awaitable[None]]


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message a call that raised `exc` ends with."""
    for kind, code in _DOMAIN_CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


class ErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Ends every call whose handler raised with the status code `status_for` gives."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method

        async def on_error(exc: Exception, context: grpc.aio.ServicerContext) -> None:
            code, message = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.error("%s failed", method, exc_info=exc)
            await context.abort(code, message)

        return _wrapped(handler, on_error, method)


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses, UNAUTHENTICATED, every call without `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if handler is None or hmac.compare_digest(str(given).encode(), self._expected):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "checkpointd needs authorization: Bearer <token> (the agent token)"
    return refusing(handler, grpc.StatusCode.UNAUTHENTICATED, message)


class _Undecodable:
    """Stands in for a request whose bytes do not parse, so that the handler refuses it
    with INVALID_ARGUMENT instead of grpc answering UNKNOWN."""

    def __init__(self, data: bytes, error: Exception) -> None:
        self.size = len(data)
        self.error = error

    def refuse(self, method: str) -> errors.InvalidArgument:
        return errors.InvalidArgument(
            f"request to {method}: its {self.size} bytes are no valid message ({self.error});"
            " send the method's request message, serialized whole"
        )


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError and friends: refused by the handler
            return _Undecodable(data, exc)

    return decode


def _wrapped(
    handler: grpc.RpcMethodHandler, on_error: OnError, method: str = ""
) -> grpc.RpcMethodHandler:
    """`handler`, with `on_error` (which aborts the call) run on whatever it raises,
    an undecodable request among them."""

    def checked(request: Any) -> Any:
        if isinstance(request, _Undecodable):
            raise request.refuse(method)
        return request

    async def checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            yield checked(request)

    def check(request: Any) -> Any:
        return checked_stream(request) if hasattr(request, "__aiter__") else checked(request)

    async def guard(exc: Exception, context: grpc.aio.ServicerContext) -> None:
        if isinstance(exc, grpc.aio.AbortError):
            raise exc  # the handler ended the call itself
        await on_error(exc, context)
        raise exc  # on_error aborts; if it did not, the error still surfaces

    def unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(check(request), context)
            except Exception as exc:
                await guard(exc, context)

        return call

    def streaming(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in behavior(check(request), context):
                    yield item
            except Exception as exc:
                await guard(exc, context)

        return call

    return handler_like(
        handler,
        unary(handler.unary_unary or handler.stream_unary),
        streaming(handler.unary_stream or handler.stream_stream),
        _tolerant(handler.request_deserializer),
    )
