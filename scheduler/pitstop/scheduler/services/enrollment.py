"""Join tokens: issued by an admin, used up by one node's enrollment.

A token is 32 random bytes (URL-safe base64 behind a `pst_join_` prefix, so a leaked one
is recognisable in a log or a repository). Only its SHA-256 is stored: a database dump
enrolls nothing. Using it is one UPDATE that takes it only while unused, unexpired and
for this node, so two nodes racing with one token get one certificate between them.
"""

from __future__ import annotations

import datetime as dt
import secrets

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.db import models
from pitstop.scheduler.domain import token_digest
from pitstop.scheduler.errors import InvalidArgument, PermissionDenied, Unauthenticated
from pitstop.scheduler.services import events as event_service

PREFIX = "pst_join_"
DEFAULT_TTL = dt.timedelta(hours=1)
MAX_TTL = dt.timedelta(days=7)


async def create_token(
    session: AsyncSession, ttl: dt.timedelta, node_id: str, actor: str
) -> tuple[str, models.JoinToken]:
    """A new token (returned once, in clear) and its row."""
    if ttl <= dt.timedelta(0) or ttl > MAX_TTL:
        raise InvalidArgument(
            "ttl_seconds", int(ttl.total_seconds()), "give 1 s to 7 days (604800 s)"
        )
    token = PREFIX + secrets.token_urlsafe(32)
    row = models.JoinToken(
        digest=token_digest(token),
        node_id=node_id,
        expires_at=dt.datetime.now(dt.UTC) + ttl,
        created_by=actor,
    )
    session.add(row)
    event_service.record_event(
        session,
        "token.created",
        actor=actor,
        node_id=node_id or None,
        reason=(
            f"join token for {node_id or 'any node'}, "
            f"expires {row.expires_at:%Y-%m-%d %H:%M:%S} UTC"
        ),
    )
    return token, row


async def use_token(session: AsyncSession, token: str, node_id: str) -> None:
    """Take `token` for `node_id`, or raise Unauthenticated saying why it cannot be."""
    now = dt.datetime.now(dt.UTC)
    taken = await session.execute(
        update(models.JoinToken)
        .where(models.JoinToken.digest == token_digest(token))
        .where(models.JoinToken.used_at.is_(None))
        .where(models.JoinToken.expires_at > now)
        .where(models.JoinToken.node_id.in_(("", node_id)))
        .values(used_at=now, used_by=node_id)
        .returning(models.JoinToken.digest)
    )
    if taken.first() is not None:
        return
    row = await session.get(models.JoinToken, token_digest(token))
    if row is None:
        why = "is not one this scheduler issued"
    elif row.used_at is not None:
        why = f"was already used (by node {row.used_by!r} at {row.used_at:%H:%M:%S} UTC)"
    elif row.expires_at <= now:
        why = f"expired at {row.expires_at:%Y-%m-%d %H:%M:%S} UTC"
    else:
        why = f"is for node {row.node_id!r}, not {node_id!r}"
    raise Unauthenticated(
        f"join_token {why}; ask an administrator for a new one (pitstop token create)"
    )


async def check_not_revoked(
    session: AsyncSession, node_id: str, issued: dt.datetime | None
) -> None:
    """Raise PermissionDenied when `node_id`'s certificate issued at `issued` (None:
    unknown, so any revocation counts) is revoked."""
    node = await session.get(models.Node, node_id)
    if node is None or node.revoked_at is None:
        return
    if issued is None or issued <= node.revoked_at:
        raise PermissionDenied(
            f"node {node_id}'s certificate was revoked at {node.revoked_at:%H:%M:%S} UTC; "
            "enroll it again with a new join token"
        )
