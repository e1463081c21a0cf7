"""``pitstop job ...``: submit, inspect, control and follow jobs."""

from __future__ import annotations

import contextlib
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from pitstop.client.cli_context import (
    JsonFlag,
    ReasonOption,
    console,
    open_client,
    parse_words,
    print_json,
    print_json_line,
)
from pitstop.client.enums import JOB_STATES, enum_words
from pitstop.client.jobspec import load_job_spec
from pitstop.client.render import ends_job, event_line, to_json
from pitstop.client.render_jobs import job_state, job_view, jobs_table, queue_table
from pitstop.client.render_record import diff_records, diff_view, record_view
from pitstop.common.codeversion import code_version
from pitstop.v1 import jobs_pb2

jobs_app = typer.Typer(help="Submit, inspect and control training jobs.", no_args_is_help=True)

JobArgument = Annotated[str, typer.Argument(help="Job id, e.g. j-4f1c2a9b0d3e.")]


def _announce(job: jobs_pb2.Job, verb: str) -> None:
    reason = f" ({job.reason})" if job.reason else ""
    typer.echo(f"{verb} job {job.id}: {job_state(job)}{reason}")


@jobs_app.command("submit")
def submit(
    ctx: typer.Context,
    file: Annotated[
        Path, typer.Option("--file", "-f", help="YAML job spec.", dir_okay=False, exists=False)
    ],
    json_out: JsonFlag = False,
) -> None:
    """Submit the job described by a YAML spec; prints the new job's id and state. The
    git commit (and uncommitted changes) of the spec's working_dir, else of the current
    directory, go with it into the job's record."""
    spec = load_job_spec(file)
    code = code_version(spec.working_dir or os.getcwd())
    with open_client(ctx) as client:
        job = client.submit_job(spec, code=code)
    if json_out:
        print_json(to_json(job))
    else:
        _announce(job, f"submitted {job.spec.name or 'job'} as")


@jobs_app.command("list")
def list_jobs(
    ctx: typer.Context,
    state: Annotated[
        list[str] | None,
        typer.Option(
            "--state",
            help=f"Only jobs in this state (repeatable): {', '.join(enum_words(JOB_STATES))}.",
        ),
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Jobs, newest first."""
    states = parse_words(JOB_STATES, state, "--state")
    with open_client(ctx) as client:
        jobs = client.list_jobs(states=states)
    if json_out:
        print_json([to_json(job) for job in jobs])
    elif not jobs:
        typer.echo("no jobs" + (" in that state" if states else ""))
    else:
        console().print(jobs_table(jobs, datetime.now(UTC)))
        queue = queue_table(jobs)
        if queue is not None:
            console().print("\nqueue (pending jobs, in the order they are considered):")
            console().print(queue)


@jobs_app.command("show")
def show(ctx: typer.Context, job_id: JobArgument, json_out: JsonFlag = False) -> None:
    """A job's spec, state, rank map, goodput, step times and result."""
    with open_client(ctx) as client:
        job = client.get_job(job_id)
    if json_out:
        print_json(to_json(job))
    else:
        console().print(job_view(job, datetime.now(UTC)))


@jobs_app.command("record")
def record(ctx: typer.Context, job_id: JobArgument, json_out: JsonFlag = False) -> None:
    """A job's experiment record: spec, code, environment, data, durable checkpoints,
    goodput, skipped steps and result."""
    with open_client(ctx) as client:
        found = client.job_record(job_id)
    if json_out:
        print_json(to_json(found))
    else:
        console().print(record_view(found))


@jobs_app.command("diff")
def diff(
    ctx: typer.Context,
    job_a: Annotated[str, typer.Argument(help="One job id.")],
    job_b: Annotated[str, typer.Argument(help="The job id to compare it with.")],
    json_out: JsonFlag = False,
) -> None:
    """Compare two jobs' records key by key: every value that differs, every key only
    one has; the keys that name a run (its id, times, nodes) apart, as identity."""
    with open_client(ctx) as client:
        a, b = client.job_record(job_a), client.job_record(job_b)
    found = diff_records(a, b)
    if json_out:
        print_json(found.to_json())
    else:
        console().print(diff_view(found, job_a, job_b))


@jobs_app.command("stacks")
def stacks(
    ctx: typer.Context,
    job_id: JobArgument,
    incident: Annotated[
        int, typer.Option("--incident", min=0, help="The hang incident (default: the newest).")
    ] = 0,
    json_out: JsonFlag = False,
) -> None:
    """The Python stacks of a job's ranks, taken when it hung, and the ranks they name."""
    with open_client(ctx) as client:
        found = client.job_stacks(job_id, incident)
    if json_out:
        print_json(to_json(found))
        return
    if not found.incident:
        typer.echo(f"job {job_id} never hung: no stacks were taken")
        return
    others = [str(i) for i in found.incidents if i != found.incident]
    typer.echo(
        f"hang incident {found.incident} of job {job_id}"
        + (f" (others: {', '.join(others)})" if others else "")
    )
    named = ", ".join(str(r) for r in found.hung_ranks) or "none"
    typer.echo(f"hung ranks: {named} ({found.verdict})")
    for each in found.stacks:
        how = each.method or f"not taken: {each.error}"
        typer.echo(f"\n--- rank {each.rank} ({how})")
        typer.echo(each.text.rstrip() or each.error)


@jobs_app.command("cancel")
def cancel(ctx: typer.Context, job_id: JobArgument, reason: ReasonOption = "") -> None:
    """Stop a job for good."""
    with open_client(ctx) as client:
        _announce(client.cancel_job(job_id, reason), "cancelled")


@jobs_app.command("pause")
def pause(ctx: typer.Context, job_id: JobArgument, reason: ReasonOption = "") -> None:
    """Pause a running job at its next step boundary, its state kept in memory."""
    with open_client(ctx) as client:
        _announce(client.pause_job(job_id, reason), "paused")


@jobs_app.command("resume")
def resume(ctx: typer.Context, job_id: JobArgument, reason: ReasonOption = "") -> None:
    """Continue a paused job."""
    with open_client(ctx) as client:
        _announce(client.resume_job(job_id, reason), "resumed")


@jobs_app.command("watch")
def watch(
    ctx: typer.Context,
    job_id: JobArgument,
    after: Annotated[int, typer.Option("--after", help="Replay events after this id.")] = 0,
    json_out: JsonFlag = False,
) -> None:
    """Print a job's events as they happen, until it ends (or Ctrl-C)."""
    with open_client(ctx) as client:
        try:
            # Closed (its stream ended, its reader out of gRPC) before the channel is.
            with contextlib.closing(client.watch_job(job_id, after_event_id=after)) as events:
                for event in events:
                    if json_out:
                        print_json_line(to_json(event))
                    else:
                        typer.echo(event_line(event))
                    if event.job_id == job_id and ends_job(event):
                        return
        except KeyboardInterrupt:
            return
