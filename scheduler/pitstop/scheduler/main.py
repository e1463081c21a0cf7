"""`pitstop-scheduler`: the central gRPC server."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Annotated

import typer

# gRPC core logs at INFO when a child process forks (pgserver's pg_ctl); only its
# errors belong in the scheduler's output. Set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from pitstop.common.settings import configure_logging, settings_or_exit
from pitstop.common.tls import TlsError
from pitstop.scheduler.config import SchedulerSettings, load_settings
from pitstop.scheduler.embedded import EmbeddedUnavailable

app = typer.Typer(add_completion=False, help="Run the pitstop scheduler.")
log = logging.getLogger("pitstop.scheduler")


@app.command()
def serve(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file")] = None,
    host: Annotated[str | None, typer.Option(help="Address to bind [127.0.0.1]")] = None,
    port: Annotated[
        int | None, typer.Option(help="Port to bind; 0 picks a free one and prints it [50051]")
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Where embedded PostgreSQL and Redis keep data [.state/scheduler]"),
    ] = None,
    database_url: Annotated[
        str | None, typer.Option(help="PostgreSQL URL; empty starts an embedded server")
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="Redis URL; empty starts an embedded server")
    ] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Port of /metrics; 0 picks a free one [9401]")
    ] = None,
    dashboard_port: Annotated[
        int | None, typer.Option(help="Port of the web dashboard; 0 picks a free one [9402]")
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG, INFO, WARNING [INFO]")] = None,
) -> None:
    """Serve the pitstop API until SIGTERM or SIGINT."""
    settings = settings_or_exit(
        "pitstop-scheduler",
        lambda: load_settings(
            config,
            host=host,
            port=port,
            state_dir=state_dir,
            database_url=database_url,
            redis_url=redis_url,
            metrics_port=metrics_port,
            dashboard_port=dashboard_port,
            log_level=log_level,
        ),
        full_errors=True,
    )
    configure_logging(settings.log_level.upper())
    try:
        asyncio.run(_serve(settings))
    except EmbeddedUnavailable as exc:
        typer.echo(f"pitstop-scheduler: {exc}", err=True)
        raise typer.Exit(1) from None
    except OSError as exc:
        typer.echo(f"pitstop-scheduler: {exc}", err=True)
        raise typer.Exit(1) from None
    except TlsError as exc:  # the CA in tls_dir cannot be used
        typer.echo(f"pitstop-scheduler: tls: {exc}", err=True)
        raise typer.Exit(1) from None


async def _serve(settings: SchedulerSettings) -> None:
    from pitstop.scheduler.server import start_scheduler

    scheduler = await start_scheduler(settings)
    # One line a script can parse for the bound port (useful with --port 0).
    print(f"pitstop-scheduler listening on {scheduler.address}", flush=True)
    if scheduler.node_port:
        print(
            f"pitstop-scheduler nodes connect on {settings.host}:{scheduler.node_port}", flush=True
        )
    if scheduler.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", settings.metrics_host, scheduler.metrics_port)
    if scheduler.dashboard_url:
        log.info("dashboard on %s", scheduler.dashboard_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: no new calls, finishing in-flight ones")
    await scheduler.stop()
    log.info("stopped")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
