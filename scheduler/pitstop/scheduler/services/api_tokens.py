"""API tokens: bearer tokens for people and scripts, issued and revoked by an admin.

A token is 32 random bytes (URL-safe base64 behind a `pst_api_` prefix, so a leaked one
is recognisable in a log or a repository), shown once; only its SHA-256 is stored, so a
database dump authenticates nobody. Rows are never deleted: a revoked token keeps its
name and its history. Tokens in the scheduler's config file share the namespace of names
but are changed only there.

Two rules keep the admins from locking themselves out: on an open API (no token
configured, none ever issued) the first token must be an admin's, and the last admin
token cannot be revoked while no admin token is configured.
"""

from __future__ import annotations

import datetime as dt
import re
import secrets
from collections.abc import Sequence
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from pitstop.scheduler.config import ApiToken
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import ISSUABLE_ROLES, IssuedToken, Role, token_digest
from pitstop.scheduler.errors import FailedPrecondition, InvalidArgument, NotFound
from pitstop.scheduler.jobspec import check_project
from pitstop.scheduler.services import events as event_service

PREFIX = "pst_api_"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
_ROLE_WORDS = ", ".join(r.name.lower() for r in ISSUABLE_ROLES)


def role_word(role: Role) -> str:
    return role.name.lower()


def check_name(name: str) -> str:
    """`name` if it can name a token, else InvalidArgument saying what can."""
    if not NAME_RE.fullmatch(name):
        raise InvalidArgument(
            "name",
            name,
            "give 1-64 letters, digits, '.', '_', '@' or '-', starting with a letter or digit "
            "(e.g. alice or ci-deploy)",
        )
    return name


def issuable_role(value: int) -> Role:
    """The role a request asks for (a pitstop.v1.Role number), if a token may have it."""
    try:
        role = Role(value)
    except ValueError:
        raise InvalidArgument("role", value, f"use {_ROLE_WORDS}") from None
    if role is Role.AGENT:
        raise InvalidArgument(
            "role",
            "agent",
            f"the agent role comes only from a node certificate (enroll nodes with a join "
            f"token: pitstop token create without --role); use {_ROLE_WORDS}",
        )
    if role not in ISSUABLE_ROLES:
        raise InvalidArgument("role", role.name.lower(), f"use {_ROLE_WORDS}")
    return role


def check_first_token(role: Role, api_open: bool) -> None:
    """On an open API everybody is admin until the first token exists; after it, only
    token holders are. A first token below admin would leave nobody able to issue more."""
    if api_open and role is not Role.ADMIN:
        raise FailedPrecondition(
            f"the API is open (no token configured or issued yet), so the first token must "
            f"be an admin's: a {role_word(role)} token would close the API and lock the "
            "admins out; issue an admin token first (pitstop token create --role admin)"
        )


def check_admins_remain(name: str, other_admins: int, configured_admins: int) -> None:
    """Revoking admin token `name` must leave some admin able to call the API."""
    if other_admins == 0 and configured_admins == 0:
        raise FailedPrecondition(
            f"API token {name!r} is the last admin token: revoking it would lock the admins "
            "out; issue another admin token first (pitstop token create --role admin), "
            "then revoke this one"
        )


def active(row: models.ApiToken, now: dt.datetime) -> bool:
    return row.revoked_at is None and (row.expires_at is None or row.expires_at > now)


def _active_at(now: dt.datetime) -> Any:
    """`active` as SQL: not revoked, not expired at `now`."""
    token = models.ApiToken
    return token.revoked_at.is_(None) & or_(token.expires_at.is_(None), token.expires_at > now)


def issued_token(row: models.ApiToken) -> IssuedToken:
    """What authorization keeps of a row."""
    return IssuedToken(
        row.name, Role[row.role.upper()], row.digest, row.expires_at, tuple(row.projects or ())
    )


def _name_taken(name: str, holder: models.ApiToken | None) -> FailedPrecondition:
    if holder is None:
        return FailedPrecondition(f"API token name {name!r} is taken; choose another name")
    state = (
        f"revoked at {holder.revoked_at:%Y-%m-%d %H:%M:%S} UTC; names are not reused"
        if holder.revoked_at is not None
        else "and in use; revoke it first (pitstop token revoke) to replace it"
    )
    return FailedPrecondition(
        f"API token name {name!r} is taken by a {holder.role} token issued "
        f"{holder.created_at:%Y-%m-%d %H:%M:%S} UTC by {holder.created_by or 'unknown'}, "
        f"{state}; choose another name"
    )


async def any_issued(session: AsyncSession) -> bool:
    """Whether the database has ever held an API token (revoked and expired ones count:
    once tokens are in use the API never falls back to open)."""
    return bool(await session.scalar(select(select(models.ApiToken.name).exists())))


async def create_token(
    session: AsyncSession,
    name: str,
    role: Role,
    ttl: dt.timedelta | None,
    *,
    actor: str,
    configured: Sequence[ApiToken],
    now: dt.datetime,
    projects: Sequence[str] = (),
) -> tuple[str, models.ApiToken]:
    """A new token (returned once, in clear) and its row; `ttl` None: it never expires;
    `projects`: the projects it may act in (empty: every project)."""
    check_name(name)
    for i, project in enumerate(projects):
        check_project(f"projects[{i}]", project)
    if any(t.name == name for t in configured):
        raise FailedPrecondition(
            f"API token name {name!r} is taken by a token in the scheduler's config file "
            "(tokens); choose another name"
        )
    holder = await session.get(models.ApiToken, name)
    if holder is not None:
        raise _name_taken(name, holder)
    check_first_token(role, api_open=not configured and not await any_issued(session))
    token = PREFIX + secrets.token_urlsafe(32)
    row = models.ApiToken(
        name=name,
        role=role_word(role),
        digest=token_digest(token),
        created_at=now,
        created_by=actor,
        expires_at=now + ttl if ttl is not None else None,
        projects=sorted(set(projects)),
    )
    session.add(row)
    try:
        await session.flush()
    except IntegrityError:  # another call took the name between the check and here
        raise _name_taken(name, None) from None
    expiry = f"expires {row.expires_at:%Y-%m-%d %H:%M:%S} UTC" if row.expires_at else "no expiry"
    if row.projects:
        expiry += f", limited to project(s) {', '.join(row.projects)}"
    event_service.record_event(
        session,
        "token.created",
        actor=actor,
        reason=f"API token {name!r} for role {row.role}, {expiry}",
        attributes={"token": name, "role": row.role},
    )
    return token, row


async def list_tokens(session: AsyncSession) -> Sequence[models.ApiToken]:
    """Every issued token by name, revoked and expired ones included."""
    return (await session.scalars(select(models.ApiToken).order_by(models.ApiToken.name))).all()


async def revoke_token(
    session: AsyncSession,
    name: str,
    *,
    actor: str,
    configured: Sequence[ApiToken],
    now: dt.datetime,
) -> models.ApiToken:
    """Revoke issued token `name`; a no-op when it already is."""
    # One statement locks the token and every active admin token, in name order: two
    # revocations of the last two admin tokens cannot both see the other one remain, and
    # cannot deadlock either.
    locked = (
        await session.scalars(
            select(models.ApiToken)
            .where(
                or_(
                    models.ApiToken.name == name,
                    (models.ApiToken.role == role_word(Role.ADMIN)) & _active_at(now),
                )
            )
            .order_by(models.ApiToken.name)
            .with_for_update()
        )
    ).all()
    row = next((r for r in locked if r.name == name), None)
    if row is None:
        if any(t.name == name for t in configured):
            raise FailedPrecondition(
                f"API token {name!r} is configured in the scheduler's config file (tokens), "
                "not issued: remove it from the config file of every scheduler process and "
                "restart them"
            )
        raise NotFound("API token", name, "pitstop token list shows every token's name")
    if row.revoked_at is not None:
        return row
    if row.role == role_word(Role.ADMIN) and active(row, now):
        check_admins_remain(
            name,
            other_admins=sum(1 for r in locked if r.name != name),
            configured_admins=sum(1 for t in configured if t.role is Role.ADMIN),
        )
    row.revoked_at, row.revoked_by = now, actor
    event_service.record_event(
        session,
        "token.revoked",
        actor=actor,
        reason=f"API token {name!r} for role {row.role} revoked",
        attributes={"token": name, "role": row.role},
    )
    return row


async def load_issued(
    session: AsyncSession, now: dt.datetime
) -> tuple[tuple[IssuedToken, ...], bool]:
    """The tokens that authenticate now (not revoked, not expired), and whether any token
    was ever issued."""
    rows = (await session.scalars(select(models.ApiToken).where(_active_at(now)))).all()
    tokens = tuple(issued_token(r) for r in rows)
    return tokens, bool(tokens) or await any_issued(session)
