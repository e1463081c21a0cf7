"""checkpointd's domain errors. The daemon raises these; one interceptor
(interceptors.py) turns them into gRPC status codes, so no response ever carries an
error inside a success.

Each message a person sees names the thing, the value and what to do.
"""

from __future__ import annotations


class CheckpointdError(Exception):
    """Base of every error a CheckpointService call answers with a status code."""


class InvalidArgument(CheckpointdError):
    """A request field is wrong (INVALID_ARGUMENT)."""


class NotFound(CheckpointdError):
    """The shard asked for is nowhere to be had (NOT_FOUND)."""


class FailedPrecondition(CheckpointdError):
    """The request is well formed but the daemon's state forbids it, e.g. sealing a slot
    that was not given (FAILED_PRECONDITION)."""


class ResourceExhausted(CheckpointdError):
    """The memory budget has no room: the snapshot or replica is skipped, never an
    out-of-memory (RESOURCE_EXHAUSTED)."""


class PermissionDenied(CheckpointdError):
    """The calling node may not do this: another node's own call, or a shard of a job
    it runs no rank of (PERMISSION_DENIED)."""


class Unavailable(CheckpointdError):
    """The daemon cannot serve this now, e.g. it is stopping; retry later or elsewhere
    (UNAVAILABLE)."""
