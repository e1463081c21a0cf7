"""``pitstop cluster up|status|cut|heal|down``: a local cluster of real daemons on this
machine."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from pitstop.client.cli_context import JsonFlag, console, print_json
from pitstop.client.client import CA_CERT_ENV, SERVER_ENV, TOKEN_ENV
from pitstop.client.enums import NODE_ROLES, NODE_STATES, enum_word
from pitstop.client.errors import PitstopError
from pitstop.client.localcluster import (
    DEFAULT_PORT,
    DEFAULT_STATE_DIR,
    DEFAULT_TIMEOUT,
    STOP_TIMEOUT,
    ClusterError,
    LocalCluster,
    stop_cluster,
    tagged_processes,
    wipe_state_dir,
)
from pitstop.client.render import add_row, table
from pitstop.client.render_nodes import nodes_table
from pitstop.v1 import nodes_pb2

cluster_app = typer.Typer(
    help="Run a local cluster: a scheduler, and a checkpoint daemon and an agent per node.",
    no_args_is_help=True,
)

StateDirOption = Annotated[
    Path,
    typer.Option(
        "--state-dir",
        file_okay=False,
        help="Where the cluster keeps its state, logs and cluster.json.",
    ),
]


@contextmanager
def _cluster_errors() -> Iterator[None]:
    """A ClusterError becomes ``error: ...`` on stderr and exit 1."""
    try:
        yield
    except ClusterError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None


def _count(n: int, noun: str, plural: str = "s") -> str:
    return f"{n} {noun}{'' if n == 1 else plural}"


def _lost_after(cluster: LocalCluster) -> str:
    return (
        f"a host gone silent is lost within {cluster.silent_host_timeout:g} s, "
        f"a hung agent after {cluster.liveness_timeout:g} s"
    )


def _status_console() -> Console:
    # Progress goes to stderr: stdout holds only the result.
    return Console(stderr=True, highlight=False)


@cluster_app.command("up")
def up(
    nodes: Annotated[int, typer.Option("--nodes", min=1, help="Worker nodes.")] = 2,
    spares: Annotated[int, typer.Option("--spares", min=0, help="Spare nodes.")] = 1,
    state_dir: StateDirOption = DEFAULT_STATE_DIR,
    port: Annotated[
        int,
        typer.Option("--port", min=0, max=65535, help="Scheduler port; 0 picks a free one."),
    ] = DEFAULT_PORT,
    database_url: Annotated[
        str | None,
        typer.Option(
            "--database-url",
            help="PostgreSQL URL for the scheduler; default: an embedded server "
            "(or PITSTOP_DATABASE_URL).",
            show_default=False,
        ),
    ] = None,
    redis_url: Annotated[
        str | None,
        typer.Option(
            "--redis-url",
            help="Redis URL for the scheduler; default: an embedded server (or PITSTOP_REDIS_URL).",
            show_default=False,
        ),
    ] = None,
    gpus_per_node: Annotated[
        int, typer.Option("--gpus-per-node", min=1, help="Simulated GPUs per node.")
    ] = 1,
    netns: Annotated[
        bool,
        typer.Option(
            "--netns",
            help="Run each node in a network namespace of its own (root and iproute2), so "
            "pitstop cluster cut can cut one off.",
        ),
    ] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", min=1.0, help="Seconds to wait for every node.")
    ] = DEFAULT_TIMEOUT,
    liveness_timeout: Annotated[
        float | None,
        typer.Option(
            "--liveness-timeout",
            help="Seconds without a heartbeat before a node is lost (a hung agent whose "
            "connection still answers; a dead one is seen at once, a host gone silent "
            "within 1 s by the connection's keepalive); default 2 (or "
            "PITSTOP_LIVENESS_TIMEOUT_INTERVALS beats of 0.25 s).",
            show_default=False,
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="Plaintext everywhere and an open API (no CA, no enrollment, no token); "
            "only for trying things out.",
        ),
    ] = False,
) -> None:
    """Start a scheduler and each node's daemons, detached; wait until every node is ready.

    Secure by default: the scheduler makes a cluster CA, every node enrolls with a
    one-time join token and talks mutual TLS, and the API wants the cluster's admin
    token (printed below as the variables the CLI reads)."""
    began = time.monotonic()
    with _cluster_errors(), _status_console().status("starting the cluster") as status:
        cluster = LocalCluster.up(
            state_dir,
            nodes=nodes,
            spares=spares,
            port=port,
            database_url=database_url,
            redis_url=redis_url,
            gpus_per_node=gpus_per_node,
            netns=netns,
            timeout=timeout,
            liveness_timeout=liveness_timeout,
            progress=lambda message: status.update(message),
            insecure=insecure,
        )
        ready = cluster.wait_ready(timeout=timeout)
    elapsed = time.monotonic() - began
    out = console()
    out.print(
        f"cluster up in {elapsed:.1f} s: scheduler at {cluster.scheduler_address}, "
        f"{_count(len(ready), 'node')} ready (state and logs in {cluster.state_dir}); "
        f"{_lost_after(cluster)}"
    )
    out.print(nodes_table(ready, datetime.now(UTC)))
    if cluster.network is not None:
        typer.echo(_network_line(cluster))
    if cluster.dashboard_url:
        signin = f" (sign in with the token in {cluster.admin_token_file})" if cluster.tls else ""
        typer.echo(f"dashboard: {cluster.dashboard_url}{signin}")
    typer.echo(f"stop it with: pitstop cluster down --state-dir {cluster.state_dir}")
    typer.echo(f"export {SERVER_ENV}={cluster.scheduler_address}")
    if cluster.ca_cert is not None:
        typer.echo(f"export {CA_CERT_ENV}={cluster.ca_cert}")
        typer.echo(f'export {TOKEN_ENV}="$(cat {cluster.admin_token_file})"')
    else:
        typer.echo("insecure: plaintext wires, and the API open to anyone who reaches it")


def _network_line(cluster: LocalCluster) -> str:
    network = cluster.network
    assert network is not None
    cut = cluster.cut_off()
    return (
        f"each node in a network namespace of its own, on bridge {network.bridge} "
        f"({network.gateway}/{network.prefix_len}); cut off: {', '.join(cut) or 'none'}"
    )


def _node_json(node: nodes_pb2.Node) -> dict[str, Any]:
    return {
        "id": node.id,
        "role": enum_word(NODE_ROLES, node.role),
        "state": enum_word(NODE_STATES, node.state),
        "reason": node.reason,
        "connected": node.connected,
        "rack": node.labels.rack,
        "gpus": len(node.inventory.gpus),
        "checkpointd_address": node.inventory.checkpointd_address,
    }


@cluster_app.command("status")
def status(state_dir: StateDirOption = DEFAULT_STATE_DIR, json_out: JsonFlag = False) -> None:
    """Every daemon of the cluster, alive or dead, and the scheduler's nodes."""
    with _cluster_errors():
        cluster = LocalCluster.load(state_dir)
    root = state_dir.expanduser().absolute()
    if cluster is None:
        # No cluster.json; an `up` killed mid-way may still have left daemons running.
        strays = [t for t in tagged_processes(root) if t.is_daemon()]
        if json_out:
            print_json(
                {
                    "state_dir": str(root),
                    "running": bool(strays),
                    "scheduler_address": None,
                    "processes": [
                        {"name": t.daemon, "pid": t.pid, "alive": True, "recorded": False}
                        for t in strays
                    ],
                    "nodes": None,
                    "network": None,
                    "error": None,
                }
            )
        elif strays:
            pids = ", ".join(f"{t.daemon} (pid {t.pid})" for t in strays)
            typer.echo(
                f"no cluster.json in {root}, but daemons of a cluster there run: {pids}; "
                f"pitstop cluster down --state-dir {root} stops them"
            )
        else:
            typer.echo(f"no cluster runs in {root}")
        return
    alive = {p.name: p.alive() for p in cluster.processes}
    nodes: list[nodes_pb2.Node] | None = None
    error = None
    if alive.get("scheduler"):
        try:
            nodes = cluster.list_nodes(timeout=3.0)
        except (PitstopError, ClusterError) as exc:
            error = f"the scheduler at {cluster.scheduler_address} did not answer: {exc}"
    else:
        error = "the scheduler does not run"
    if json_out:
        print_json(
            {
                "state_dir": str(cluster.state_dir),
                "running": any(alive.values()),
                "scheduler_address": cluster.scheduler_address,
                "liveness_timeout_seconds": cluster.liveness_timeout,
                "silent_host_timeout_seconds": cluster.silent_host_timeout,
                "tls": cluster.tls,
                "ca_cert": None if cluster.ca_cert is None else str(cluster.ca_cert),
                "admin_token_file": str(cluster.admin_token_file) if cluster.tls else None,
                "dashboard_url": cluster.dashboard_url or None,
                "processes": [
                    {
                        "name": p.name,
                        "kind": p.kind,
                        "node_id": p.node_id or None,
                        "pid": p.pid,
                        "alive": alive[p.name],
                        "address": p.address or None,
                        "node_address": p.node_address or None,
                        "log": str(p.log),
                    }
                    for p in cluster.processes
                ],
                "nodes": None if nodes is None else [_node_json(n) for n in nodes],
                "network": None
                if cluster.network is None
                else {**cluster.network.to_json(), "cut_off": cluster.cut_off()},
                "error": error,
            }
        )
        return
    out = console()
    if not any(alive.values()):
        out.print(
            f"nothing runs in {cluster.state_dir} (every daemon of the cluster there is gone); "
            f"pitstop cluster down --state-dir {cluster.state_dir} cleans up"
        )
    else:
        out.print(
            f"cluster in {cluster.state_dir}: scheduler at {cluster.scheduler_address}; "
            f"{_lost_after(cluster)}"
        )
    processes = table("NAME", "PID", "ALIVE", "ADDRESS")
    for p in cluster.processes:
        add_row(processes, (p.name, p.pid, "yes" if alive[p.name] else "no", p.address or "-"))
    out.print(processes)
    out.print(f"logs: {cluster.log_dir}/<name>.log")
    if cluster.network is not None:
        out.print(_network_line(cluster))
    if nodes is not None:
        out.print(nodes_table(nodes, datetime.now(UTC)) if nodes else "no nodes registered")
    elif any(alive.values()):
        out.print(error)


NodeArgument = Annotated[str, typer.Argument(help="The node, e.g. node-2.", show_default=False)]


def _running(state_dir: Path) -> LocalCluster:
    cluster = LocalCluster.load(state_dir)
    if cluster is None:
        raise ClusterError(
            f"no cluster runs in {state_dir.expanduser().absolute()}; "
            "start one with pitstop cluster up --netns"
        )
    return cluster


@cluster_app.command("cut")
def cut(node: NodeArgument, state_dir: StateDirOption = DEFAULT_STATE_DIR) -> None:
    """Cut a node off the network, its processes alive (a cluster up with --netns)."""
    with _cluster_errors():
        _running(state_dir).cut(node)
    typer.echo(f"cut {node} off: its link is down; bring it back with pitstop cluster heal {node}")


@cluster_app.command("heal")
def heal(node: NodeArgument, state_dir: StateDirOption = DEFAULT_STATE_DIR) -> None:
    """Bring a node that was cut off back onto the network."""
    with _cluster_errors():
        _running(state_dir).heal(node)
    typer.echo(f"{node} is back on the network")


@cluster_app.command("down")
def down(
    state_dir: StateDirOption = DEFAULT_STATE_DIR,
    wipe: Annotated[
        bool, typer.Option("--wipe", help="Also delete the state dir (database, logs).")
    ] = False,
    timeout: Annotated[
        float,
        typer.Option("--timeout", min=0.0, help="Seconds after SIGTERM before SIGKILL."),
    ] = STOP_TIMEOUT,
) -> None:
    """Stop the agents, then the checkpoint daemons, then the scheduler, then anything
    else the cluster started (found by its environment, recorded or not)."""
    root = state_dir.expanduser().absolute()
    with _cluster_errors(), _status_console().status("stopping the cluster"):
        stopped = stop_cluster(root, timeout=timeout)
        wiped = wipe and wipe_state_dir(root)
    if stopped is None:
        typer.echo(f"no cluster runs in {root}")
    else:
        typer.echo(f"stopped {_count(len(stopped), 'process', 'es')} of the cluster in {root}")
    if wiped:
        typer.echo(f"removed {root}")
