"""``pitstop token ...``: one-time join tokens that enroll nodes, and API tokens (bearer
tokens with a role) for people and scripts."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Literal

import typer

from pitstop.client.cli_context import JsonFlag, console, open_client, print_json
from pitstop.client.enums import ROLES, parse_enum_word
from pitstop.client.render import format_time, to_json
from pitstop.client.render_tokens import api_tokens_table, token_expiry, token_role

tokens_app = typer.Typer(
    help="Join tokens that enroll nodes (mutual TLS) and API tokens for people and scripts.",
    no_args_is_help=True,
)

_DURATION = re.compile(r"^(\d+)([smhd]?)$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
JOIN_TOKEN_TTL = "1h"


def parse_duration(text: str) -> int:
    """Seconds in "90", "90s", "30m", "1h" or "7d"."""
    found = _DURATION.match(text.strip().lower())
    if found is None or int(found.group(1)) == 0:
        raise typer.BadParameter(
            f"{text!r} is not a duration: give e.g. 30m, 1h or 7d", param_hint="--ttl"
        )
    return int(found.group(1)) * _UNIT_SECONDS[found.group(2)]


@tokens_app.command("create")
def create(
    ctx: typer.Context,
    role: Annotated[
        Literal["viewer", "operator", "admin"] | None,
        typer.Option(
            "--role",
            help="Issue an API token with this role (needs --name) instead of a join token.",
            show_default=False,
        ),
    ] = None,
    name: Annotated[
        str,
        typer.Option("--name", help="The API token's unique name, e.g. alice (with --role)."),
    ] = "",
    ttl: Annotated[
        str | None,
        typer.Option(
            "--ttl",
            help="How long it works: 30m, 1h, 30d (default: 1h for a join token, no expiry "
            "for an API token).",
            show_default=False,
        ),
    ] = None,
    node_id: Annotated[
        str,
        typer.Option(
            "--node-id", help="The only node a join token may enroll (default: any one node)."
        ),
    ] = "",
    project: Annotated[
        list[str] | None,
        typer.Option(
            "--project",
            help="Limit the API token to this project's jobs (repeatable; default: every project).",
            show_default=False,
        ),
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Issue a token (admin), shown once; only its hash is kept.

    With --role: an API token for a person or a script (pitstop --token, PITSTOP_TOKEN).
    Without: a one-time join token that enrolls a node.
    """
    if role is None:
        if project:
            raise typer.BadParameter(
                "--project limits an API token: give --role and --name too (a join token "
                "enrolls a node, whatever its jobs' projects)",
                param_hint="--project",
            )
        if name:
            raise typer.BadParameter(
                "--name names an API token: give --role viewer|operator|admin too (a join "
                "token has no name)",
                param_hint="--name",
            )
        _create_join_token(ctx, parse_duration(ttl or JOIN_TOKEN_TTL), node_id, json_out)
        return
    if node_id:
        raise typer.BadParameter(
            "--node-id is for join tokens; an API token is for a person or a script",
            param_hint="--node-id",
        )
    if not name:
        raise typer.BadParameter("an API token needs a unique name, e.g. --name alice")
    seconds = parse_duration(ttl) if ttl else 0
    with open_client(ctx) as client:
        made = client.create_api_token(
            name, parse_enum_word(ROLES, role), seconds, projects=project or ()
        )
    if json_out:
        print_json({"token": made.token, **to_json(made.record)})
        return
    typer.echo(made.token)
    expiry = token_expiry(made.record, datetime.now(UTC))
    until = "with no expiry" if expiry == "never" else f"valid until {expiry}"
    if made.record.projects:
        until += f", limited to project(s) {', '.join(made.record.projects)}"
    typer.echo(
        f"API token {made.record.name!r} ({token_role(made.record)}), {until}: shown only "
        "now (the scheduler keeps its hash); use it with pitstop --token or PITSTOP_TOKEN",
        err=True,
    )


def _create_join_token(ctx: typer.Context, seconds: int, node_id: str, json_out: bool) -> None:
    with open_client(ctx) as client:
        made = client.create_join_token(seconds, node_id)
    expires = made.expires_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S UTC")
    if json_out:
        print_json({"token": made.token, "node_id": made.node_id, "expires_at": expires})
        return
    typer.echo(made.token)
    who = f"node {made.node_id}" if made.node_id else "any one node"
    typer.echo(
        f"one-time join token for {who}, valid until {expires}: give it to the node's agent "
        "and checkpoint daemon (--join-token or PITSTOP_AGENT_JOIN_TOKEN)",
        err=True,
    )


@tokens_app.command("list")
def list_tokens(ctx: typer.Context, json_out: JsonFlag = False) -> None:
    """API tokens (admin): configured and issued ones, revoked and expired ones too;
    never a token or its hash."""
    with open_client(ctx) as client:
        tokens = client.list_api_tokens()
    if json_out:
        print_json([to_json(token) for token in tokens])
    elif not tokens:
        typer.echo("no API tokens: the API is open (every caller is admin)")
    else:
        console().print(api_tokens_table(tokens, datetime.now(UTC)))


@tokens_app.command("revoke")
def revoke(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The API token's name (pitstop token list).")],
    json_out: JsonFlag = False,
) -> None:
    """Revoke an issued API token (admin): the scheduler answering refuses it from the next
    call, every other scheduler process within a second. A configured token is removed
    from the scheduler's config file instead."""
    with open_client(ctx) as client:
        token = client.revoke_api_token(name)
    if json_out:
        print_json(to_json(token))
    else:
        typer.echo(
            f"revoked API token {token.name} ({token_role(token)}) at "
            f"{format_time(token.revoked_at)} by {token.revoked_by}"
        )
