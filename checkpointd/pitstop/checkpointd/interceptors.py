"""checkpointd's server interceptors: the one place its errors become gRPC status codes,
and the bearer-token check.

INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED and UNAVAILABLE
for the domain errors (errors.py), with their message; anything else is INTERNAL with
the traceback logged and a generic message. The wrapper and the mapping are
pitstop.common.rpc's, which the scheduler uses too; the table and the words are here.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pitstop.checkpointd import errors
from pitstop.common import rpc
from pitstop.common.rpc import Check, Undecodable, status_from
from pitstop.common.rpcguard import refusing

log = logging.getLogger(__name__)

_DOMAIN_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
]
INTERNAL_MESSAGE = "internal error in checkpointd; see its log"


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message a call that raised `exc` ends with."""
    return status_from(_DOMAIN_CODES, exc, INTERNAL_MESSAGE)


def _refusing_undecodable(method: str) -> Check:
    """The request check of `method`: an undecodable request is InvalidArgument."""

    def check(request: Any) -> Any:
        if isinstance(request, Undecodable):
            raise errors.InvalidArgument(
                f"request to {method}: its {request.size} bytes are no valid message "
                f"({request.error}); send the method's request message, serialized whole"
            )
        return request

    return check


class ErrorInterceptor(rpc.ErrorInterceptor):
    """Ends every call whose handler raised with the status code `status_for` gives."""

    def __init__(self) -> None:
        super().__init__(status_for, log, check=_refusing_undecodable)


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
