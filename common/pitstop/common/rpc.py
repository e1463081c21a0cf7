"""The request wrapper and error mapping pitstop's gRPC servers share.

A server maps the exceptions its handlers raise to status codes with one table
(`status_from`); `guard_handler` wraps a method handler of any of the four kinds so
that a step runs before the call (authorization) and whatever the call raises, other
than an abort, goes to an error hook that ends the call with that status. With a hook,
a request whose bytes do not parse reaches the server's own check as an `Undecodable`
(refused there with INVALID_ARGUMENT, never grpc's UNKNOWN). `ErrorInterceptor` puts
the two together for a server.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from pitstop.common.rpcguard import handler_like

Before = Callable[[grpc.aio.ServicerContext], Any]
OnError = Callable[[Exception, grpc.aio.ServicerContext], Awaitable[None]]
Check = Callable[[Any], Any]
"""Takes a request (or a stream's message) and returns it, or raises to refuse it."""
StatusTable = Sequence[tuple[type[Exception], grpc.StatusCode]]
"""Exception classes and the status code of each, the first that matches wins."""
StatusFor = Callable[[Exception], tuple[grpc.StatusCode, str] | None]
"""The status code and message of a call that raised an exception; None leaves the
exception as it is (grpc ends the call with UNKNOWN)."""


def status_from(
    table: StatusTable, exc: Exception, internal_message: str
) -> tuple[grpc.StatusCode, str]:
    """The status code and message of a call that raised `exc`: the code of the first
    class of `table` it is an instance of with its own message, else INTERNAL with
    `internal_message` (the traceback is for the log, not the caller)."""
    for kind, code in table:
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, internal_message


class Undecodable:
    """Stands in for a request whose bytes did not parse, so that the server's check
    refuses it with INVALID_ARGUMENT instead of grpc answering UNKNOWN."""

    def __init__(self, size: int, error: Exception) -> None:
        self.size = size
        self.error = error


def tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserializer`, answering an `Undecodable` where it raises."""
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError and friends: refused by the check
            return Undecodable(len(data), exc)

    return decode


def guard_handler(
    handler: grpc.RpcMethodHandler,
    *,
    before: Before | None = None,
    on_error: OnError | None = None,
    check: Check | None = None,
    check_streamed: Check | None = None,
    tolerant_decoding: bool = True,
) -> grpc.RpcMethodHandler:
    """A handler that runs ``before(context)`` then the original behaviour; an exception
    other than an abort goes to ``on_error``, which is expected to abort the call. With
    ``on_error``, requests are decoded tolerantly (unless ``tolerant_decoding`` is off)
    and each passes ``check`` (a single request) or ``check_streamed`` (each message of
    a request stream; ``check`` when not given) before the handler sees it."""
    streamed = check_streamed or check

    async def checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            yield streamed(request) if streamed is not None else request

    def checked(request: Any) -> Any:
        if on_error is None:
            return request
        if hasattr(request, "__aiter__"):
            return checked_stream(request)
        return check(request) if check is not None else request

    async def guard(exc: Exception, context: grpc.aio.ServicerContext) -> None:
        if on_error is None or isinstance(exc, grpc.aio.AbortError):
            raise exc  # no hook, or the handler ended the call itself
        await on_error(exc, context)
        raise exc  # on_error must abort; if it did not, the error still surfaces

    def unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if before is not None:
                    before(context)
                return await behavior(checked(request), context)
            except Exception as exc:
                await guard(exc, context)

        return call

    def streaming(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                if before is not None:
                    before(context)
                async for item in behavior(checked(request), context):
                    yield item
            except Exception as exc:
                await guard(exc, context)

        return call

    deserializer = handler.request_deserializer
    return handler_like(
        handler,
        unary(handler.unary_unary or handler.stream_unary),
        streaming(handler.unary_stream or handler.stream_stream),
        tolerant(deserializer) if on_error is not None and tolerant_decoding else deserializer,
    )


class ErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Ends every call whose handler raised with the status code `status_for` gives
    (an INTERNAL one logged with its traceback on `log`). `check(method)` makes the
    request check of a method, refusing an `Undecodable` among others (without
    `tolerant_decoding`, grpc itself refuses undecodable bytes); `prefix`, when given,
    limits the interceptor to the methods whose full name starts with it."""

    def __init__(
        self,
        status_for: StatusFor,
        log: logging.Logger,
        check: Callable[[str], Check] | None = None,
        check_streamed: Callable[[str], Check] | None = None,
        prefix: str = "",
        tolerant_decoding: bool = True,
    ) -> None:
        self._status_for = status_for
        self._log = log
        self._check = check
        self._check_streamed = check_streamed
        self._prefix = prefix
        self._tolerant_decoding = tolerant_decoding

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        method = details.method

        async def on_error(exc: Exception, context: grpc.aio.ServicerContext) -> None:
            status = self._status_for(exc)
            if status is None:
                return  # not one to map: it surfaces as it is
            code, message = status
            self.note(method, exc, code, message)
            await context.abort(code, message)

        return guard_handler(
            handler,
            on_error=on_error,
            check=self._check(method) if self._check is not None else None,
            check_streamed=self._check_streamed(method) if self._check_streamed else None,
            tolerant_decoding=self._tolerant_decoding,
        )

    def note(self, method: str, exc: Exception, code: grpc.StatusCode, message: str) -> None:
        """Log a call that failed: an INTERNAL one with its traceback."""
        if code is grpc.StatusCode.INTERNAL:
            self._log.error("%s failed", method, exc_info=exc)
