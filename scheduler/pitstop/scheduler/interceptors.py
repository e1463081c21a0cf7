"""The one place domain errors become gRPC status codes.

INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, PERMISSION_DENIED, UNAUTHENTICATED for
the domain errors; UNAVAILABLE whenever PostgreSQL or Redis cannot be reached (never
INTERNAL for those, so clients retry); anything else is INTERNAL with the traceback
logged and a generic message.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
import psycopg
import sqlalchemy.exc
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pitstop.scheduler import errors
from pitstop.scheduler.rpcwrap import wrap_handler

log = logging.getLogger(__name__)

_DOMAIN_CODES: list[tuple[type[errors.PitstopError], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
]


def _server_error(exc: BaseException) -> str | None:
    """The SQLSTATE of an error PostgreSQL itself reported (so it is reachable)."""
    orig = exc.orig if isinstance(exc, sqlalchemy.exc.DBAPIError) else exc
    state = getattr(orig, "sqlstate", None)
    # Class 08 is a broken connection, 57P a server shutting down or starting: outages.
    if state and not state.startswith(("08", "57P")):
        return str(state)
    return None


def _store_outage(exc: BaseException) -> str | None:
    """Which store is unreachable, if that is what ``exc`` means."""
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        return "Redis"
    if _server_error(exc) is not None:
        return None
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and (
        exc.connection_invalidated
        or isinstance(exc.orig, psycopg.OperationalError | psycopg.InterfaceError)
    ):
        return "PostgreSQL"
    if isinstance(exc, sqlalchemy.exc.TimeoutError | psycopg.OperationalError | ConnectionError):
        return "PostgreSQL"
    if isinstance(exc, OSError) and exc.errno is not None:
        return "a store"
    return None


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    for kind, code in _DOMAIN_CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    if (_server_error(exc) or "").startswith("40"):
        # Deadlock or serialization failure: the transaction rolled back, nothing changed.
        return grpc.StatusCode.ABORTED, "a concurrent change conflicted with this one; retry"
    store = _store_outage(exc)
    if store is not None:
        return (
            grpc.StatusCode.UNAVAILABLE,
            f"{store} is unreachable from the scheduler; retry shortly",
        )
    return grpc.StatusCode.INTERNAL, "internal error in the scheduler; see its log"


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Maps every exception a pitstop handler raises to a status code and a message."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/pitstop."):
            return handler
        method = details.method

        async def on_error(exc: Exception, context: grpc.aio.ServicerContext) -> None:
            code, message = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.error("%s failed", method, exc_info=exc)
            elif code is grpc.StatusCode.UNAVAILABLE:
                log.warning("%s: %s (%s)", method, message, type(exc).__name__)
            await context.abort(code, message)

        return wrap_handler(handler, on_error=on_error)
