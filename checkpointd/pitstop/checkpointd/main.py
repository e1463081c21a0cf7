"""`pitstop-checkpointd`: the per-node checkpoint daemon."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Annotated, NoReturn

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import typer

from pitstop.checkpointd.config import CheckpointdSettings, load_settings
from pitstop.checkpointd.daemon import CheckpointDaemon
from pitstop.checkpointd.instances import remove_stale_segments, segment_prefix
from pitstop.common.enrollment import EnrollmentError, enroll
from pitstop.common.settings import configure_logging, settings_or_exit
from pitstop.common.tls import NodeIdentity
from pitstop.rankside.shm import SHM_DIR

app = typer.Typer(add_completion=False, no_args_is_help=True, help="The pitstop checkpoint daemon.")
log = logging.getLogger("pitstop.checkpointd")

EXIT_CANNOT_START = 1


@app.command()
def run(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file")] = None,
    node_id: Annotated[str | None, typer.Option(help="Node id [host name]")] = None,
    scheduler: Annotated[str | None, typer.Option(help="Scheduler host:port; '' for none")] = None,
    host: Annotated[str | None, typer.Option(help="Address to serve on [0.0.0.0]")] = None,
    port: Annotated[int | None, typer.Option(help="Port; 0 picks a free one")] = None,
    memory_budget_bytes: Annotated[
        int | None, typer.Option(help="Shared-memory budget; 0: half of /dev/shm")
    ] = None,
    state_dir: Annotated[Path | None, typer.Option(help="State directory")] = None,
    durable_url: Annotated[str | None, typer.Option(help="fsspec URL of the durable store")] = None,
    buddy: Annotated[str | None, typer.Option(help="Buddy's checkpointd host:port")] = None,
    flush_every_steps: Annotated[
        int | None, typer.Option(help="Durable flush every M steps; 0: Young/Daly")
    ] = None,
    keep_in_memory: Annotated[int | None, typer.Option(help="Snapshots kept per rank")] = None,
    keep_durable: Annotated[int | None, typer.Option(help="Durable checkpoints kept")] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG, INFO, WARNING [INFO]")] = None,
    tls_dir: Annotated[
        Path | None,
        typer.Option(help="The node's identity (the agent's <state_dir>/tls): mutual TLS"),
    ] = None,
    join_token: Annotated[
        str | None,
        typer.Option(
            help="One-time join token to enroll the node with at start (with --tls-dir); "
            "better PITSTOP_CHECKPOINTD_JOIN_TOKEN, out of `ps`",
            show_default=False,
        ),
    ] = None,
    ca_file: Annotated[
        Path | None,
        typer.Option(help="The cluster CA certificate to enroll against [tls-dir/ca.crt]"),
    ] = None,
) -> None:
    """Serve until SIGTERM or SIGINT; then unlink every shared-memory segment and exit."""
    settings = settings_or_exit(
        "pitstop-checkpointd",
        lambda: load_settings(
            config,
            node_id=node_id,
            scheduler=scheduler,
            host=host,
            port=port,
            memory_budget_bytes=memory_budget_bytes,
            state_dir=state_dir,
            durable_url=durable_url,
            buddy=buddy,
            flush_every_steps=flush_every_steps,
            keep_in_memory=keep_in_memory,
            keep_durable=keep_durable,
            log_level=log_level,
            tls_dir=tls_dir,
            join_token=join_token,
            ca_file=ca_file,
        ),
    )
    configure_logging(settings.log_level_number)
    try:
        asyncio.run(_serve(settings))
    except (OSError, RuntimeError, ValueError) as exc:
        _fail(f"cannot start: {exc}", EXIT_CANNOT_START)


def _enroll(settings: CheckpointdSettings) -> None:
    """With a join token and no valid certificate in tls_dir yet: enroll the node (its
    agent, sharing tls_dir, then finds it enrolled)."""
    if settings.tls_dir is None or not settings.join_token:
        return
    identity = NodeIdentity(settings.tls_dir, settings.node_id)
    try:
        enroll(
            identity,
            settings.scheduler,
            settings.join_token,
            settings.ca_file or identity.ca_path,
        )
    except EnrollmentError as exc:
        raise RuntimeError(str(exc)) from exc


async def _serve(settings: CheckpointdSettings) -> None:
    await asyncio.to_thread(_enroll, settings)
    daemon = CheckpointDaemon(settings)
    try:
        await daemon.start()
        print(
            f"pitstop-checkpointd {settings.node_id} listening on {daemon.address} "
            f"(buddy {settings.buddy or 'from the scheduler'}, durable {settings.durable_url}, "
            f"budget {daemon.pool.budget_bytes} bytes)",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping: in-memory snapshots are dropped")
    finally:
        await daemon.stop()
    log.info("stopped")


@app.command()
def cleanup(
    node_id: Annotated[str, typer.Option(help="Node id of the daemon that left them")],
) -> None:
    """Remove the shared-memory segments that killed daemons of NODE_ID left in
    /dev/shm. Those of a daemon still running (of this node id, in any cluster on this
    host) are never touched."""
    removed = remove_stale_segments(segment_prefix(node_id), SHM_DIR)
    typer.echo(f"removed {len(removed)} segments")


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"pitstop-checkpointd: {message}", err=True)
    raise typer.Exit(code)


def main() -> None:
    """Console entry point."""
    app()


if __name__ == "__main__":
    main()
