"""``pitstop quota ...``: projects' GPU quotas (a job names its project in its spec)."""

from __future__ import annotations

from typing import Annotated

import typer

from pitstop.client.cli_context import JsonFlag, console, open_client, print_json
from pitstop.client.render import add_row, format_time, table, timestamp_is_set, to_json
from pitstop.v1 import jobs_pb2

quota_app = typer.Typer(
    help="Projects' GPU quotas: a job over its project's quota waits until the project frees GPUs.",
    no_args_is_help=True,
)


def quota_word(project: jobs_pb2.Project) -> str:
    return "unlimited" if project.unlimited else str(project.gpu_quota)


@quota_app.command("set")
def set_quota(
    ctx: typer.Context,
    project: Annotated[str, typer.Argument(help="The project, as jobs name it (project:).")],
    gpus: Annotated[
        int | None,
        typer.Option("--gpus", min=0, help="GPUs the project's running jobs may hold at once."),
    ] = None,
    unlimited: Annotated[
        bool, typer.Option("--unlimited", help="Remove the quota: capacity is the only limit.")
    ] = False,
    json_out: JsonFlag = False,
) -> None:
    """Set a project's GPU quota (admin); records a project.quota_set event."""
    if (gpus is None) == (not unlimited):
        raise typer.BadParameter(
            "give --gpus N, or --unlimited to remove the quota", param_hint="--gpus"
        )
    with open_client(ctx) as client:
        done = client.set_quota(project, gpus, unlimited=unlimited)
    if json_out:
        print_json(to_json(done))
        return
    typer.echo(
        f"project {done.name}: GPU quota {quota_word(done)} ({done.gpus_in_use} in use, "
        f"{done.pending_jobs} jobs pending)"
    )


@quota_app.command("list")
def list_quotas(ctx: typer.Context, json_out: JsonFlag = False) -> None:
    """Every project with a quota or a job: its quota, the GPUs its jobs hold, its jobs
    waiting."""
    with open_client(ctx) as client:
        projects = client.list_projects()
    if json_out:
        print_json([to_json(p) for p in projects])
        return
    if not projects:
        typer.echo("no projects yet: jobs go to project default unless their spec names one")
        return
    result = table("PROJECT", "QUOTA", "IN USE", "PENDING", "SET")
    for project in projects:
        when = (
            f"{format_time(project.updated_at)} by {project.updated_by or '?'}"
            if timestamp_is_set(project.updated_at)
            else "-"
        )
        add_row(
            result,
            (
                project.name,
                quota_word(project),
                project.gpus_in_use,
                project.pending_jobs,
                when,
            ),
        )
    console().print(result)
