"""TokenService: API tokens issued, listed and revoked by an admin."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence

import grpc

from pitstop.scheduler.auth import current_caller, utc_now
from pitstop.scheduler.config import ApiToken
from pitstop.scheduler.convert import configured_token_to_pb, issued_token_to_pb
from pitstop.scheduler.issued_tokens import IssuedTokenRefresher
from pitstop.scheduler.services import api_tokens
from pitstop.scheduler.store import Store
from pitstop.v1 import nodes_pb2


class TokenServicer:
    """`configured`: the config file's tokens, listed beside the issued ones and never
    issued or revoked here; `refresher` makes a change count in this process at once."""

    def __init__(
        self,
        store: Store,
        configured: Sequence[ApiToken],
        refresher: IssuedTokenRefresher,
        clock: Callable[[], dt.datetime] = utc_now,
    ) -> None:
        self.store = store
        self.configured = list(configured)
        self.refresher = refresher
        self.clock = clock

    async def Create(  # noqa: N802 (gRPC method names)
        self, request: nodes_pb2.CreateApiTokenRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.CreateApiTokenResponse:
        role = api_tokens.issuable_role(request.role)
        ttl = dt.timedelta(seconds=request.ttl_seconds) if request.ttl_seconds else None
        async with self.store.write() as session:
            token, row = await api_tokens.create_token(
                session,
                request.name,
                role,
                ttl,
                actor=current_caller.get().actor,
                configured=self.configured,
                now=self.clock(),
                projects=list(request.projects),
            )
        await self.refresher.issued(api_tokens.issued_token(row))
        return nodes_pb2.CreateApiTokenResponse(token=token, record=issued_token_to_pb(row))

    async def List(  # noqa: N802
        self, request: nodes_pb2.ListApiTokensRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.ListApiTokensResponse:
        async with self.store.read() as session:
            rows = await api_tokens.list_tokens(session)
        return nodes_pb2.ListApiTokensResponse(
            tokens=[configured_token_to_pb(t) for t in self.configured]
            + [issued_token_to_pb(r) for r in rows]
        )

    async def Revoke(  # noqa: N802
        self, request: nodes_pb2.RevokeApiTokenRequest, context: grpc.aio.ServicerContext
    ) -> nodes_pb2.ApiToken:
        async with self.store.write() as session:
            row = await api_tokens.revoke_token(
                session,
                request.name,
                actor=current_caller.get().actor,
                configured=self.configured,
                now=self.clock(),
            )
        await self.refresher.revoked(row.name)
        return issued_token_to_pb(row)
