"""Authorization: every RPC declares its role in the .proto (pitstop.v1.required_role);
one interceptor checks the caller's bearer token against it.

With no tokens configured the scheduler runs open: every caller is an admin and an
agent. Mutual TLS for node daemons plugs in here later, as another way to a Caller.
"""

from __future__ import annotations

import contextvars
import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pool

from pitstop.scheduler.config import ApiToken
from pitstop.scheduler.domain import Role
from pitstop.scheduler.errors import PermissionDenied, Unauthenticated
from pitstop.scheduler.rpcwrap import wrap_handler
from pitstop.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who is calling, and with which roles."""

    name: str
    roles: frozenset[Role]

    @property
    def actor(self) -> str:
        return self.name


OPEN_CALLER = Caller("user:anonymous", frozenset(Role) - {Role.UNSPECIFIED})
current_caller: contextvars.ContextVar[Caller] = contextvars.ContextVar(
    "current_caller", default=OPEN_CALLER
)

_IMPLIED = {
    Role.ADMIN: {Role.ADMIN, Role.OPERATOR, Role.VIEWER},
    Role.OPERATOR: {Role.OPERATOR, Role.VIEWER},
    Role.VIEWER: {Role.VIEWER},
    Role.AGENT: {Role.AGENT},
}


def required_role(method: str) -> Role | None:
    """The role declared for ``/pitstop.v1.Service/Method``; None for other services
    (health checking, reflection), which are public."""
    service, _, name = method.lstrip("/").partition("/")
    if not service.startswith("pitstop."):
        return None
    try:
        svc = descriptor_pool.Default().FindServiceByName(service)
    except KeyError:
        return Role.UNSPECIFIED
    found = svc.methods_by_name.get(name)
    if found is None:
        return Role.UNSPECIFIED
    return Role(found.GetOptions().Extensions[common_pb2.required_role])  # type: ignore[index]


class TokenBook:
    """Bearer tokens and the callers they make."""

    def __init__(self, tokens: Sequence[ApiToken]) -> None:
        self._tokens = [
            (t.token.encode(), Caller(f"token:{t.name}", frozenset(_IMPLIED[t.role])))
            for t in tokens
        ]

    @property
    def open(self) -> bool:
        return not self._tokens

    def caller_for(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Caller:
        if self.open:
            return OPEN_CALLER
        header = next((v for k, v in metadata or () if k == "authorization"), None)
        if header is None:
            raise Unauthenticated(
                "no credential: send 'authorization: Bearer <token>' (pitstop --token or "
                "PITSTOP_TOKEN)"
            )
        value = header.decode() if isinstance(header, bytes) else header
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("authorization header must be 'Bearer <token>'")
        for known, caller in self._tokens:
            # Constant-time compare over every token: timing says nothing about which.
            if hmac.compare_digest(known, token.strip().encode()):
                return caller
        raise Unauthenticated("unknown token; ask an administrator for a valid one")


def authorize(caller: Caller, method: str, needed: Role) -> None:
    if needed is Role.PUBLIC:
        return
    if needed is Role.UNSPECIFIED:
        # Fail closed: a method nobody annotated is nobody's.
        raise PermissionDenied(f"{method} declares no role; it is refused until it does")
    if needed not in caller.roles:
        raise PermissionDenied(
            f"{method} needs role {needed.name.lower()}; {caller.name} has "
            + (", ".join(sorted(r.name.lower() for r in caller.roles)) or "none")
        )


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Checks the caller's role before the handler runs and makes the caller known to it."""

    def __init__(self, tokens: TokenBook) -> None:
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        needed = required_role(details.method)
        if handler is None or needed is None:
            return handler
        metadata = details.invocation_metadata
        method = details.method

        def before() -> Any:
            caller = self._tokens.caller_for(metadata)
            authorize(caller, method, needed)
            return current_caller.set(caller)

        return wrap_handler(handler, before)
