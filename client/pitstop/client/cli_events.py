"""``pitstop events``: the event log, listed or followed."""

from __future__ import annotations

from typing import Annotated

import typer

from pitstop.client.cli_context import JsonFlag, open_client, print_json, print_json_line
from pitstop.client.render import event_line, to_json
from pitstop.v1 import common_pb2


def events(
    ctx: typer.Context,
    job: Annotated[str, typer.Option("--job", help="Only this job's events.")] = "",
    node: Annotated[str, typer.Option("--node", help="Only this node's events.")] = "",
    after: Annotated[
        int | None,
        typer.Option("--after", help="Events after this id. Default: the newest --limit events."),
    ] = None,
    limit: Annotated[
        int, typer.Option("--limit", min=1, max=1000, help="Most events to list.")
    ] = 100,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new events (Ctrl-C stops).")
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """List events from the log (the newest --limit, printed oldest first); with --follow,
    keep printing new ones."""

    def emit(event: common_pb2.Event) -> None:
        if json_out:
            print_json_line(to_json(event))
        else:
            typer.echo(event_line(event))

    try:
        with open_client(ctx) as client:
            # A negative cursor asks the server for the newest `limit` events.
            start = -1 if after is None else after
            backlog = client.list_events(
                job_id=job, node_id=node, after_event_id=start, limit=limit
            )
            if json_out and not follow:
                print_json([to_json(event) for event in backlog])
                return
            for event in backlog:
                emit(event)
            if not follow:
                return
            # Resume right after what was printed so nothing recorded in between is missed.
            cursor = backlog[-1].id if backlog else start
            for event in client.watch_events(job_id=job, node_id=node, after_event_id=cursor):
                emit(event)
    except KeyboardInterrupt:
        if not follow:
            raise
