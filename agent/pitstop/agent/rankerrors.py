"""The errors the agent's rank endpoint (RankControl) refuses a call with, and the one
table that turns them into gRPC status codes (`pitstop.common.rpc`): its handlers
raise, `RankErrorInterceptor` ends the call. Any other exception is left as it is."""

from __future__ import annotations

import logging

import grpc

from pitstop.common import rpc

log = logging.getLogger("pitstop.agent.local")


class RankCallError(Exception):
    """A RankControl call refused, with the message the rank gets."""


class InvalidArgument(RankCallError):
    pass


class NotFound(RankCallError):
    pass


class FailedPrecondition(RankCallError):
    pass


class PermissionDenied(RankCallError):
    pass


class Unavailable(RankCallError):
    pass


_CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
]


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status of a call refused with `exc`; None for an exception of no such kind."""
    if not isinstance(exc, RankCallError):
        return None
    return rpc.status_from(_CODES, exc, "")


class RankErrorInterceptor(rpc.ErrorInterceptor):
    """Ends a RankControl call whose handler raised a RankCallError with its status."""

    def __init__(self) -> None:
        super().__init__(status_for, log, tolerant_decoding=False)
