"""Rich tables of API tokens."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from rich.table import Table

from pitstop.client.enums import API_TOKEN_SOURCES, ROLES, enum_word
from pitstop.client.render import add_row, format_time, table, timestamp_is_set
from pitstop.v1 import nodes_pb2


def token_role(token: nodes_pb2.ApiToken) -> str:
    """The token's role as a word: ``viewer``, ``operator``, ``admin`` (``agent``)."""
    return enum_word(ROLES, token.role)


def token_source(token: nodes_pb2.ApiToken) -> str:
    """``config`` (the scheduler's config file) or ``api`` (issued, in the database)."""
    return enum_word(API_TOKEN_SOURCES, token.source)


def token_expiry(token: nodes_pb2.ApiToken, now: datetime) -> str:
    """When it stops working: ``never``, or the time, marked once past."""
    if not timestamp_is_set(token.expires_at):
        return "never"
    past = token.expires_at.ToDatetime(tzinfo=UTC) <= now
    return format_time(token.expires_at) + (" (expired)" if past else "")


def token_revocation(token: nodes_pb2.ApiToken) -> str:
    """``-``, or when and by whom it was revoked."""
    if not timestamp_is_set(token.revoked_at):
        return "-"
    return f"{format_time(token.revoked_at)} by {token.revoked_by or '?'}"


def api_tokens_table(tokens: Sequence[nodes_pb2.ApiToken], now: datetime) -> Table:
    """One row per token: name, role, source, created, by whom, expiry, revocation, the
    projects it is limited to."""
    result = table(
        "NAME", "ROLE", "SOURCE", "CREATED", "CREATED BY", "EXPIRES", "REVOKED", "PROJECTS"
    )
    for token in tokens:
        add_row(
            result,
            (
                token.name,
                token_role(token),
                token_source(token),
                format_time(token.created_at),
                token.created_by or "-",
                token_expiry(token, now),
                token_revocation(token),
                ", ".join(token.projects) or "all",
            ),
        )
    return result
