"""What a local cluster's daemons are started with: each one's environment (tagged with
the cluster and its own name) and a node's command lines (where it listens, its network
namespace, its identity, its agent's socket), built with `pitstop.client.launch`."""

from __future__ import annotations

import hashlib
import os
import shlex
import tempfile
from collections.abc import Mapping
from pathlib import Path

from pitstop.client import launch
from pitstop.client.localcluster.errors import ClusterError
from pitstop.client.localcluster.settings import CHECKPOINTD_ENV, CLUSTER_ENV, DAEMON_ENV
from pitstop.client.localcluster.statefile import ClusterState, NodeSpec
from pitstop.common.tls import NodeIdentity

# AF_UNIX paths hold 108 bytes with the terminating NUL.
_MAX_SOCKET_PATH = 100


def binary(name: str) -> str:
    """A pitstop console script: next to the running python first, then on PATH."""
    try:
        return launch.binary(name)
    except launch.LaunchError as exc:
        raise ClusterError(str(exc)) from exc


class NodeCommands:
    """The environment and command lines of the daemons of the cluster `record`."""

    def __init__(self, record: ClusterState) -> None:
        self.record = record

    def daemon_env(self, extra: Mapping[str, str], name: str) -> dict[str, str]:
        """os.environ with the cluster's own `env` over it, `extra` where neither sets a
        key, and the tags that name the cluster and the daemon (`CLUSTER_ENV`, `DAEMON_ENV`)."""
        # Jobs say `python`: let it be this environment's, where pitstop is installed.
        env = launch.with_python_first(os.environ)
        # A daemon that dies at start leaves a plain traceback, whose last lines (the
        # ones `up` shows) name the error, rather than a boxed one.
        env.setdefault("_TYPER_STANDARD_TRACEBACK", "1")
        env.update(self.record.env)
        for key, value in extra.items():
            env.setdefault(key, value)
        env[CLUSTER_ENV] = str(self.record.state_dir)
        env[DAEMON_ENV] = name
        return env

    def identity(self, node_id: str) -> NodeIdentity:
        """The node's identity: its agent's state dir/tls, shared with its checkpointd."""
        return NodeIdentity(self.record.state_dir / "nodes" / node_id / "agent" / "tls", node_id)

    def in_namespace(self, node_id: str, argv: list[str]) -> list[str]:
        """`argv` run in the node's network namespace, if it has one."""
        network = self.record.network
        return argv if network is None else [*network.exec_prefix(node_id), *argv]

    def node_host(self, node_id: str) -> str:
        """The address the node's daemons listen on and its ranks are reached at."""
        network = self.record.network
        return "127.0.0.1" if network is None else network.link(node_id).address

    def checkpointd_argv(self, spec: NodeSpec, port: int) -> list[str]:
        record = self.record
        binary("pitstop-checkpointd")  # ClusterError, naming it, when it is missing
        return launch.checkpointd_command(
            node_id=spec.node_id,
            host=self.node_host(spec.node_id),
            port=port,
            scheduler=record.scheduler_target,
            state_dir=record.state_dir / "nodes" / spec.node_id / "checkpointd",
            # One durable store for the whole cluster, as a shared bucket would be: a
            # spare restores what a dead node flushed.
            durable_url=(record.state_dir / "durable").as_uri(),
            tls_dir=self.identity(spec.node_id).directory if record.tls else None,
        )

    def agent_argv(self, spec: NodeSpec, socket: Path, checkpointd_address: str) -> list[str]:
        record = self.record
        binary("pitstop-agent")  # ClusterError, naming it, when it is missing
        owned = record.agent_owns_checkpointd
        return launch.agent_command(
            node_id=spec.node_id,
            scheduler=record.scheduler_target,
            gpus=f"sim:{spec.gpus}",
            zone="z1",
            block="b1",
            rack=spec.rack,
            role=spec.role,
            state_dir=agent_dir(record, spec.node_id),
            socket_path=socket,
            checkpointd_address=checkpointd_address,
            metrics_port=0,
            # Enrolled by its checkpoint daemon, started first.
            tls=True if record.ca_cert is not None else None,
            ca_file=record.ca_cert,
            checkpointd_command=(
                self.owned_checkpointd_command(spec, checkpointd_address) if owned else None
            ),
            advertise_host=self.node_host(spec.node_id) if record.network is not None else None,
        )

    def owned_checkpointd_command(self, spec: NodeSpec, address: str) -> str:
        """The command the agent starts its checkpoint daemon with: the one the cluster
        started, on the same port, with the daemon's own environment and name (so that
        `down`, `kill_node` and the never-twice check find it as the node's daemon)."""
        name = f"checkpointd-{spec.node_id}"
        daemon_env = self.daemon_env(CHECKPOINTD_ENV, name)
        settings = [f"{key}={daemon_env[key]}" for key in CHECKPOINTD_ENV]
        port = int(address.rsplit(":", 1)[1])
        return shlex.join(
            ["env", f"{DAEMON_ENV}={name}", *settings, *self.checkpointd_argv(spec, port)]
        )

    def socket_path(self, node_id: str) -> Path:
        """The agent's socket in its state dir, or, when that path is too long for a
        Unix socket, in a private folder under the temp dir named for this cluster."""
        socket = agent_dir(self.record, node_id) / "agent.sock"
        if len(str(socket)) <= _MAX_SOCKET_PATH:
            return socket
        digest = hashlib.sha256(str(self.record.state_dir).encode()).hexdigest()[:12]
        folder = Path(tempfile.gettempdir()) / f"pitstop-{digest}"
        folder.mkdir(mode=0o700, exist_ok=True)
        return folder / f"{node_id}.sock"


def agent_dir(record: ClusterState, node_id: str) -> Path:
    """The node's agent's state dir."""
    return record.state_dir / "nodes" / node_id / "agent"
