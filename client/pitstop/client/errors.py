"""The one error type the client raises for anything the server (or the network) refused."""

from __future__ import annotations

from typing import Any

import grpc

# Phrases grpc-core puts in UNAVAILABLE details when no connection could be made at all.
# A server-side UNAVAILABLE (e.g. "PostgreSQL is unreachable") never contains them, so
# they tell "the scheduler is down or mis-addressed" from "the scheduler says retry later".
_TRANSPORT_PHRASES = (
    "failed to connect to all addresses",
    "errors resolving",
    "dns resolution failed",
    "connection refused",
    "connections to all backends failing",
    "socket closed",
    "connection reset",
    "name resolution",
)


class PitstopError(Exception):
    """A call to the scheduler failed.

    ``code`` is the ``grpc.StatusCode`` and ``details`` the server's message, which names
    the thing, the value and the fix. ``str()`` reads ``"<details> (<CODE_NAME>)"``.
    """

    def __init__(self, code: Any, details: str) -> None:
        self.code = code
        self.details = details
        super().__init__(f"{details} ({code_name(code)})")

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> PitstopError:
        """Wrap a ``grpc.RpcError`` raised by a call or a stream."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else None
        return cls(code, str(details or "no details from the server"))

    @property
    def unreachable(self) -> bool:
        """True when no connection to the scheduler could be made (as opposed to the
        scheduler itself answering UNAVAILABLE)."""
        if self.code != grpc.StatusCode.UNAVAILABLE:
            return False
        lowered = self.details.lower()
        return any(phrase in lowered for phrase in _TRANSPORT_PHRASES)


def code_name(code: Any) -> str:
    """``grpc.StatusCode.NOT_FOUND`` -> ``"NOT_FOUND"``; anything else as text."""
    name = getattr(code, "name", None)
    return name if isinstance(name, str) else str(code)
