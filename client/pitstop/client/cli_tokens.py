"""``pitstop token ...``: one-time join tokens for enrolling nodes."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from pitstop.client.cli_context import JsonFlag, open_client, print_json

tokens_app = typer.Typer(help="Join tokens that enroll nodes (mutual TLS).", no_args_is_help=True)

_DURATION = re.compile(r"^(\d+)([smhd]?)$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


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
    ttl: Annotated[str, typer.Option("--ttl", help="How long it works: 30m, 1h, 7d.")] = "1h",
    node_id: Annotated[
        str, typer.Option("--node-id", help="The only node it may enroll [any one node].")
    ] = "",
    json_out: JsonFlag = False,
) -> None:
    """Issue a one-time join token (admin). It is shown once; only its hash is kept."""
    seconds = parse_duration(ttl)
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
