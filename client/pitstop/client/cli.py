"""The ``pitstop`` command line: global options, command groups, and one place where
errors become a single line on stderr and an exit code."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer
from typer.core import TyperGroup

from pitstop.client.cli_cluster import cluster_app
from pitstop.client.cli_context import Settings
from pitstop.client.cli_events import events
from pitstop.client.cli_jobs import jobs_app
from pitstop.client.cli_nodes import nodes_app
from pitstop.client.cli_projects import quota_app
from pitstop.client.cli_tokens import tokens_app
from pitstop.client.client import CA_CERT_ENV, DEFAULT_SERVER, SERVER_ENV, TOKEN_ENV
from pitstop.client.errors import PitstopError, code_name
from pitstop.client.jobspec import JobSpecError

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


def describe_error(error: PitstopError, server: str, token_given: bool, tls: bool = True) -> str:
    """The one line a person sees for a failed call, with what to do about it."""
    if error.unreachable:
        line = (
            f"cannot reach the pitstop scheduler at {server} (UNAVAILABLE); "
            "start it with pitstop-scheduler or pass --server"
        )
        if not tls:
            line += f"; if it serves TLS (the default), pass --ca-cert or set {CA_CERT_ENV}"
        return line
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (
            f"the pitstop scheduler at {server} did not answer in time (DEADLINE_EXCEEDED); "
            "check that it is healthy or raise --timeout"
        )
    message = " ".join(error.details.split())
    line = f"{message} ({code_name(error.code)})"
    if error.code == grpc.StatusCode.UNAUTHENTICATED and not token_given:
        line += f"; pass --token or set {TOKEN_ENV}"
    return line


class _PitstopGroup(TyperGroup):
    """The root group: turns every expected failure into ``error: ...`` and exit 1."""

    # Any: the base class types ctx as typer's private vendored click Context.
    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except PitstopError as error:
            settings = ctx.obj if isinstance(ctx.obj, Settings) else None
            server = settings.server if settings else DEFAULT_SERVER
            token_given = bool(settings and settings.token)
            tls = bool(settings and settings.ca_cert)
            _fail(describe_error(error, server, token_given, tls))
        except grpc.RpcError as error:  # a path that escaped the client's wrapping
            server = ctx.obj.server if isinstance(ctx.obj, Settings) else DEFAULT_SERVER
            _fail(describe_error(PitstopError.from_rpc_error(error), server, False))
        except (JobSpecError, OSError) as error:
            _fail(str(error))
        except KeyboardInterrupt:
            raise typer.Exit(EXIT_INTERRUPTED) from None


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_FAILED)


app = typer.Typer(
    cls=_PitstopGroup,
    help="Operate a pitstop cluster: jobs, nodes and the event log.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(jobs_app, name="job")
app.add_typer(nodes_app, name="node")
app.add_typer(cluster_app, name="cluster")
app.add_typer(tokens_app, name="token")
app.add_typer(quota_app, name="quota")
app.command("events")(events)


@app.callback()
def _global_options(
    ctx: typer.Context,
    server: Annotated[
        str, typer.Option("--server", envvar=SERVER_ENV, help="Scheduler address, host:port.")
    ] = DEFAULT_SERVER,
    token: Annotated[
        str | None,
        typer.Option("--token", envvar=TOKEN_ENV, help="Bearer token.", show_default=False),
    ] = None,
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.1, help="Seconds to wait for each call.")
    ] = 10.0,
    ca_cert: Annotated[
        Path | None,
        typer.Option(
            "--ca-cert",
            envvar=CA_CERT_ENV,
            dir_okay=False,
            help="CA certificate (PEM) to verify the scheduler with; enables TLS.",
        ),
    ] = None,
) -> None:
    """Operate a pitstop cluster: jobs, nodes and the event log."""
    ctx.obj = Settings(server=server, token=token or None, timeout=timeout, ca_cert=ca_cert)


def main() -> None:
    """Entry point of the ``pitstop`` console script.

    Once the command is done and its output flushed, the process ends with `os._exit`,
    skipping the interpreter's teardown and with it gRPC's: its C core can hang there
    after a cancelled stream (a `pitstop job watch` in the Slurm recipe printed the job's
    end and then never exited, one thread left in a futex wait, in about one run in four
    under load; grpc/grpc#39258 is one such shutdown hang). A command has nothing left to
    tear down: its calls and channel are closed by then."""
    try:
        app(prog_name="pitstop")
        code: int | str | None = 0
    except SystemExit as done:
        code = done.code
    end_process(code)


def end_process(code: int | str | None) -> None:
    """Flush what the command printed and end the process with `code` (SystemExit's
    meaning: None is 0, text is printed and means 1), without the interpreter's teardown."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = EXIT_FAILED
    for stream in (sys.stdout, sys.stderr):
        # A closed pipe or stream: nothing more can be said.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code or 0)
