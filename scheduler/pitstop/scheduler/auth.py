"""Authorization: every RPC declares its role in the .proto (pitstop.v1.required_role);
one interceptor checks the caller's bearer token against it.

Bearer tokens come from the config file and from PostgreSQL (issued by an admin through
TokenService); the interceptor checks them in memory, against hashes only. With no token
configured and none ever issued the scheduler runs open: every caller is an admin (and,
with TLS off, an agent). With TLS on, the agent role comes only from a node certificate
of the cluster CA (mutual TLS): the caller is `node:<id>`, the certificate's common
name, and the API checks that a node acts only as itself.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from cryptography import x509
from google.protobuf import descriptor_pool

from pitstop.common.tls import SCHEDULER_NAME, issued_at
from pitstop.scheduler.config import ApiToken
from pitstop.scheduler.domain import IssuedToken, Role, token_digest
from pitstop.scheduler.errors import PermissionDenied, Unauthenticated
from pitstop.scheduler.rpcwrap import wrap_handler
from pitstop.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who is calling, and with which roles."""

    name: str
    roles: frozenset[Role]
    node_id: str = ""
    """The node whose certificate made the call (mutual TLS); "" for a person."""
    certificate: bytes = b""
    """That certificate (PEM), read only where its issue time matters."""
    projects: frozenset[str] = frozenset()
    """The projects an API token is limited to; empty: every project."""

    def may_act_in(self, project: str) -> bool:
        return not self.projects or project in self.projects

    @property
    def issued_at(self) -> dt.datetime | None:
        """When the node's certificate was issued (a revocation refuses older ones)."""
        if not self.certificate:
            return None
        return issued_at(x509.load_pem_x509_certificate(self.certificate))

    @property
    def actor(self) -> str:
        return self.name


OPEN_CALLER = Caller("user:anonymous", frozenset(Role) - {Role.UNSPECIFIED})
PUBLIC_CALLER = Caller("public", frozenset())
"""Who calls a public RPC (enrollment): nobody yet."""
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


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class _KnownToken:
    name: str
    digest: bytes
    """Hex SHA-256 of the token, as bytes (for hmac.compare_digest)."""
    caller: Caller
    expires_at: dt.datetime | None = None


class TokenBook:
    """Bearer tokens and the callers they make: the configured ones, and the issued ones
    the database holds (kept current by an IssuedTokenRefresher). `nodes_by_certificate`
    (TLS on): the agent role is a node certificate's, never a token's."""

    def __init__(
        self,
        tokens: Sequence[ApiToken],
        nodes_by_certificate: bool = False,
        clock: Callable[[], dt.datetime] = utc_now,
    ) -> None:
        self._withheld = {Role.AGENT} if nodes_by_certificate else set()
        # Only the tokens' SHA-256 is kept (and configured, where the file gives sha256).
        self._configured = tuple(
            _KnownToken(t.name, t.digest, self._caller(t.name, t.role, t.projects)) for t in tokens
        )
        self._issued: tuple[_KnownToken, ...] = ()
        self._any_issued = False
        self._clock = clock
        self._open = Caller(OPEN_CALLER.name, OPEN_CALLER.roles - self._withheld)

    def _caller(self, name: str, role: Role, projects: Sequence[str] = ()) -> Caller:
        return Caller(
            f"token:{name}",
            frozenset(_IMPLIED[role] - self._withheld),
            projects=frozenset(projects),
        )

    @property
    def open(self) -> bool:
        """No token configured and none ever issued. Once one was issued the API stays
        closed, even when every issued token is revoked or expired: an expiry must not
        hand the cluster to anyone who can reach it."""
        return not self._configured and not self._any_issued

    def _known(self, token: IssuedToken) -> _KnownToken:
        caller = self._caller(token.name, token.role, token.projects)
        return _KnownToken(token.name, token.digest.encode(), caller, token.expires_at)

    def replace_issued(self, tokens: Sequence[IssuedToken], any_issued: bool) -> None:
        """Honour exactly these issued tokens from now on (the database's active ones)."""
        self._issued = tuple(self._known(t) for t in tokens)
        self._any_issued = self._any_issued or any_issued or bool(tokens)

    def admit(self, token: IssuedToken) -> None:
        """Honour a token this process just issued, before the next reload."""
        self._issued = (*(t for t in self._issued if t.name != token.name), self._known(token))
        self._any_issued = True

    def withdraw(self, name: str) -> None:
        """Stop honouring issued token `name` now: this process just revoked it."""
        self._issued = tuple(t for t in self._issued if t.name != name)

    @property
    def issued_names(self) -> list[str]:
        """The issued tokens honoured now, by name."""
        return [t.name for t in self._issued]

    def caller_for(
        self, metadata: Sequence[tuple[str, str | bytes]] | None, node: Caller | None = None
    ) -> Caller:
        """The caller: `node` when a node certificate made the call, else by token."""
        if node is not None:
            return node
        if self.open:
            return self._open
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
        presented = token_digest(token).encode()
        for known in (*self._configured, *self._issued):
            # Constant-time compare over every token: timing says nothing about which.
            if hmac.compare_digest(known.digest, presented):
                # Checked here, not only at the next reload: expiry is to the second.
                if known.expires_at is not None and self._clock() >= known.expires_at:
                    raise Unauthenticated(
                        f"token {known.name!r} expired at "
                        f"{known.expires_at:%Y-%m-%d %H:%M:%S} UTC; ask an administrator "
                        "for a new one"
                    )
                return known.caller
        raise Unauthenticated("unknown token; ask an administrator for a valid one")


def node_caller(context: grpc.aio.ServicerContext) -> Caller | None:
    """The node whose certificate the peer presented (mutual TLS), if any. The TLS
    handshake already checked it against the cluster CA."""
    found = context.auth_context()
    names = found.get("x509_common_name")
    if not names or found.get("transport_security_type") != [b"ssl"]:
        return None
    node_id = names[0].decode()
    if node_id == SCHEDULER_NAME:  # the scheduler's own name is no node's
        return None
    pem = found.get("x509_pem_cert") or [b""]
    return Caller(f"node:{node_id}", frozenset({Role.AGENT}), node_id, pem[0])


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

        def before(context: grpc.aio.ServicerContext) -> Any:
            if needed is Role.PUBLIC:  # its request is its credential (a join token)
                return current_caller.set(PUBLIC_CALLER)
            caller = self._tokens.caller_for(metadata, node_caller(context))
            authorize(caller, method, needed)
            return current_caller.set(caller)

        return wrap_handler(handler, before)


def require_project(project: str, action: str) -> None:
    """PermissionDenied unless the current caller may act in `project` (`action` says
    what it asked, e.g. "cancel job j-1"). A token limited to projects reaches only
    their jobs; every other caller reaches all."""
    caller = current_caller.get()
    if not caller.may_act_in(project):
        raise PermissionDenied(
            f"{caller.actor} may not {action}: it is limited to project(s) "
            f"{', '.join(sorted(caller.projects))} and the job belongs to project "
            f"{project!r}; use a token of that project (pitstop token create --project "
            f"{project})"
        )
