"""Wrap a gRPC method handler of any of the four kinds with a step before the call and an
error hook around it. The interceptors are built on this, so each stays a few lines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from pitstop.scheduler.errors import InvalidArgument

Before = Callable[[grpc.aio.ServicerContext], Any]
OnError = Callable[[Exception, grpc.aio.ServicerContext], Awaitable[None]]


class _Undecodable:
    """Stands in for a request whose bytes did not parse, so the handler can refuse it
    with INVALID_ARGUMENT instead of grpc answering UNKNOWN."""

    def __init__(self, size: int, error: str) -> None:
        self.size = size
        self.error = error

    def refuse(self) -> InvalidArgument:
        return InvalidArgument(
            "request", f"<{self.size} bytes>", f"send a valid protobuf message ({self.error})"
        )


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError and friends: refused in the handler
            return _Undecodable(len(data), str(exc))

    return decode


def nul_field(message: Message, prefix: str = "") -> tuple[str, str] | None:
    """The first string field of `message` (nested messages, lists and maps included)
    that holds a NUL character, as (dotted path, value); None when none does.

    PostgreSQL text cannot hold NUL: such a value is never one the scheduler can store or
    look up, so a request carrying one is refused before any handler sees it."""
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        if field.type == FieldDescriptor.TYPE_STRING:
            values = value if field.is_repeated else [value]
            for i, text in enumerate(values):
                if "\x00" in text:
                    return (f"{path}[{i}]" if field.is_repeated else path), text
        elif field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                found = _nul_in_map(path, field.message_type, value)
            elif field.is_repeated:
                found = None
                for i, item in enumerate(value):
                    found = nul_field(item, f"{path}[{i}].")
                    if found is not None:
                        break
            else:
                found = nul_field(value, f"{path}.")
            if found is not None:
                return found
    return None


def _nul_in_map(path: str, entry: Descriptor, mapping: Any) -> tuple[str, str] | None:
    keyed_by_text = entry.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING
    value_field = entry.fields_by_name["value"]
    for key, value in mapping.items():
        if keyed_by_text and "\x00" in key:
            return f"{path} key", key
        if value_field.type == FieldDescriptor.TYPE_STRING and "\x00" in value:
            return f"{path}[{key!r}]", value
        if value_field.message_type is not None:
            found = nul_field(value, f"{path}[{key!r}].")
            if found is not None:
                return found
    return None


def _checked(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise request.refuse()
    if isinstance(request, Message):
        found = nul_field(request)
        if found is not None:
            raise InvalidArgument(found[0], found[1], "remove the NUL character")
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    # A stream's messages (an agent's heartbeats, step times) come often and are
    # checked by their handlers: only whether each decoded.
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise request.refuse()
        yield request


def wrap_handler(
    handler: grpc.RpcMethodHandler, before: Before | None = None, on_error: OnError | None = None
) -> grpc.RpcMethodHandler:
    """A handler that runs ``before(context)`` then the original behaviour; an exception other than
    an abort goes to ``on_error`` (which is expected to abort the call). With ``on_error``,
    undecodable requests become InvalidArgument too."""

    async def guard(exc: Exception, context: grpc.aio.ServicerContext) -> None:
        if on_error is None or isinstance(exc, grpc.aio.AbortError):
            raise exc
        await on_error(exc, context)
        raise exc  # on_error must abort; if it did not, the error still surfaces

    def unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if before is not None:
                    before(context)
                return await behavior(_check(request), context)
            except Exception as exc:
                await guard(exc, context)

        return call

    def streaming(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                if before is not None:
                    before(context)
                async for item in behavior(_check(request), context):
                    yield item
            except Exception as exc:
                await guard(exc, context)

        return call

    def _check(request: Any) -> Any:
        if on_error is None:
            return request
        if hasattr(request, "__aiter__"):
            return _checked_stream(request)
        return _checked(request)

    deserializer = handler.request_deserializer
    kwargs = {
        "request_deserializer": _tolerant(deserializer) if on_error else deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kwargs)
