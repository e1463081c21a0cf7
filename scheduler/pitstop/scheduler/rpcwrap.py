"""Wrap a gRPC method handler of any of the four kinds with a step before the call and an
error hook around it (pitstop.common.rpc.guard_handler), with the scheduler's request
check: undecodable bytes and NUL characters are refused as InvalidArgument. The
interceptors are built on this, so each stays a few lines."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from pitstop.common.rpc import Before, OnError, Undecodable, guard_handler
from pitstop.scheduler.errors import InvalidArgument


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


def _refuse_undecodable(request: Any) -> Any:
    if isinstance(request, Undecodable):
        raise InvalidArgument(
            "request",
            f"<{request.size} bytes>",
            f"send a valid protobuf message ({request.error})",
        )
    return request


def _checked(request: Any) -> Any:
    request = _refuse_undecodable(request)
    if isinstance(request, Message):
        found = nul_field(request)
        if found is not None:
            raise InvalidArgument(found[0], found[1], "remove the NUL character")
    return request


def wrap_handler(
    handler: grpc.RpcMethodHandler, before: Before | None = None, on_error: OnError | None = None
) -> grpc.RpcMethodHandler:
    """A handler that runs ``before(context)`` then the original behaviour; an exception other than
    an abort goes to ``on_error`` (which is expected to abort the call). With ``on_error``,
    undecodable requests become InvalidArgument too, and so does a single request holding a
    NUL character (a stream's messages, which come often, are checked by their handlers:
    only whether each decoded)."""
    return guard_handler(
        handler,
        before=before,
        on_error=on_error,
        check=_checked,
        check_streamed=_refuse_undecodable,
    )
