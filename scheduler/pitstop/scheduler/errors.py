"""Domain errors. Services raise these; one interceptor maps them to gRPC status codes.

Each message a person sees names the thing, the value and what to do.
"""

from __future__ import annotations


class PitstopError(Exception):
    """Base of every error the API turns into a status code."""


class InvalidArgument(PitstopError):
    """A request field is wrong. ``field`` is its path, e.g. ``spec.checkpoint.keep_in_memory``."""

    def __init__(self, field: str, value: object, fix: str) -> None:
        self.field = field
        self.value = value
        self.fix = fix
        shown = repr(value) if isinstance(value, str) else str(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"{field}: {shown} is invalid: {fix}")


class NotFound(PitstopError):
    """The named thing does not exist."""

    def __init__(self, kind: str, ident: str, hint: str = "") -> None:
        self.kind = kind
        self.ident = ident
        message = f"{kind} {ident!r} not found"
        super().__init__(f"{message}; {hint}" if hint else message)


class FailedPrecondition(PitstopError):
    """The request is well formed but the current state forbids it (an illegal transition)."""


class Unavailable(PitstopError):
    """A store the scheduler depends on (PostgreSQL, Redis) cannot be reached; retry later."""


class PermissionDenied(PitstopError):
    """The caller's role is below what the RPC needs."""


class Unauthenticated(PitstopError):
    """No valid credential was presented."""
